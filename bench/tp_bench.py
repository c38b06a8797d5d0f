"""Tensor parallel against one GPU: parity and speed of `Pipeline.plan` at one TP size per run.

bench/tp_run.sh runs this once per size (TP=1 first) in one device call; each run writes
tp<N>.json, and the run given --reference (the TP=1 file) adds the comparison:

* parity: one W16 plan, greedy with exactly 40 reasoning tokens and the same injected flow
  noise, then the same plan with those 40 ids teacher-forced (so the expert sees the same
  reasoning even if a bf16 near-tie flips a greedy token): ids equal? largest waypoint gap?
* speed: the workloads of bench_pipeline.py (default W16, W16-s16), per-stage p50/p90/p99,
  with every GPU's memory in use (nvidia-smi) while the engine is up.

    python -m bench.tp_bench --tp 1 --checkpoint /tmp/ckpt --out /tmp/tp1.json
    python -m bench.tp_bench --tp 2 --checkpoint /tmp/ckpt --out /tmp/tp2.json --reference /tmp/tp1.json
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.tiny_checkpoint import write_checkpoint
from alpamayo_ros.core.types import SamplingSettings
from bench.bench_pipeline import WORKLOADS, print_report, run_backend, synthetic_inputs

logger = logging.getLogger("tp_bench")

PARITY_TOKENS = 40
NOISE_SEED = 1234


def gpu_memory_mib() -> list[int]:
    """Memory in use on every visible GPU (all processes: vLLM's workers hold most of it)."""
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    return [int(line) for line in subprocess.run(query, capture_output=True, text=True, check=True).stdout.split()]


def parity_plans(pipeline: Pipeline) -> dict:
    """The greedy and the teacher-forced plan of one W16 input, same flow noise."""
    inputs = next(synthetic_inputs(WORKLOADS["W16"], seed=7))
    noise = torch.randn((1, 64, 2), generator=torch.Generator().manual_seed(NOISE_SEED))
    settings = SamplingSettings(
        num_samples=1, temperature=0.0, max_reasoning_tokens=PARITY_TOKENS, min_reasoning_tokens=PARITY_TOKENS
    )
    greedy = pipeline.plan(inputs, settings, init_noise=noise)
    forced = pipeline.plan(inputs, settings, init_noise=noise, forced_coc_ids=greedy.generated_ids[0])
    return {
        "greedy_ids": greedy.generated_ids[0],
        "greedy_xyz": greedy.xyz.tolist(),
        "forced_xyz": forced.xyz.tolist(),
    }


def compare(ours: dict, reference: dict) -> dict:
    """TP=N against TP=1: ids equal (else where they part), waypoint gaps in metres."""
    mine, theirs = ours["parity"]["greedy_ids"], reference["parity"]["greedy_ids"]
    parted = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    result = {"greedy_ids_equal": mine == theirs, "first_different_id": parted}
    for key in ("greedy_xyz", "forced_xyz"):
        a, b = np.array(ours["parity"][key]), np.array(reference["parity"][key])
        result[f"{key}_max_gap_m"] = float(np.abs(a - b).max())
        result[f"{key}_path_m"] = float(np.linalg.norm(b[:, -1, :2], axis=-1).max())
    speed = {}
    for name, measured in ours["workloads"].items():
        base = reference["workloads"].get(name)
        if base is not None:
            speed[name] = {
                stage: p["p50"] / base["stages_ms"][stage]["p50"]
                for stage, p in measured["stages_ms"].items()
                if stage in base["stages_ms"] and base["stages_ms"][stage]["p50"] > 0
            }
    result["p50_ratio_vs_reference"] = speed
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, required=True, help="vllm tensor_parallel_size of this run")
    parser.add_argument("--checkpoint", type=Path, required=True, help="written (full size, random) if missing")
    parser.add_argument("--out", type=Path, required=True, help="JSON written here")
    parser.add_argument("--reference", type=Path, help="the TP=1 run's JSON, to compare against")
    parser.add_argument("--workload", default="W16,W16-s16", help=f"comma list of {sorted(WORKLOADS)}")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    names = args.workload.split(",")
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        parser.error(f"--workload: unknown {unknown}; known: {sorted(WORKLOADS)}")

    if not (args.checkpoint / "config.json").is_file():
        start = time.perf_counter()
        write_checkpoint(args.checkpoint, full_size=True, weights=True, dtype=torch.bfloat16, device="cuda")
        logger.info("full-size random checkpoint written in %.1f s", time.perf_counter() - start)
    options = {
        "tensor_parallel_size": args.tp,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_gib": args.kv_cache_gib,
    }
    start = time.perf_counter()
    pipeline = Pipeline.from_checkpoint(
        args.checkpoint, backend="vllm", device="cuda", dtype="bfloat16", backend_options=options
    )
    results: dict = {"tp": args.tp, "load_s": time.perf_counter() - start, "gpu": torch.cuda.get_device_name()}
    try:
        results["parity"] = parity_plans(pipeline)
        results["workloads"] = {}
        for name in names:
            measured = run_backend(pipeline, WORKLOADS[name], args.runs, args.warmup)
            measured["gpu_memory_used_mib"] = gpu_memory_mib()
            results["workloads"][name] = measured
            print_report(
                {"workload": f"{name} TP={args.tp}", "device": "cuda", "dtype": "bfloat16",
                 "backends": {"vllm": measured}, "roofline_floor_ms": {}}
            )
    finally:
        pipeline.close()
    if args.reference:
        results["vs_reference"] = compare(results, json.loads(args.reference.read_text()))
        print(json.dumps(results["vs_reference"], indent=1))
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
