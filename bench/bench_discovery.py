"""How long a drive node takes to match its sensor publishers, per Fast DDS transport setting.

The sensor rig (cameras, odometry, /clock) runs in this process and `alpamayo_drive` as a child,
as in the node tests. A trial is the time from starting the node to every sensor topic matched.
Settings alternate trial by trial, so the machine's load falls on each alike; `--load N` adds N
busy processes (a CI box running the suite on two workers is far from idle).

    python -m bench.bench_discovery --trials 20 --load 3 --json out.json
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

from alpamayo_ros.testing.rig import (
    TRANSPORTS,
    CameraFeed,
    RosSide,
    SensorRig,
    log_excerpt,
    ros_env,
    start_console_script,
    stop_process,
    unique_domain_id,
    write_params_file,
)

POLL_S = 0.01


def trial(domain_id: int, transports: str, checkpoint: Path, work: Path, timeout_s: float) -> float | None:
    """Seconds from starting the node to all sensor topics matched; None if that never happened."""
    side = RosSide(domain_id, "discovery_bench", transports=transports)
    cameras = [CameraFeed(1, "/bench/front", "raw"), CameraFeed(6, "/bench/tele", "compressed")]
    rig = SensorRig(side, cameras, odometry_topic="/bench/odom", sim_start_s=1000.0).start()
    params = write_params_file(work / "drive.yaml", {
        "model.checkpoint_path": str(checkpoint),
        "cameras.topics": [c.topic for c in cameras],
        "cameras.indices": [c.index for c in cameras],
        "cameras.transports": [c.transport for c in cameras],
        "odometry.topic": "/bench/odom",
        "sampling.max_reasoning_tokens": 4,
        "use_sim_time": True,
    })
    log = work / "node.log"
    env = ros_env(domain_id, OMP_NUM_THREADS="1", FASTDDS_BUILTIN_TRANSPORTS=transports)
    started = time.monotonic()
    node = start_console_script("alpamayo_drive", env=env, log_path=log, params_file=params)
    elapsed = None
    try:
        while time.monotonic() - started < timeout_s and node.poll() is None:
            if all(count >= 1 for count in rig.matched().values()):
                elapsed = time.monotonic() - started
                break
            time.sleep(POLL_S)
        if elapsed is None:
            (work / f"unmatched-{time.time_ns()}.log").write_text(log_excerpt(log, rig))
    finally:
        rig.stop()
        stop_process(node, timeout_s=40)
        side.close()
    return elapsed


def summary(times: list[float | None]) -> dict[str, float | int | None]:
    from bench.bench_pipeline import percentiles  # the pipeline bench's percentiles (imports torch)

    matched = [t for t in times if t is not None]
    spread = percentiles(matched) if matched else {"p50": None, "p90": None}
    return {
        "trials": len(times),
        "unmatched": len(times) - len(matched),
        "p50_s": spread["p50"],
        "p90_s": spread["p90"],
        "max_s": max(matched, default=None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", action="append", metavar="SETTING",
                        help=f"a FASTDDS_BUILTIN_TRANSPORTS value, repeatable (default: {TRANSPORTS} and LARGE_DATA)")
    parser.add_argument("--trials", type=int, default=20, help="trials per setting")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the trials")
    parser.add_argument("--timeout-s", type=float, default=90.0, help="a trial that has not matched by then counts as unmatched")
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (default: a tiny random one in OUT)")
    parser.add_argument("--out", type=Path, help="work directory: params, node logs of unmatched trials (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()
    settings = args.transports or [TRANSPORTS, "LARGE_DATA"]
    if args.trials < 1:
        parser.error("--trials: at least 1")
    if args.load < 0:
        parser.error("--load: 0 or more")
    work = args.out or Path(tempfile.mkdtemp(prefix="bench_discovery_"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from alpamayo_ros.core.tiny_checkpoint import write_checkpoint

        checkpoint = write_checkpoint(work / "tiny_checkpoint", seed=0)

    domain_id = unique_domain_id()  # held for the whole run; trials follow one another in it
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    times: dict[str, list[float | None]] = {s: [] for s in settings}
    try:
        for i in range(args.trials):
            for setting in settings:
                elapsed = trial(domain_id, setting, checkpoint, work, args.timeout_s)
                times[setting].append(elapsed)
                print(f"trial {i + 1}/{args.trials} {setting}: "
                      + (f"{elapsed:.2f} s" if elapsed is not None else f"unmatched after {args.timeout_s:.0f} s"), flush=True)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()

    report = {
        "settings": {s: {**summary(t), "times_s": t} for s, t in times.items()},
        "load": args.load,
        "cpus": os.cpu_count(),
        "loadavg_after": os.getloadavg(),
    }
    first = report["settings"][settings[0]]["p50_s"]
    print(f"\nnode start -> all sensor topics matched; {args.trials} trials per setting, {args.load} busy processes, "
          f"{os.cpu_count()} CPUs\n")
    print("| FASTDDS_BUILTIN_TRANSPORTS | p50 s | p90 s | max s | unmatched | p50 / first |")
    print("| --- | --- | --- | --- | --- | --- |")
    for setting, row in report["settings"].items():
        cells = [f"{row[k]:.2f}" if row[k] is not None else "-" for k in ("p50_s", "p90_s", "max_s")]
        ratio = f"{row['p50_s'] / first:.2f}" if first and row["p50_s"] is not None else "-"
        print(f"| `{setting}` | {' | '.join(cells)} | {row['unmatched']} / {row['trials']} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(row["unmatched"] == 0 for row in report["settings"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
