"""Where alpamayo-serve's overhead over in-process planning goes, without a model: a fast probe.

The cost a client pays over Pipeline.plan is all in the frames' path (keys, shared memory or
resizing, msgpack, HTTP, parsing, the frame store, the server's resize, the plan's preprocess);
the model's own work is the same either way. So this probe runs the real server (create_app and
uvicorn, in a child process, as alpamayo-serve does) and the real RemotePlanner over loopback,
with real full-HD W16 windows streamed as bench_pipeline makes them, but the server's pipeline is
FramesOnly: a real FrameCache whose plan() is Pipeline.plan's preprocess stage and nothing else.
The in-process figure is the same FramesOnly.plan called directly (what in-process planning pays
for its frames). Per client mode (shm, delta resized, full window) it prints p50 ms of every
stage and the overhead (remote wall - in-process wall); with --baseline-src, the same probe runs
against that source tree as well (e.g. `git archive <commit>` unpacked) and both columns print side
by side (with --repeats, alternating, so load that drifts hits both). It only calls APIs that
old trees have too.

    python bench/serve_stages.py --runs 30 --json bench/results/cpu-serve-stages.json
    python bench/serve_stages.py --device cuda --runs 30     # the GPU host, no checkpoint needed
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import WORKLOADS, synthetic_inputs  # noqa: E402

#: Stages a remote plan's timings carry (the newer ones are 0 where a tree does not time them).
STAGES = ("remote.resize", "remote.shm_write", "remote.encode", "serve.parse", "serve.parse_wait", "serve.shm_read",
          "serve.queue", "serve.resize", "preprocess")
#: The stages that do not overlap: their sum plus the HTTP exchange is the client's wall time.
DISJOINT = ("remote.resize", "remote.shm_write", "remote.encode", "serve.parse", "serve.queue", "serve.resize",
            "preprocess")
MODES = {"shm": {"frame_transport": "shm"}, "delta": {"frame_transport": "resized"}, "full": {"delta": False}}


class FramesOnly:
    """The server's pipeline minus the model: its FrameCache, and a plan() that is Pipeline.plan's
    preprocess stage (frame keys, then the cache: resize what is new) returning an empty Plan."""

    def __init__(self, device: str) -> None:
        import torch

        from alpamayo_ros.core.frame_cache import FrameCache
        from alpamayo_ros.core.preprocess import VisionGeometry

        compute = torch.device(device)
        geometry = VisionGeometry()  # Alpamayo 1.5's: full-HD frames resize to 320x576
        # the vLLM backend's layout: resized on the compute device, kept in host memory
        self.frames = FrameCache(geometry, compute_device=compute, store_device=torch.device("cpu"), capacity=32)
        self.config = SimpleNamespace(vision=geometry)
        self.backbone = SimpleNamespace(name="frames-only")
        self.device = compute

    def plan(self, inputs, settings=None):
        import torch

        from alpamayo_ros.core.frame_cache import frame_keys
        from alpamayo_ros.core.types import Plan

        started = time.perf_counter()
        flat = inputs.images.reshape(-1, *inputs.images.shape[2:])
        self.frames.preprocess(flat, frame_keys(inputs))
        if self.device.type == "cuda":  # the stage ends when the GPU's share of it has
            torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - started) * 1e3
        return Plan(xyz=np.zeros((1, 64, 3), np.float32), rot=np.zeros((1, 64, 3, 3), np.float32), coc=[""],
                    generated_ids=[[]], t0_ns=inputs.t0_ns, backend="frames-only",
                    timings_ms={"preprocess": elapsed_ms, "total": elapsed_ms}, reasoning_closed=[True])


def serve(port: int, device: str, torch_threads: int | None) -> None:
    """The child process: alpamayo-serve's app over FramesOnly on 127.0.0.1:port."""
    import torch
    import uvicorn

    if torch_threads:
        torch.set_num_threads(torch_threads)

    from alpamayo_ros.serve.app import ServerOptions, create_app
    from alpamayo_ros.serve.worker import PipelineWorker

    worker = PipelineWorker(lambda: FramesOnly(device), queue_size=4)
    app = create_app(worker, ServerOptions(allow_shm=True))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server at {url} not ready within {timeout_s} s")


