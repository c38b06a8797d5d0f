"""`alpamayo-sim-demo --out DIR`: a closed loop through the egodriver service, driven by a real runtime.

carla-driver-interface's FakeLoop (a CARLA-free AlpaSim runtime: a straight two-lane road
rendered for each declared camera, the ego moved exactly along each answered plan) drives
`alpamayo-egodriver` over gRPC on this machine. The service records the session; the report
says what a simulator user reads: progress along the road, time off the lane and off the road,
planning latency per tick, and the reasoning text of every plan. Without --checkpoint a tiny
random checkpoint is written and used: it drives nonsense, the demo shows the plumbing.

    DIR/report.json, DIR/report.md, DIR/session/<uuid>/drives.jsonl (+ each plan's input), DIR/egodriver.log
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from carla_driver_interface.testing import FakeCamera, FakeLoop

from alpamayo_ros.sim.cli import ALPASIM_CAMERAS
from alpamayo_ros.sim.process import start_egodriver

LANE_HALF_WIDTH_M = 1.75  # FakeLoop's lane markings are at +-1.75 m around the start lane's centre
ROAD_HALF_WIDTH_M = 7.0
#: where AlpaSim's cameras look on the fake rig: (yaw left, horizontal field of view), degrees
CAMERA_VIEWS = {"camera_cross_left_120fov": (60.0, 120.0), "camera_front_wide_120fov": (0.0, 120.0),
                "camera_cross_right_120fov": (-60.0, 120.0), "camera_front_tele_30fov": (0.0, 30.0)}  # fmt: skip


def demo_cameras(count: int, width: int, height: int) -> list[FakeCamera]:
    """The first `count` of AlpaSim's Alpamayo cameras (front wide first), as FakeLoop renders them."""
    names = ["camera_front_wide_120fov", *[n for n in ALPASIM_CAMERAS if n != "camera_front_wide_120fov"]][:count]
    return [FakeCamera(logical_id=name, width=width, height=height, fov_deg=CAMERA_VIEWS[name][1],
                       yaw_left_deg=CAMERA_VIEWS[name][0], pitch_down_deg=5.0) for name in names]  # fmt: skip


