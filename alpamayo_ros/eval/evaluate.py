"""`alpamayo-eval BAG... --checkpoint DIR`: offline, deterministic open-loop evaluation on rosbags.

The bag is stepped at the planning rate on its own log time, as the drive node would see it
replayed with /clock: every message logged up to a tick is fed to the node's input code
(parameters, frame sync, ego history and builder are the node's own modules), then the
planner runs and its plan is compared with the ego future recorded in the bag's odometry
(6.4 s, in the t0 ego frame). Skipped ticks are counted by reason, never silently dropped.
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import yaml
from tqdm import tqdm

from alpamayo_ros.core.types import DrivingInput, Plan, SamplingSettings
from alpamayo_ros.eval.bags import COMPRESSED_IMAGE, IMAGE, ODOMETRY, STRING, bag_time_range, bag_topics, read_messages
from alpamayo_ros.eval.ground_truth import FUTURE_DETAILS, OdometryTrack
from alpamayo_ros.eval.metrics import PlanScore, score_plan
from alpamayo_ros.eval.report import CameraProjection, ReportOptions, write_report
from alpamayo_ros.inputs import Rejection
from alpamayo_ros.inputs.builder import Assembly, build_driving_input
from alpamayo_ros.inputs.ego_history import OdometryBuffer
from alpamayo_ros.inputs.frame_sync import FrameSync
from alpamayo_ros.inputs.route import RouteRejected, check_route
from alpamayo_ros.inputs.messages import (ImageRejected, compressed_image_to_rgb, fit_image, odometry_pose,
                                          raw_image_to_rgb, stamp_to_ns)
from alpamayo_ros.settings import SPECS, DriveSettings, parse_settings

logger = logging.getLogger(__name__)

NS_PER_S = 1_000_000_000
PLAN_FAILED = "plan_failed"  # the planner raised


class Planner(Protocol):
    """Anything that turns a DrivingInput into a Plan (the pipeline; a test double in tests)."""

    def plan(self, driving_input: DrivingInput, settings: SamplingSettings) -> Plan: ...


def load_params_file(path: str | Path) -> dict[str, Any]:
    """Flatten a ROS params YAML (any node key, nested or dotted names) to name -> value."""
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"params file {path}: {exc}") from None
    values: dict[str, Any] = {}

    def flatten(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                flatten(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            values[prefix] = node

    for section in doc.values() if isinstance(doc, dict) else ():
        if isinstance(section, dict) and "ros__parameters" in section:
            flatten("", section["ros__parameters"])
    if not values:
        raise ValueError(f"params file {path}: no '<node>: ros__parameters:' section")
    values.pop("use_sim_time", None)  # a ROS built-in, not one of the node's parameters
    unknown = sorted(set(values) - SPECS.keys())
    if unknown:
        raise ValueError(f"params file {path}: unknown parameters {unknown}")
    return values


def settings_values(params_file: str | Path | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """Node defaults <- params file <- command-line overrides (None = not given), unvalidated.

    Plain name -> value data: what a Ray worker receives to build the same settings.
    """
    values = {name: spec.default for name, spec in SPECS.items()}
    if params_file is not None:
        values.update(load_params_file(params_file))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return values


def drive_settings(params_file: str | Path | None, overrides: dict[str, Any], *, check_paths: bool = True) -> DriveSettings:
    """settings_values validated by the node's parser."""
    return parse_settings(settings_values(params_file, overrides), check_paths=check_paths)


