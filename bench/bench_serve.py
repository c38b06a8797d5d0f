"""Remote planning overhead: bench_pipeline's workloads through alpamayo-serve's binary endpoint
(RemotePlanner, loopback) against the same Pipeline.plan in-process, in one run.

The server runs as a child process (as in deployment) with the same checkpoint, backend, device
and settings; it plans first, then is stopped, then this process loads the pipeline and plans the
same input stream (one model on the device at a time). Reported per plan: wall time both ways,
the remote overhead (remote wall - in-process wall, p50) and its direct form (client wall - the
server's own `total`: resizing, msgpack, HTTP, queueing), and the remote/in-process ratio, for
three client modes against one server: shm (frame delta, new frames at capture size through
shared memory, resized on the server's device), delta (frame delta, new frames resized on the
client and sent in the body) and full (every frame every plan, resized on the client); plus bytes
and frames sent per plan and where the direct overhead goes (client resize, shm write and encode,
server parse, queue and resize, the rest: HTTP both ways), and every stage of the server's
pipeline beside the in-process one's (preprocess, prompt, backbone.*, expert, action).

    python bench/bench_serve.py --smoke
    python bench/bench_serve.py --workload W16 --backend vllm --runs 50 --full-size-dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_pipeline import WORKLOADS, Workload, percentiles, synthetic_inputs

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.tiny_checkpoint import write_checkpoint
from alpamayo_ros.core.types import SamplingSettings
from alpamayo_ros.serve.client import RemotePlanner
from alpamayo_ros.serve.process import ServerProcess

logger = logging.getLogger("bench_serve")


def workload_settings(workload: Workload) -> SamplingSettings:
    """bench_pipeline's per-plan settings: greedy, exactly the workload's reasoning length."""
    return SamplingSettings(num_samples=1, temperature=0.0, max_reasoning_tokens=workload.reasoning_tokens,
                            min_reasoning_tokens=workload.reasoning_tokens, flow_steps=10)


#: Stages of a remote plan's overhead, as RemotePlanner and the server time them (disjoint; the
#: server's serve.parse_wait and serve.shm_read are parts of serve.parse, reported beside them).
REMOTE_STAGES = ("remote.resize", "remote.shm_write", "remote.encode", "serve.parse", "serve.queue", "serve.resize")
#: Client modes, each a RemotePlanner configuration: how a plan's frames travel.
REMOTE_MODES = {"shm": {"frame_transport": "shm"}, "delta": {"frame_transport": "resized"}, "full": {"delta": False}}


def timed_plans(plan, workload: Workload, runs: int, warmup: int, sent=None) -> dict[str, list[float]]:
    """Wall ms per plan and every stage the plan's timings carry (the pipeline's own, `total`
    among them, so the server's pipeline can be compared stage by stage with in-process) over the
    streamed synthetic inputs; for a remote plan also its overhead, the rest of it (HTTP) and what
    sent() counts per plan."""
    settings = workload_settings(workload)
    stream = synthetic_inputs(workload, seed=0)
    times: dict[str, list[float]] = {"wall": [], "total": []}
    for index in range(warmup + runs):
        inputs = next(stream)
        start = time.perf_counter()
        result = plan(inputs, settings)
        wall_ms = (time.perf_counter() - start) * 1e3
        if index < warmup:
            continue
        measured = {"wall": wall_ms, **{stage: float(value) for stage, value in result.timings_ms.items()
                                         if isinstance(value, (int, float))}}
        if sent is not None:
            measured.update(overhead=wall_ms - result.timings_ms["total"], **sent())
            measured["http"] = measured["overhead"] - sum(result.timings_ms.get(stage, 0.0) for stage in REMOTE_STAGES)
        for key, value in measured.items():
            times.setdefault(key, []).append(value)
    return times


def remote_plans(url: str, workload: Workload, args: argparse.Namespace, mode: str) -> dict[str, list[float]]:
    planner = RemotePlanner(url, timeout_s=600, **REMOTE_MODES[mode])
    try:
        return timed_plans(planner.plan, workload, args.runs, args.warmup,
                           lambda: {"bytes_sent": planner.last_request_bytes, "frames_sent": planner.last_sent_frames})
    finally:
        planner.close()


def engine_options(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """vLLM options for the in-process pipeline and the same as alpamayo-serve arguments."""
    if args.backend != "vllm":
        return {}, []
    on_gpu = args.device.startswith("cuda")
    options = {"kv_cache_gib": args.kv_cache_gib if on_gpu else 1.0, "max_model_len": args.max_model_len}
    flags = ["--kv-cache-gib", str(options["kv_cache_gib"]), "--max-model-len", str(args.max_model_len)]
    if on_gpu:
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
        flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    else:
        options["enforce_eager"] = True
        flags.append("--enforce-eager")
    return options, flags


def bench_workload(name: str, args: argparse.Namespace, checkpoint: Path, dtype: str) -> dict:
    workload = WORKLOADS[name]
    options, flags = engine_options(args)
    server = ServerProcess(["--checkpoint", str(checkpoint), "--backend", args.backend, "--device", args.device,
                            "--dtype", dtype, "--log-level", "warning", *flags], args.log_dir / f"server-{name}.log")
    started = time.perf_counter()
    server.start(ready_timeout_s=1800)
    logger.info("server ready in %.1f s", time.perf_counter() - started)
    try:
        remote = {mode: remote_plans(server.url, workload, args, mode) for mode in REMOTE_MODES}
    finally:
        server.stop()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    pipeline = Pipeline.from_checkpoint(checkpoint, backend=args.backend, device=args.device, dtype=dtype,
                                        backend_options=options)
    local = timed_plans(pipeline.plan, workload, args.runs, args.warmup)
    pipeline.close()
    local_p50 = np.percentile(local["wall"], 50)
    result = {
        "workload": name, "backend": args.backend, "device": args.device, "dtype": dtype, "runs": args.runs,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "in_process_ms": {key: percentiles(values) for key, values in local.items()},
    }
    for mode, times in remote.items():
        remote_p50 = np.percentile(times["wall"], 50)
        result[f"remote_{mode}_ms"] = {key: percentiles(values) for key, values in times.items()
                                       if key not in ("bytes_sent", "frames_sent")}
        result[f"remote_{mode}_bytes_sent_p50"] = float(np.percentile(times["bytes_sent"], 50))
        result[f"remote_{mode}_frames_sent_p50"] = float(np.percentile(times["frames_sent"], 50))
        result[f"remote_{mode}_overhead_p50_ms"] = float(remote_p50 - local_p50)
        result[f"remote_{mode}_ratio_p50"] = float(remote_p50 / local_p50)
    return result


def print_report(result: dict) -> None:
    """One row per measure (p50 ms; p90 for wall and total), one column per path."""
    paths = ("in_process_ms", *(f"remote_{mode}_ms" for mode in REMOTE_MODES))
    measures = list(dict.fromkeys(measure for path in paths for measure in result[path]))
    machine = result.get("gpu") or result["device"]
    lines = [f"## {result['workload']} remote vs in-process ({result['backend']}, {machine}), p50 ms", "", "| measure | " + " | ".join(path.removesuffix("_ms") for path in paths) + " |",
             "| --- |" + " ---: |" * len(paths)]
    for measure in measures:
        cells = []
        for path in paths:
            p = result[path].get(measure)
            tail = f" (p90 {p['p90']:.1f})" if p is not None and measure in ("wall", "total") else ""
            cells.append("" if p is None else f"{p['p50']:.1f}{tail}")
        lines.append(f"| {measure} | " + " | ".join(cells) + " |")
    lines.append("")
    for mode in REMOTE_MODES:
        lines.append(f"{mode}: {result[f'remote_{mode}_frames_sent_p50']:.0f} frames, "
                     f"{result[f'remote_{mode}_bytes_sent_p50'] / 1e6:.2f} MB in the body per plan (p50); remote wall p50 - "
                     f"in-process wall p50 = **{result[f'remote_{mode}_overhead_p50_ms']:.1f} ms**; remote / in-process = "
                     f"**{result[f'remote_{mode}_ratio_p50']:.3f}x** (runs={result['runs']})")
    print("\n".join(lines))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny random checkpoint, HF backend on the CPU")
    parser.add_argument("--workload", default="W16", help=f"comma list of {sorted(WORKLOADS)}")
    parser.add_argument("--backend", default="vllm", choices=("vllm", "hf"))
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, help="existing checkpoint directory")
    parser.add_argument("--full-size-dir", type=Path, help="write a full-size random checkpoint here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--json-dir", type=Path, help="write serve-<workload>.json here")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a temporary folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.smoke:
        args.workload, args.backend, args.device = "smoke", "hf", "cpu"
    names = args.workload.split(",")
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        parser.error(f"--workload: unknown {unknown}; known: {sorted(WORKLOADS)}")
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.checkpoint:
        checkpoint = args.checkpoint
    elif args.full_size_dir:
        checkpoint = args.full_size_dir
        if not (checkpoint / "config.json").exists():  # gpu_run.sh may have written it already
            checkpoint = write_checkpoint(args.full_size_dir, full_size=True, weights=True,
                                          dtype=getattr(torch, dtype), device=args.device)
    else:
        checkpoint = write_checkpoint(Path(tempfile.mkdtemp(prefix="bench-ckpt-")), dtype=getattr(torch, dtype))
    for name in names:
        result = bench_workload(name, args, checkpoint, dtype)
        print_report(result)
        if args.json_dir:
            args.json_dir.mkdir(parents=True, exist_ok=True)
            (args.json_dir / f"serve-{name}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
