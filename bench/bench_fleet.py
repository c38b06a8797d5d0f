"""Ray fleet throughput: `alpamayo-eval --ray` on synthetic bags, run as a user runs it, one run.

Writes N synthetic bags (the evaluator tests' circle drive) and runs the evaluator CLI once per
worker count, printing each run's wall time, plans and per-worker plans/s from its report (plans
over the worker's time in jobs, model load excluded). Wall time includes starting the local Ray
instance and loading one model per worker (in parallel), as a user pays them.

CPU (default): two 48x32 cameras, the tiny random checkpoint at 24x16 pixels, 1 then 2 workers.
GPU (issue 15, on the H200): one worker holding one GPU, the full-size random checkpoint on vLLM,
W16's four cameras as 1080x1920 JPEG at 10 Hz, planned at 10 Hz; --single runs the single-process
evaluator on the same bags for comparison.

    python -m bench.bench_fleet [--bags 6] [--ticks 8] [--workers 1 2]
    python -m bench.bench_fleet --full-size-dir /tmp/ckpt --backend vllm --device cuda --gpus-per-worker 1 \
        --workers 1 --cameras 0 1 2 6 --image-size 1920x1080 --duration-s 16 --ticks 0 --rate-hz 10 \
        --max-reasoning-tokens 40 --bags 2 --single --json-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import cv2
import numpy as np

from alpamayo_ros.core.tiny_checkpoint import SHARD_INDEX_FILE, write_checkpoint
from alpamayo_ros.testing.circle_drive import CAM_INDICES, CAM_TOPICS, write_circle_bag  # the evaluator tests' drive

FRAME_POOL = 6  # distinct images per camera, cycled: more than a plan's 4-frame window
NOISE_STD = 4.0  # sensor-like noise: a full-HD frame becomes a ~400 KB JPEG, as a camera's (flat: ~60 KB)


def camera_frames(width: int, height: int, cameras: int, seed: int) -> list[list[np.ndarray]]:
    """FRAME_POOL smooth random images with noise per camera: JPEG size and decode cost of a camera."""
    rng = np.random.default_rng(seed)
    pools = []
    for _ in range(cameras):
        pool = []
        for _ in range(FRAME_POOL):
            coarse = rng.integers(0, 256, (max(1, height // 60), max(1, width // 60), 3), dtype=np.uint8)
            smooth = cv2.resize(coarse, (width, height), interpolation=cv2.INTER_CUBIC).astype(np.float32)
            noisy = smooth + NOISE_STD * rng.standard_normal(smooth.shape, dtype=np.float32)
            pool.append(np.clip(noisy, 0, 255).astype(np.uint8))
        pools.append(pool)
    return pools


def write_bag(path: Path, seed: int, topics: list[str], size: tuple[int, int] | None, duration_s: float) -> Path:
    """One circle drive; size (width, height) None keeps the tests' random 48x32 pixels."""
    frames = camera_frames(*size, len(topics), seed) if size else None
    return write_circle_bag(path, seed=seed, topics=topics, duration_s=duration_s, frames=frames)


def checkpoint_dir(args: argparse.Namespace, root: Path) -> Path:
    """--full-size-dir as bench/gpu_run.sh left it, else written there now; otherwise a tiny one."""
    if args.full_size_dir is None:
        return write_checkpoint(root / "ckpt", seed=0)
    if (args.full_size_dir / SHARD_INDEX_FILE).is_file():
        print(f"full-size checkpoint: {args.full_size_dir} (already written)", flush=True)
        return args.full_size_dir
    import torch

    print(f"full-size checkpoint: none complete in {args.full_size_dir} (no {SHARD_INDEX_FILE}); writing it "
          f"on {args.device}", flush=True)
    started = time.monotonic()
    write_checkpoint(args.full_size_dir, full_size=True, weights=True, dtype=torch.bfloat16, device=args.device)
    print(f"full-size checkpoint written in {time.monotonic() - started:.0f} s", flush=True)
    return args.full_size_dir


def evaluate(bags: list[Path], params: Path, out: Path, args: argparse.Namespace, workers: int | None) -> dict:
    """One evaluator run (workers None: the single process); its wall time and throughput.

    With --json-dir, its log and report.json are copied there (the report's plots stay behind:
    the device tool brings back 8 files at most)."""
    command = [sys.executable, "-m", "alpamayo_ros.eval.cli", *map(str, bags), "--params-file", str(params),
               "--out", str(out), "--no-progress"]
    if args.ticks:
        command += ["--max-ticks", str(args.ticks)]
    if workers is not None:
        command += ["--ray", "--workers", str(workers), "--gpus-per-worker", str(args.gpus_per_worker)]
    started = time.monotonic()
    # a session of its own: a run past --timeout-s (a GPU worker Ray cannot place waits forever) is
    # killed with its Ray processes, and its log still tells why
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = run.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        log, _ = run.communicate()
    wall = time.monotonic() - started
    if args.json_dir:
        (args.json_dir / f"{out.name}.log").write_text(log)
    if args.device.startswith("cuda"):
        wait_gpu_released()
    if run.returncode != 0:  # reported, and the next run still goes: one device call, as many figures as it can give
        print(f"{out.name}: exit {run.returncode} after {wall:.0f} s\n{log[-3000:]}", flush=True)
        return {"run": out.name, "workers": workers, "wall_s": round(wall, 1), "error": f"exit {run.returncode}"}
    if args.json_dir:
        shutil.copy(out / "report.json", args.json_dir / f"{out.name}.report.json")
    doc = json.loads((out / "report.json").read_text())
    plans = doc["summary"]["count"]
    row = {"run": out.name, "workers": workers, "wall_s": round(wall, 1), "plans": plans,
           "ticks": doc["ticks_total"], "plans_per_s": round(plans / doc["busy_s"], 2),
           "pipeline_total_ms": doc["latency_ms"]}
    if workers is not None:
        row["per_worker_plans_per_s"] = [round(w["plans_per_s"], 2) for w in doc["workers"]]
        row["worker_ready"] = [line for line in log.splitlines() if "ready: pid" in line]
    return row