def summarize(ego_xyz: np.ndarray, step_s: float, drives: list[dict]) -> dict:
    """The report: progress, time off the lane and road, latency per tick, reasoning per plan."""
    lateral = np.abs(ego_xyz[:, 1])
    handler_ms = np.array([d["handler_ms"] for d in drives])
    planned = [d for d in drives if d["outcome"] == "planned"]
    plan_ms = np.array([d["handler_ms"] for d in planned]) if planned else np.zeros(0)
    return {
        "steps": len(drives), "step_s": step_s, "plans": len(planned),
        "skipped": {reason: sum(d["outcome"] == reason for d in drives) for reason in
                    sorted({d["outcome"] for d in drives} - {"planned"})},
        "progress_m": float(ego_xyz[-1, 0] - ego_xyz[0, 0]),
        "mean_speed_mps": float((ego_xyz[-1, 0] - ego_xyz[0, 0]) / max(step_s * (len(ego_xyz) - 1), step_s)),
        "time_off_lane_s": float((lateral > LANE_HALF_WIDTH_M).sum() * step_s),
        "time_off_road_s": float((lateral > ROAD_HALF_WIDTH_M).sum() * step_s),
        "max_lateral_offset_m": float(lateral.max()),
        "drive_ms": {"p50": _percentile(handler_ms, 50), "p90": _percentile(handler_ms, 90),
                     "planned_p50": _percentile(plan_ms, 50), "planned_p90": _percentile(plan_ms, 90)},
        "ticks": [{"tick": d["tick"], "time_s": d["time_now_us"] / 1e6, "outcome": d["outcome"],
                   "drive_ms": round(d["handler_ms"], 1), "lateral_m": float(ego_xyz[d["tick"], 1]),
                   "reasoning": d.get("reasoning_text", "")} for d in drives],
    }  # fmt: skip


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def write_markdown(path: Path, report: dict) -> None:
    ms = report["drive_ms"]
    lines = [
        "# alpamayo-sim-demo", "",
        f"{report['steps']} drive() calls of {report['step_s']:.1f} s, {report['plans']} plans; "
        f"skipped while inputs did not suffice: {report['skipped']}", "",
        f"- progress: {report['progress_m']:.2f} m ({report['mean_speed_mps']:.2f} m/s)",
        f"- time off the lane: {report['time_off_lane_s']:.1f} s; off the road: {report['time_off_road_s']:.1f} s "
        f"(largest lateral offset {report['max_lateral_offset_m']:.2f} m)",
        f"- drive() latency: p50 {_ms(ms['p50'])}, p90 {_ms(ms['p90'])}; ticks with a plan: p50 "
        f"{_ms(ms['planned_p50'])}, p90 {_ms(ms['planned_p90'])}", "",
        "| tick | t (s) | outcome | drive (ms) | lateral (m) | reasoning |", "| --- | --- | --- | --- | --- | --- |",
        *[f"| {t['tick']} | {t['time_s']:.1f} | {t['outcome']} | {t['drive_ms']} | {t['lateral_m']:.3f} | "
          f"{_cell(t['reasoning'])} |" for t in report["ticks"]],
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.1f} ms"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:160]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alpamayo-sim-demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", default="out/sim_demo")
    parser.add_argument("--checkpoint", default=None, help="default: a tiny random checkpoint in OUT/checkpoint")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=60, help="drive() calls (the first 15 build the history)")
    parser.add_argument("--cameras", type=int, default=4, choices=(1, 2, 3, 4))
    parser.add_argument("--size", default="480x270", help="rendered WIDTHxHEIGHT per camera")
    parser.add_argument("--speed", type=float, default=5.0, help="initial speed, m/s")
    parser.add_argument("--seed", type=int, default=0, help="the session's random_seed")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a node parameter for the service (default: 32 reasoning tokens)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from alpamayo_ros.core.tiny_checkpoint import write_checkpoint

        checkpoint = str(write_checkpoint(out / "checkpoint", seed=0))
    width, height = (int(v) for v in args.size.split("x"))
    cameras = demo_cameras(args.cameras, width, height)
    params = ["sampling.max_reasoning_tokens=32", *args.param]
    service_args = ["--checkpoint", checkpoint, "--device", args.device, "--record", str(out / "session"),
                    *[a for c in cameras for a in ("--camera", f"{c.logical_id}={ALPASIM_CAMERAS[c.logical_id]}")],
                    *[a for p in params for a in ("-p", p)]]  # fmt: skip
    print(f"starting alpamayo-egodriver ({checkpoint}, {len(cameras)} camera(s))", flush=True)
    service = start_egodriver(service_args, log_path=out / "egodriver.log")
    try:
        before = set((out / "session").glob("*"))
        with FakeLoop(service.address, cameras, initial_speed_mps=args.speed, timeout_s=600.0) as loop:
            result = loop.run(args.steps, seed=args.seed)
        session = next(iter(set((out / "session").glob("*")) - before))
    finally:
        code = service.stop()
    drives = [json.loads(line) for line in (session / "drives.jsonl").read_text().splitlines()]
    report = {"checkpoint": checkpoint, "session": session.name, "cameras": [c.logical_id for c in cameras],
              "service_exit_code": code, **summarize(result.ego.positions, loop.step_s, drives)}  # fmt: skip
    (out / "report.json").write_text(json.dumps(report, indent=2))
    write_markdown(out / "report.md", report)
    ms = report["drive_ms"]
    print(f"{report['steps']} ticks, {report['plans']} plans; progress {report['progress_m']:.2f} m, off lane "
          f"{report['time_off_lane_s']:.1f} s, off road {report['time_off_road_s']:.1f} s; drive() p50 "
          f"{_ms(ms['p50'])}, planned p50 {_ms(ms['planned_p50'])}; report: {out / 'report.md'}")  # fmt: skip
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
