"""Ray fleet scaling: wall time of `alpamayo-eval --ray` on N bags with 1 and with 2 workers, one run.

Writes N synthetic bags (the evaluator tests' circle drive, two small cameras) and a tiny random
checkpoint, then runs the evaluator CLI as a user would, once per worker count, and prints the
wall times, their ratio and each run's per-worker plans/s from its report. Wall time includes
starting the local Ray instance and loading one model per worker (both in parallel), as a user
pays them.

    python bench/bench_fleet.py [--bags 6] [--ticks 8] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test"))  # the bag writer of the evaluator tests: one synthetic drive, not two

from test_evaluate import CAM_INDICES, CAM_TOPICS, write_circle_bag  # noqa: E402

from alpamayo_ros.core.tiny_checkpoint import write_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bags", type=int, default=6)
    parser.add_argument("--ticks", type=int, default=8, help="ticks per bag at 2 Hz (the first 3 have no history)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        root = Path(tmp)
        checkpoint = write_checkpoint(root / "ckpt", seed=0)
        params = root / "eval.yaml"
        params.write_text(
            "/**:\n  ros__parameters:\n"
            f"    model.checkpoint_path: {checkpoint}\n"
            f"    cameras:\n      topics: {json.dumps(CAM_TOPICS)}\n      indices: {CAM_INDICES}\n"
            "      transports: [compressed, compressed]\n"
            "    planning.rate_hz: 2.0\n    sampling.max_reasoning_tokens: 4\n"
            "    images:\n      width: 24\n      height: 16\n")
        bags = [write_circle_bag(root / f"bag_{k}", seed=k) for k in range(args.bags)]
        rows = []
        for workers in args.workers:
            out = root / f"out_{workers}"
            command = [sys.executable, "-m", "alpamayo_ros.eval.evaluate", *map(str, bags), "--params-file", str(params),
                       "--out", str(out), "--max-ticks", str(args.ticks), "--no-progress", "--ray", "--workers", str(workers)]
            started = time.monotonic()
            run = subprocess.run(command, capture_output=True, text=True)
            wall = time.monotonic() - started
            if run.returncode != 0:
                raise SystemExit(f"workers={workers}: exit {run.returncode}\n{run.stderr[-3000:]}")
            doc = json.loads((out / "report.json").read_text())
            rows.append({"workers": workers, "wall_s": round(wall, 1), "plans": doc["summary"]["count"],
                         "per_worker_plans_per_s": [round(w["plans_per_s"], 2) for w in doc["workers"]]})
            print(json.dumps(rows[-1]), flush=True)
    load = os.getloadavg()
    print(f"bags={args.bags} ticks/bag={args.ticks} cpus={os.cpu_count()} load avg (1/5/15 min)={load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")
    for row in rows[1:]:
        print(f"wall time ratio {rows[0]['workers']} / {row['workers']} workers: {rows[0]['wall_s'] / row['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