def wait_gpu_released(timeout_s: float = 60.0) -> None:
    """Until the run's GPU memory is back: Ray returns before its workers have exited, and the next
    run's vLLM refuses to start on a GPU with less free memory than it may reserve."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.split()
        if all(int(mib) < 2048 for mib in used):
            return
        time.sleep(1.0)
    print(f"GPU memory still in use after {timeout_s:.0f} s: {used} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bags", type=int, default=6)
    parser.add_argument("--ticks", type=int, default=8, help="ticks per bag (the first ones have no history); 0 = all")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--single", action="store_true", help="also run the single-process evaluator")
    parser.add_argument("--full-size-dir", type=Path,
                        help="the full-size random checkpoint (bench/gpu_run.sh leaves it in /tmp/ckpt); written "
                             "there when absent. Default: a tiny random one, frames resized to 24x16")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpus-per-worker", type=float, default=0.0)
    parser.add_argument("--cameras", type=int, nargs="+", help="camera indices (default: the tests' two cameras)")
    parser.add_argument("--image-size", help="WxH camera frames (default: the tests' random 48x32 pixels)")
    parser.add_argument("--duration-s", type=float, default=12.0, help="bag length; the last 6.4 s have no future")
    parser.add_argument("--rate-hz", type=float, default=2.0, help="planning rate (the node's default is 10)")
    parser.add_argument("--max-reasoning-tokens", type=int, default=4)
    parser.add_argument("--json-dir", type=Path, help="write fleet.json and the runs' logs here")
    parser.add_argument("--timeout-s", type=float, help="kill a run (and its Ray instance) after this long")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.image_size.lower().split("x")) if args.image_size else None
    indices = args.cameras or CAM_INDICES
    topics = [f"/bench/cam{i}/compressed" for i in args.cameras] if args.cameras else CAM_TOPICS
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        root = Path(tmp)
        started = time.monotonic()
        with ProcessPoolExecutor(max_workers=min(args.bags, os.cpu_count() or 1)) as pool:
            bags = list(pool.map(write_bag, [root / f"bag_{k}" for k in range(args.bags)], range(args.bags),
                                 [topics] * args.bags, [size] * args.bags, [args.duration_s] * args.bags))
        bag_mb = sum(f.stat().st_size for bag in bags for f in bag.iterdir()) / 1e6
        print(f"{args.bags} bag(s) of {args.duration_s:.0f} s, {len(topics)} camera(s) {args.image_size or '48x32'}: "
              f"{bag_mb:.0f} MB, written in {time.monotonic() - started:.0f} s", flush=True)
        checkpoint = checkpoint_dir(args, root)
        resize = "" if args.full_size_dir else "    images:\n      width: 24\n      height: 16\n"
        params = root / "eval.yaml"
        params.write_text(
            "/**:\n  ros__parameters:\n"
            f"    model.checkpoint_path: {checkpoint}\n    model.backend: {args.backend}\n"
            f"    model.device: {args.device}\n"
            f"    cameras:\n      topics: {json.dumps(topics)}\n      indices: {list(indices)}\n"
            f"      transports: {json.dumps(['compressed'] * len(topics))}\n"
            f"    planning.rate_hz: {args.rate_hz}\n    sampling.max_reasoning_tokens: {args.max_reasoning_tokens}\n"
            + resize)
        if args.json_dir:
            args.json_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        for workers in args.workers:
            rows.append(evaluate(bags, params, root / f"ray_{workers}", args, workers))
            print(json.dumps(rows[-1]), flush=True)
        if args.single:
            rows.append(evaluate(bags, params, root / "single", args, None))
            print(json.dumps(rows[-1]), flush=True)
    load = os.getloadavg()
    print(f"bags={args.bags} ticks/bag={args.ticks or 'all'} at {args.rate_hz:g} Hz, cpus={os.cpu_count()}, "
          f"load avg (1/5/15 min)={load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")
    done = [r for r in rows if "error" not in r]
    ray_rows = [r for r in done if r["workers"] is not None]
    for row in ray_rows[1:]:
        print(f"wall time ratio {ray_rows[0]['workers']} / {row['workers']} workers: "
              f"{ray_rows[0]['wall_s'] / row['wall_s']:.2f}x")
    for row in done:
        who = f"{row['workers']} Ray worker(s)" if row["workers"] is not None else "single process"
        print(f"{who}: {row['plans_per_s']} plans/s ({row['plans']} plans, {row['plans_per_s'] / args.rate_hz:.2f}x "
              f"the {args.rate_hz:g} Hz planning rate), wall {row['wall_s']} s")
    if args.json_dir:
        doc = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "bag_mb": round(bag_mb, 1), "runs": rows}
        (args.json_dir / "fleet.json").write_text(json.dumps(doc, indent=1))
    if len(done) < len(rows):
        raise SystemExit(f"failed: {', '.join(r['run'] for r in rows if 'error' in r)}")


if __name__ == "__main__":
    main()