def measure(args: argparse.Namespace) -> dict:
    """p50 ms of every stage per client mode, and of the in-process FramesOnly.plan."""
    from alpamayo_ros.serve.client import RemotePlanner
    from alpamayo_ros.serve.process import free_port

    workload = WORKLOADS[args.workload]
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port, args.device, args.torch_threads),
                                                          daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    results: dict = {"workload": args.workload, "device": args.device, "runs": args.runs, "cpus": os.cpu_count(),
                     "torch_threads": args.torch_threads, "load_average": os.getloadavg()[0], "modes": {}}
    try:
        wait_ready(url)
        for mode, options in MODES.items():
            planner = RemotePlanner(url, timeout_s=120.0, **options)
            stream = synthetic_inputs(workload, seed=0)
            rows: dict[str, list[float]] = {}
            for index in range(args.warmup + args.runs):
                inputs = next(stream)
                started = time.perf_counter()
                plan = planner.plan(inputs)
                wall_ms = (time.perf_counter() - started) * 1e3
                if index < args.warmup:
                    continue
                stages = {stage: float(plan.timings_ms.get(stage, 0.0)) for stage in STAGES}
                stages["http"] = wall_ms - sum(stages[stage] for stage in DISJOINT)
                stages["wall"] = wall_ms
                for stage, value in stages.items():
                    rows.setdefault(stage, []).append(value)
            planner.close()
            results["modes"][mode] = {stage: float(np.percentile(values, 50)) for stage, values in rows.items()}
    finally:
        server.terminate()
        server.join(10)
    local = FramesOnly(args.device)
    stream = synthetic_inputs(workload, seed=0)
    walls = []
    for index in range(args.warmup + args.runs):
        inputs = next(stream)
        started = time.perf_counter()
        local.plan(inputs)
        if index >= args.warmup:
            walls.append((time.perf_counter() - started) * 1e3)
    results["in_process_ms"] = float(np.percentile(walls, 50))
    for mode in results["modes"].values():
        mode["overhead"] = mode["wall"] - results["in_process_ms"]
    return results


def print_table(columns: dict[str, dict]) -> None:
    """One row per stage, one column per (tree, mode)."""
    heads = [(tree, mode) for tree, result in columns.items() for mode in result["modes"]]
    lines = ["| p50 ms | " + " | ".join(f"{tree} {mode}" for tree, mode in heads) + " |",
             "| --- |" + " ---: |" * len(heads)]
    for stage in (*STAGES, "http", "wall", "overhead"):
        cells = [f"{columns[tree]['modes'][mode].get(stage, 0.0):.1f}" for tree, mode in heads]
        name = f"**{stage}** (remote wall - in-process wall)" if stage == "overhead" else stage
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    local = [f"{columns[tree]['in_process_ms']:.1f}" for tree, _ in heads]
    lines.append("| in-process (frames only) | " + " | ".join(local) + " |")
    print("\n".join(lines))
    sys.stdout.flush()


def child_run(args: argparse.Namespace, source: Path) -> dict:
    """measure() of the tree at source, in a process of its own (its alpamayo_ros first on the path)."""
    env = {**os.environ, "PYTHONPATH": f"{source.resolve()}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, __file__, "--emit-json", "--workload", args.workload, "--device", args.device,
               "--runs", str(args.runs), "--warmup", str(args.warmup)]
    if args.torch_threads:
        command += ["--torch-threads", str(args.torch_threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"probe of {source} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict]) -> dict:
    """Per mode and stage, the median over repeated measure() results (each already a p50)."""
    merged = {key: value for key, value in runs[0].items() if key not in ("modes", "in_process_ms", "load_average")}
    merged["repeats"] = len(runs)
    merged["load_average"] = [run["load_average"] for run in runs]
    merged["in_process_ms"] = float(np.median([run["in_process_ms"] for run in runs]))
    merged["modes"] = {mode: {stage: float(np.median([run["modes"][mode][stage] for run in runs]))
                              for stage in runs[0]["modes"][mode]} for mode in runs[0]["modes"]}
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W16", help=f"one of {sorted(WORKLOADS)}")
    parser.add_argument("--device", default="cpu", help="where the server resizes (cpu, cuda)")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, help="torch threads of client and server (default: torch's); "
                        "1 keeps figures stable on a small machine that other jobs load")
    parser.add_argument("--baseline-src", type=Path, help="a source tree to measure too, with this probe, "
                        "alternating with this tree")
    parser.add_argument("--repeats", type=int, default=1, help="measure each tree this many times, alternating; "
                        "figures are the median of the repeats' p50s (drifting load cancels)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--emit-json", action="store_true", help=argparse.SUPPRESS)  # a child run
    args = parser.parse_args(argv)
    if args.workload not in WORKLOADS:
        parser.error(f"--workload: unknown {args.workload!r}; known: {sorted(WORKLOADS)}")
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    if args.emit_json:
        print(json.dumps(measure(args)))
        return 0
    trees = {"this tree": Path(__file__).resolve().parent.parent}
    if args.baseline_src is not None:
        trees = {"before": args.baseline_src, "after": trees["this tree"]}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, source in trees.items():
            runs[name].append(child_run(args, source))
    columns = {name: median_of(results) for name, results in runs.items()}
    print_table(columns)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"medians": columns, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