@dataclass
class TickResult:
    """One planning tick: either a scored plan or the reason it was skipped."""

    tick_ns: int
    t0_ns: int | None = None
    skip_reason: str | None = None
    skip_detail: str = ""
    score: PlanScore | None = None
    plan: Plan | None = None
    true_xyz: np.ndarray | None = None
    inputs: DrivingInput | None = None  # what the planner got (after compact(): the newest frames only)

    def to_json(self, bag_start_ns: int) -> dict[str, Any]:
        out: dict[str, Any] = {"tick_s": (self.tick_ns - bag_start_ns) / NS_PER_S, "t0_ns": self.t0_ns}
        if self.score is None or self.plan is None:
            out.update(skipped=self.skip_reason, detail=self.skip_detail)
            return out
        out.update(min_ade=self.score.min_ade, mean_ade=self.score.mean_ade, min_fde=self.score.min_fde,
                   ade=self.score.ade, fde=self.score.fde, best_sample=self.score.best_sample,
                   route=self.inputs.route_text if self.inputs is not None else None,
                   coc=self.plan.coc, reasoning_closed=self.plan.reasoning_closed, timings_ms=self.plan.timings_ms)
        return out


@dataclass
class BagResult:
    bag: Path
    start_ns: int
    ticks: list[TickResult] = field(default_factory=list)
    dropped_images: dict[str, int] = field(default_factory=dict)  # reason -> count, as the node counts
    refused_routes: dict[str, int] = field(default_factory=dict)  # reason -> count (inputs.route.check_route)
    timeline_jumps: int = 0  # odometry stamps went back this often (see ground_truth)

    @property
    def scored(self) -> list[TickResult]:
        return [t for t in self.ticks if t.score is not None]

    def skipped(self) -> Counter:
        return Counter(t.skip_reason for t in self.ticks if t.skip_reason)

    def compact(self) -> BagResult:
        """The same result keeping only each input's newest frame (what the report draws), so a
        Ray worker ships megabytes, not every frame of every tick."""
        ticks = [replace(t, inputs=replace(t.inputs, images=t.inputs.images[:, -1:],
                                           frame_stamps_ns=t.inputs.frame_stamps_ns[:, -1:]))
                 if t.inputs is not None else t for t in self.ticks]
        return replace(self, ticks=ticks)


def check_bag(path: str | Path) -> Path:
    """The bag directory, or ValueError (one line, naming the path) when it is none.

    Cheap on purpose (thousands of bags are checked before any model loads); a bag whose content
    is damaged fails when it is read, as a result of its own in the report.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"bag {path}: no such file or directory")
    if not (path / "metadata.yaml").is_file():
        raise ValueError(f"bag {path}: not a rosbag2 directory (no metadata.yaml)")
    return path


def _bag_messages(bag: Path, settings: DriveSettings) -> Iterator[tuple[int, str, Any]]:
    """(log time, topic, message) of the configured topics, checked against the node's types.

    The navigation topic is optional (a bag without a route plans without one, as the node does).
    """
    expected = {c.topic: IMAGE if c.transport == "raw" else COMPRESSED_IMAGE for c in settings.cameras}
    expected[settings.odometry_topic] = ODOMETRY
    if settings.navigation_topic in bag_topics(bag):
        expected[settings.navigation_topic] = STRING
    keys = {settings.odometry_topic: "odometry.topic", settings.navigation_topic: "navigation.topic"}
    for m in read_messages(bag, topics=list(expected)):
        if m.msgtype != expected[m.topic]:
            key = keys.get(m.topic, "cameras.transports")
            raise ValueError(f"{key}: {m.topic} carries {m.msgtype} in {bag}, the node would subscribe {expected[m.topic]}")
        yield m.log_time_ns, m.topic, m.msg


class InputFeed:
    """The node's input path for one bag: decode, fit and buffer exactly as the callbacks do."""

    def __init__(self, settings: DriveSettings) -> None:
        self.settings = settings
        self.sync: FrameSync[np.ndarray] = FrameSync(settings.frame_sync)
        self.odometry = OdometryBuffer(settings.ego_history)
        self._cameras = {c.topic: c for c in settings.cameras}
        self._route: tuple[str, int] | None = None  # (checked text, log time of arrival)
        self.dropped: Counter = Counter()
        self.refused_routes: Counter = Counter()

    def add(self, log_ns: int, topic: str, msg: Any) -> None:
        if topic == self.settings.odometry_topic:
            self.odometry.add(*odometry_pose(msg))
            return
        if topic == self.settings.navigation_topic:
            self._on_route(log_ns, msg.data)
            return
        camera = self._cameras[topic]
        decode = raw_image_to_rgb if camera.transport == "raw" else compressed_image_to_rgb
        try:
            image = fit_image(decode(msg), self.settings.image_size)
        except ImageRejected as exc:
            self.dropped[exc.reason] += 1
            return
        self.sync.add(camera.index, stamp_to_ns(msg.header.stamp), image)

    def _on_route(self, log_ns: int, text: str) -> None:
        """The route check the node applies at arrival: a refused route is counted and dropped."""
        try:
            route = check_route(text, self.settings.navigation_max_chars)
        except RouteRejected as exc:
            logger.warning("navigation.topic: route refused at log time %d (%s); planning goes on without it", log_ns, exc)
            self.refused_routes[exc.reason] += 1
            route = None
        self._route = (route, log_ns) if route else None

    def route_at(self, now_ns: int) -> str | None:
        """The route the node would plan with at now_ns (navigation.max_age_s freshness)."""
        if self._route is None:
            return None
        text, arrived_ns = self._route
        max_age_ns = self.settings.navigation_max_age_ns
        return text if max_age_ns == 0 or now_ns - arrived_ns <= max_age_ns else None

    def build(self, tick_ns: int, t0_ns: int | None = None) -> Assembly | Rejection:
        """The input at tick_ns (the node clock); with t0_ns forced, camera staleness is not checked."""
        return build_driving_input(self.sync, self.odometry, now_ns=tick_ns if t0_ns is None else None, t0_ns=t0_ns,
                                   route_text=self.route_at(tick_ns))


