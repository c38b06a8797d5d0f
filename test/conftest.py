"""Session fixtures shared by the whole suite: one tiny random checkpoint and driving inputs;
and what keeps test files from changing each other: torch's thread count, SIGINT's handler."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import shutil
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from alpamayo_ros.core.types import NUM_HISTORY_POSES, DrivingInput
from alpamayo_ros.testing.threads import set_torch_threads


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Alpamayo checkpoint in the upstream layout, written once per session (fp32).

    Read-only for tests: copy it before changing anything in it.
    """
    from alpamayo_ros.core.tiny_checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"), seed=0)


@pytest.fixture(scope="session")
def make_driving_input() -> Callable[..., DrivingInput]:
    """Factory for a synthetic DrivingInput: random frames, ego driving straight at speed_mps."""

    def make(
        *,
        camera_indices: tuple[int, ...] = (1,),
        frames: int = 2,
        height: int = 320,
        width: int = 576,
        speed_mps: float = 8.0,
        route_text: str | None = None,
        seed: int = 0,
    ) -> DrivingInput:
        rng = np.random.default_rng(seed)
        images = rng.integers(0, 256, (len(camera_indices), frames, height, width, 3), dtype=np.uint8)
        t0_ns = 10_000_000_000
        stamps = t0_ns - np.arange(frames - 1, -1, -1, dtype=np.int64) * 100_000_000
        history_xyz = np.zeros((NUM_HISTORY_POSES, 3), dtype=np.float32)
        history_xyz[:, 0] = -speed_mps * 0.1 * np.arange(NUM_HISTORY_POSES - 1, -1, -1)
        history_rot = np.tile(np.eye(3, dtype=np.float32), (NUM_HISTORY_POSES, 1, 1))
        return DrivingInput(
            images=images,
            camera_indices=camera_indices,
            frame_stamps_ns=np.tile(stamps, (len(camera_indices), 1)),
            t0_ns=t0_ns,
            ego_history_xyz=history_xyz,
            ego_history_rot=history_rot,
            route_text=route_text,
        )

    return make


_TORCH_THREADS_AT_IMPORT: list[int] = []  # torch's thread count as its import set it


class _TorchImportWatch(importlib.abc.MetaPathFinder):
    """Reads torch's thread count right after torch is imported, for a test file that imports it
    itself. Not by importing torch here: that takes seconds, and the ROS-only files never need it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once, and the lookup below must find the real torch
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _TORCH_THREADS_AT_IMPORT.append(module.get_num_threads())

        spec.loader.exec_module = exec_module  # type: ignore[method-assign] - this spec's own loader
        return spec


if "torch" not in sys.modules:
    sys.meta_path.insert(0, _TorchImportWatch())


@pytest.fixture(scope="module", autouse=True)
def torch_threads_restored() -> Iterator[None]:
    """Every test file leaves torch's thread count as it found it. A file that sets it (to match a
    child process's float sums) and forgets changes the sums of the worker's later files: one left
    at 1 moved server-vs-pipeline plans 2.8e-4 m apart."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if before is None and _TORCH_THREADS_AT_IMPORT:  # the file imported torch: as the import set it
        before = _TORCH_THREADS_AT_IMPORT[0]
    if torch is not None and before is not None and torch.get_num_threads() != before:
        set_torch_threads(before)


def pytest_configure(config: pytest.Config) -> None:
    """Tests send SIGINT to the processes they start and expect Python's KeyboardInterrupt there.
    A suite started in the background by a shell without job control (`bash scripts/test.sh &`)
    inherits SIGINT ignored, every child would too, and Python installs no handler for an
    ignored SIGINT: restore the default here (each xdist worker runs this too)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Files that take minutes, longest first. The suite runs on two pytest-xdist workers, a file per
# worker at a time (`--dist loadfile`, so a module's server or engine is built once) in this order
# (`--no-loadscope-reorder`); starting the long files first keeps one worker from finishing alone
# with the soak still ahead of it.
LONG_FILES_FIRST = (
    "test_node_soak.py", "test_tensor_parallel.py", "test_serve_frames.py", "test_vllm_backend.py", "test_serve_vllm.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order otherwise kept


SHM = Path("/dev/shm")
_SHM_AT_START = "alpamayo_ros_shm_at_start"


def _fastdds_files() -> set[str]:
    return {p.name for p in SHM.glob("*fastdds_*")} if SHM.is_dir() else set()


def pytest_sessionstart(session: pytest.Session) -> None:
    setattr(session.config, _SHM_AT_START, _fastdds_files())


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Where the run's shared memory stands, for reading a failed run: Fast DDS keeps its transport
    there, and a segment left by a killed process can hinder a later participant."""
    if hasattr(config, "workerinput") or not SHM.is_dir():
        return
    before, after = getattr(config, _SHM_AT_START, set()), _fastdds_files()
    usage = shutil.disk_usage(SHM)
    left = sorted(after - before)
    terminalreporter.write_line(
        f"/dev/shm: {usage.free / 2**20:.0f} of {usage.total / 2**20:.0f} MiB free; Fast DDS files: {len(before)} "
        f"at the start, {len(after)} now, left by this run: {', '.join(left[:12]) or 'none'}"
        + (f" and {len(left) - 12} more" if len(left) > 12 else "")
    )
