"""`alpamayo-demo [--out DIR]`: a closed-loop drive on a synthetic road, recorded and evaluated.

The demo process renders the road for a few small cameras, publishes them with odometry and
/clock, and moves the ego vehicle along the plans the drive node (its console script, a
separate process, on simulated time) publishes. By default the loop runs in lockstep: simulated
time (at most real time) stops at every planning tick until that tick's plan arrives, so a slow
CPU model drives the car as if it planned in time and the same seed gives the same drive and
report. --no-lockstep lets time run on while the node plans (bounded waits). Everything is
recorded to MCAP; afterwards the evaluator re-plans at the node's t0s from the recording
(the node's input code, the same checkpoint and seed), scores the plans against the driven
path and checks that it reproduces the node's plans.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import rclpy
from rclpy.executors import ExternalShutdownException

from alpamayo_ros.eval.bags import BagWriter, bag_topics
from alpamayo_ros.rostools.demo_scene import LOCKSTEP_QOS, NODE, ODOM, TRAJECTORIES, DemoOptions, DemoScene, camera_topic
from alpamayo_ros.eval.evaluate import drive_settings, evaluate_bag, load_pipeline
from alpamayo_ros.eval.metrics import summarize
from alpamayo_ros.rostools.processes import start_console_script, stop_process
from alpamayo_ros.eval.recorded_plans import RecordedPlans, plan_differences
from alpamayo_ros.eval.report import CameraProjection, ReportOptions, plot_drive_map, write_report
from alpamayo_ros.eval.scene import PinholeCamera, default_rig
from alpamayo_ros.settings import parse_param_overrides, write_params_file

logger = logging.getLogger(__name__)

DISCLAIMER = (
    "A tiny random model drives nonsense: this demo shows the plumbing (cameras, odometry, node, "
    "recording, evaluation), not driving skill. Real weights plug in through the checkpoint path: "
    "alpamayo-demo --checkpoint /path/to/Alpamayo-1.5-10B (and model.device cuda on a GPU)."
)


def node_parameters(opts: DemoOptions, rig: Sequence[PinholeCamera], checkpoint: Path) -> dict[str, Any]:
    """The drive node's parameters for this scene (written to drive.yaml, reused by the evaluator)."""
    return {
        "use_sim_time": True,
        "model.checkpoint_path": str(Path(checkpoint).resolve()),  # the evaluator may run elsewhere
        "cameras.topics": [camera_topic(c) for c in rig],
        "cameras.indices": [c.index for c in rig],
        "cameras.transports": ["compressed"] * len(rig),
        "images.width": opts.width,
        "images.height": opts.height,
        "odometry.topic": ODOM,
        "planning.rate_hz": opts.rate_hz,
        "sampling.max_reasoning_tokens": opts.max_reasoning_tokens,
        "sampling.num_samples": 1,
        **(LOCKSTEP_QOS if opts.lockstep else {}),
        **opts.extra_params,
    }


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Drive, record, evaluate; returns the report document (also in opts.out/report.json)."""
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "session", ignore_errors=True)  # this demo's own outputs of an earlier run
    for old in out.glob("*.png"):
        old.unlink()
    logger.warning(DISCLAIMER)
    checkpoint = opts.checkpoint
    if checkpoint is None:
        from alpamayo_ros.core.tiny_checkpoint import write_checkpoint

        checkpoint = write_checkpoint(out / "checkpoint")
        logger.info("wrote a tiny random checkpoint to %s", checkpoint)
    rig = default_rig(opts.width, opts.height)[: opts.cameras]
    params_file = out / "drive.yaml"
    write_params_file(params_file, node_parameters(opts, rig, checkpoint))
    bag = out / "session"
    started = time.monotonic()
    rclpy.init()
    node_process = start_console_script(NODE, log_path=out / "node.log", params_file=params_file)
    scene = None
    try:
        with BagWriter(bag, storage="mcap") as writer:
            scene = DemoScene(opts, rig, writer)
            logger.info("waiting for the drive node (model load and warm-up; log: %s)", out / "node.log")
            scene.wait_until_ready(node_process)
            logger.info("node ready after %.0f s; driving %.0f simulated seconds", time.monotonic() - started, opts.duration_s)
            if opts.lockstep:
                scene.drive_lockstep(node_process)
                scene.await_companions()
            else:
                scene.start_recording()
                scene.recorder.active = True
                scene.follower.log_pose(scene.sim_ns, scene.vehicle.pose)
                scene.drive(node_process)
            scene.spin(0.5)  # let the last outputs arrive before the recording closes
            drive = scene.summary(started)
    finally:
        code = stop_process(node_process, timeout_s=20.0)
        if scene is not None:
            scene.close()
        rclpy.try_shutdown()
    drive["recorded"] = {topic: count for topic, (_, count) in sorted(bag_topics(bag).items())}
    logger.info("drive recorded to %s (node exit code %d); evaluating", bag, code)
    return evaluate_session(opts.out, bag, params_file, scene, drive)


def evaluate_session(out: Path, bag: Path, params_file: Path, scene: DemoScene, drive: dict[str, Any]) -> dict[str, Any]:
    """Score the node's plans and re-plan at its t0s with the evaluator; write the report."""
    settings = drive_settings(params_file, {})
    meta: dict[str, Any] = {"checkpoint": settings.checkpoint_path, "backend": settings.backend, "demo": drive,
                            "disclaimer": DISCLAIMER}
    results = []
    try:
        recorded = RecordedPlans(bag, TRAJECTORIES, settings.ego_frame_id)
    except ValueError as exc:  # the node published nothing: still report why
        logger.error("no plans recorded: %s", exc)
        recorded = None
    if recorded is not None:
        online = evaluate_bag(bag, recorded, settings, t0s_ns=recorded.t0s_ns)
        meta["online_plans"] = {"published": len(recorded.t0s_ns), **summarize(t.score for t in online.scored)}
        offline = evaluate_bag(bag, load_pipeline(settings), settings, t0s_ns=recorded.t0s_ns, progress=True)
        differences = plan_differences(offline, recorded)
        meta["replan_compared"] = len(differences)
        meta["replan_max_difference_m"] = max(differences.values()) if differences else None
        results.append(offline)
    front = next((c for c in scene.rig if c.index == 1), scene.rig[0])
    fx, fy, cx, cy = front.intrinsics
    camera = CameraProjection(fx, fy, cx, cy, front.width, front.height, front.x_m, front.y_m, front.z_m, front.yaw)
    plot_drive_map(out / "drive_map.png", scene.road.centerline, scene.road.lane_width_m, scene.driven_xy(),
                   scene.follower.world_plans)
    options = ReportOptions(bev_plots=3, camera=camera, camera_index=front.index, notes=(DISCLAIMER,),
                            extra_plots=("drive_map.png",))
    return write_report(out, results, settings, options, meta)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="alpamayo-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="output directory")
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (default: a tiny random one in OUT/checkpoint)")
    parser.add_argument("--duration", type=float, default=20.0, help="simulated seconds to drive")
    parser.add_argument("--rate", type=float, default=1.0, help="planning rate (Hz)")
    parser.add_argument("--max-reasoning-tokens", type=int, default=8)
    parser.add_argument("--cameras", type=int, choices=(1, 2, 3), default=3, help="cameras in the rig (1 = front only)")
    parser.add_argument("--device", default="cpu", help="model.device of the node (cuda for real weights on a GPU)")
    parser.add_argument("--no-lockstep", action="store_true",
                        help="let simulated time run while the node plans (closer to a live car, not repeatable)")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME:=VALUE",
                        help="a node parameter (alpamayo_drive --help lists them), e.g. -p model.backend:=vllm; "
                             "the value is read as YAML, as ROS reads -p; repeat for more")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    extra = {"model.device": args.device} if args.device != "cpu" else {}
    try:
        extra.update(parse_param_overrides(args.param))
    except ValueError as error:
        parser.error(str(error))
    opts = DemoOptions(out=args.out, checkpoint=args.checkpoint, duration_s=args.duration, rate_hz=args.rate,
                       max_reasoning_tokens=args.max_reasoning_tokens, cameras=args.cameras, extra_params=extra,
                       lockstep=not args.no_lockstep)
    try:
        doc = run_demo(opts)
    except (KeyboardInterrupt, ExternalShutdownException):
        logger.error("interrupted; the recording so far is in %s", opts.out / "session")
        raise SystemExit(130) from None
    s = doc["summary"]
    logger.info("node plans followed: %d; re-planned offline with 6.4 s of driven future: %d (minADE %.2f m, "
                "minFDE %.2f m); largest offline-vs-node plan difference: %s m",
                doc["demo"]["plans_followed"], s["count"], s["min_ade_mean"], s["min_fde_mean"],
                doc.get("replan_max_difference_m"))
    logger.info("recording: %s; report: %s (+ report.json, %d PNG plots)", opts.out / "session",
                opts.out / "report.md", len(doc["plots"]))
    logger.warning(DISCLAIMER)


if __name__ == "__main__":
    main()