def evaluate_bag(bag: str | Path, planner: Planner, settings: DriveSettings, *, max_ticks: int | None = None,
                 t0s_ns: Sequence[int] | None = None, progress: bool = False,
                 on_tick: Callable[[int, int], None] | None = None) -> BagResult:
    """Step one bag at settings' planning rate and score every plan (see module docstring).

    t0s_ns: plan exactly at these times instead (e.g. the t0s the node planned for online):
        messages logged up to t0 plus the frame-matching slack are fed, and t0 is forced.
    on_tick: called with (ticks done, ticks in this bag) after every tick (a worker's progress).
    """
    bag = Path(bag)
    track = OdometryTrack.from_bag(bag, settings.odometry_topic)
    if track.jumps:
        logger.warning("%s: odometry stamps jump back %d time(s); ground truth is taken within one timeline",
                       bag, track.jumps)
    feed = InputFeed(settings)
    start_ns, end_ns = bag_time_range(bag)
    if t0s_ns is None:
        period_ns = int(round(settings.planning_period_s * NS_PER_S))
        ticks = [start_ns + (k + 1) * period_ns for k in range((end_ns - start_ns) // period_ns)]
        slack_ns = 0
    else:
        ticks = sorted(int(t) for t in t0s_ns)
        sync = settings.frame_sync
        slack_ns = sync.max_skew_ns + sync.max_frame_error_ns + settings.ego_history.max_stale_ns
    if max_ticks is not None:
        ticks = ticks[:max_ticks]
    messages = _bag_messages(bag, settings)
    pending = next(messages, None)
    result = BagResult(bag=bag, start_ns=start_ns, timeline_jumps=track.jumps)
    for tick in tqdm(ticks, desc=bag.name, unit="tick", disable=not progress):
        while pending is not None and pending[0] <= tick + slack_ns:  # everything that had arrived
            feed.add(*pending)
            pending = next(messages, None)
        forced_t0 = None if t0s_ns is None else tick
        result.ticks.append(_tick(tick, feed, track, planner, settings, forced_t0))
        if on_tick is not None:
            on_tick(len(result.ticks), len(ticks))
    result.dropped_images = dict(feed.dropped)
    result.refused_routes = dict(feed.refused_routes)
    return result


def _tick(tick: int, feed: InputFeed, track: OdometryTrack, planner: Planner, settings: DriveSettings,
          forced_t0: int | None) -> TickResult:
    built = feed.build(tick, forced_t0)
    if isinstance(built, Rejection):
        return TickResult(tick, skip_reason=built.reason.value, skip_detail=built.detail)
    t0 = built.driving_input.t0_ns
    future = track.future(built, tick, settings.ego_history.max_gap_ns)
    if isinstance(future, str):
        return TickResult(tick, t0, skip_reason=future, skip_detail=FUTURE_DETAILS[future])
    try:
        plan = planner.plan(built.driving_input, settings.sampling)
    except Exception as exc:  # a failing plan is a result to report, as the node reports it
        logger.exception("planner failed at t0 %d", t0)
        return TickResult(tick, t0, skip_reason=PLAN_FAILED, skip_detail=f"{type(exc).__name__}: {exc}")
    return TickResult(tick, t0, score=score_plan(plan.xyz, future), plan=plan, true_xyz=future,
                      inputs=built.driving_input)


def _camera_arg(text: str) -> CameraProjection:
    parts = [float(x) for x in text.split(",")]
    if len(parts) not in (6, 10):
        raise argparse.ArgumentTypeError("expected fx,fy,cx,cy,width,height[,x_m,y_m,z_m,yaw_rad]")
    return CameraProjection(parts[0], parts[1], parts[2], parts[3], int(parts[4]), int(parts[5]), *parts[6:])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="alpamayo-eval", description=__doc__.splitlines()[0])
    parser.add_argument("bags", nargs="*", type=Path, help="rosbag2 directories (sqlite3 or MCAP)")
    parser.add_argument("--clips", type=Path, metavar="LIST", help="file of PhysicalAI-AV clip ids, one per line (with --pai-root)")
    parser.add_argument("--pai-root", type=Path, metavar="DIR", help="local PhysicalAI-AV copy the clips are converted from")
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (default: model.checkpoint_path of --params-file)")
    parser.add_argument("--params-file", type=Path, help="the node's YAML (e.g. config/drive.yaml): topics, sync, sampling")
    parser.add_argument("--out", type=Path, default=Path("eval_out"), help="report directory")
    parser.add_argument("--rate", type=float, help="planning rate (Hz); default planning.rate_hz")
    parser.add_argument("--backend", choices=("hf", "vllm"), help="default model.backend")
    parser.add_argument("--device", help="default model.device")
    parser.add_argument("--camera-topics", nargs="+", help="cameras.topics (with --camera-indices)")
    parser.add_argument("--camera-indices", nargs="+", type=int, help="cameras.indices")
    parser.add_argument("--camera-transports", nargs="+", help="cameras.transports")
    parser.add_argument("--odometry-topic", help="odometry.topic")
    parser.add_argument("--num-samples", type=int, help="sampling.num_samples")
    parser.add_argument("--max-reasoning-tokens", type=int, help="sampling.max_reasoning_tokens")
    parser.add_argument("--max-ticks", type=int, help="stop each bag after this many ticks")
    parser.add_argument("--front-camera", type=_camera_arg,
                        help="fx,fy,cx,cy,width,height[,x_m,y_m,z_m,yaw] of camera index 1: draws the paths into it")
    parser.add_argument("--plans-topic", help="score the TrajectorySet plans recorded on this topic instead of running a model")
    parser.add_argument("--t0s-from", metavar="TOPIC",
                        help="run the model at the t0s of the plans recorded on TOPIC and report how far its plans differ")
    parser.add_argument("--ray", action="store_true", help="spread the bags over Ray workers (one model each)")
    parser.add_argument("--ray-address", metavar="auto|ADDRESS",
                        help="join a running Ray cluster (default: start a local instance for this run)")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers (with --ray)")
    parser.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs each Ray worker reserves (with --ray)")
    parser.add_argument("--max-attempts", type=int, default=3, help="tries of a bag whose Ray worker dies (with --ray)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    # the job and fleet modules build on this one; imported here, where the command line needs them
    from alpamayo_ros.eval.jobs import JobOptions, make_jobs, run_here

    if not args.bags and args.clips is None:
        parser.error("give BAG... and/or --clips LIST --pai-root DIR")
    if not args.ray and (args.ray_address or args.gpus_per_worker):
        parser.error("--ray-address/--gpus-per-worker need --ray")
    overrides = {
        "model.checkpoint_path": str(args.checkpoint) if args.checkpoint else None, "model.backend": args.backend,
        "model.device": args.device, "planning.rate_hz": args.rate, "cameras.topics": args.camera_topics,
        "cameras.indices": args.camera_indices, "odometry.topic": args.odometry_topic,
        "sampling.num_samples": args.num_samples, "sampling.max_reasoning_tokens": args.max_reasoning_tokens,
        "cameras.transports": args.camera_transports or (["compressed"] * len(args.camera_topics) if args.camera_topics else None),
    }
    try:  # every input is checked here, before a model loads
        values = settings_values(args.params_file, overrides)
        if not values["model.checkpoint_path"]:
            if not args.plans_topic:
                raise ValueError("--checkpoint: required (or model.checkpoint_path in --params-file, "
                                 "or score recorded plans with --plans-topic)")
            values["model.checkpoint_path"] = "none (recorded plans)"
        settings = parse_settings(values, check_paths=not args.plans_topic)
        jobs = make_jobs(args.bags, args.clips, args.pai_root)
    except ValueError as exc:
        parser.exit(2, f"alpamayo-eval: error: {exc}\n")
    options = JobOptions(max_ticks=args.max_ticks, plans_topic=args.plans_topic, t0s_from=args.t0s_from,
                         progress=not args.no_progress and not args.ray)
    if args.ray:
        from alpamayo_ros.eval.fleet import FleetOptions, run_on_ray

        fleet = FleetOptions(address=args.ray_address, workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                             max_attempts=args.max_attempts, progress=not args.no_progress)
        try:
            summary = run_on_ray(jobs, values, options, fleet)
        except (RuntimeError, ValueError) as exc:
            parser.exit(1, f"alpamayo-eval: error: {exc}\n")
    else:
        summary = run_here(jobs, settings, options, load_pipeline)
    outcomes = [o for o in summary.outcomes if o is not None]
    meta: dict[str, Any] = {"checkpoint": settings.checkpoint_path if options.needs_model else None,
                            "backend": f"recorded plans on {args.plans_topic}" if args.plans_topic else settings.backend,
                            "failed": [f.to_json() for f in summary.failures], "interrupted": summary.interrupted,
                            "unfinished": summary.unfinished(jobs),
                            # time in jobs, model loads excluded: plans / busy_s is the throughput, as per Ray worker
                            "busy_s": round(sum(o.wall_s for o in outcomes), 3)}
    if args.ray:
        meta.update(workers=summary.workers, worker_deaths_retried=summary.retries)
    if args.t0s_from:
        differences = {t0: d for o in outcomes for t0, d in o.replan_differences.items()}
        meta["replan_max_difference_m"] = max(differences.values()) if differences else None
        meta["replan_compared"] = len(differences)
    doc = write_report(args.out, [o.result for o in outcomes], settings, ReportOptions(camera=args.front_camera), meta)
    s = doc["summary"]
    logger.info("minADE %.3f m (mean over %d plans), minFDE %.3f m, %.0f%% of %d ticks skipped %s; report in %s",
                s["min_ade_mean"], s["count"], s["min_fde_mean"], 100 * doc["skipped_share"], doc["ticks_total"],
                doc["skipped"], args.out)
    if summary.interrupted:
        raise SystemExit(130)
    if summary.failures:
        logger.error("%d bag(s) failed: %s", len(summary.failures), ", ".join(f.name for f in summary.failures))
        raise SystemExit(1)


def load_pipeline(settings: DriveSettings) -> Planner:
    """The model pipeline of the node's settings (torch is imported only here)."""
    from alpamayo_ros.core.pipeline import Pipeline

    return Pipeline.from_checkpoint(settings.checkpoint_path, backend=settings.backend, device=settings.device,
                                    dtype=settings.dtype, backend_options=settings.backend_options)


if __name__ == "__main__":
    main()
