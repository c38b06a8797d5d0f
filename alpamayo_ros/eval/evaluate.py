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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import yaml
from tqdm import tqdm

from alpamayo_ros.core.types import NUM_WAYPOINTS, WAYPOINT_DT_S, DrivingInput, Plan, SamplingSettings
from alpamayo_ros.eval.bags import COMPRESSED_IMAGE, IMAGE, ODOMETRY, TRAJECTORY_SET, bag_time_range, read_messages
from alpamayo_ros.eval.metrics import PlanScore, score_plan
from alpamayo_ros.eval.report import CameraProjection, ReportOptions, write_report
from alpamayo_ros.inputs import Rejection
from alpamayo_ros.inputs.builder import Assembly, build_driving_input
from alpamayo_ros.inputs.ego_history import OdometryBuffer, quaternion_to_matrix
from alpamayo_ros.inputs.frame_sync import FrameSync
from alpamayo_ros.inputs.messages import (ImageRejected, compressed_image_to_rgb, fit_image, odometry_pose,
                                          raw_image_to_rgb, stamp_to_ns)
from alpamayo_ros.settings import SPECS, DriveSettings, ParameterError, parse_settings

logger = logging.getLogger(__name__)

NS_PER_S = 1_000_000_000
FUTURE_UNAVAILABLE = "future_unavailable"  # the bag's odometry does not cover t0 .. t0 + 6.4 s
FUTURE_GAP = "future_gap"  # odometry gap inside the future window
PLAN_FAILED = "plan_failed"  # the planner raised


class Planner(Protocol):
    """Anything that turns a DrivingInput into a Plan (the pipeline; a test double in tests)."""

    def plan(self, driving_input: DrivingInput, settings: SamplingSettings) -> Plan: ...


def load_params_file(path: str | Path) -> dict[str, Any]:
    """Flatten a ROS params YAML (any node key, nested or dotted names) to name -> value."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    values: dict[str, Any] = {}

    def flatten(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                flatten(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            values[prefix] = node

    for section in doc.values():
        if isinstance(section, dict) and "ros__parameters" in section:
            flatten("", section["ros__parameters"])
    if not values:
        raise ValueError(f"params file {path}: no '<node>: ros__parameters:' section")
    values.pop("use_sim_time", None)  # a ROS built-in, not one of the node's parameters
    unknown = sorted(set(values) - SPECS.keys())
    if unknown:
        raise ValueError(f"params file {path}: unknown parameters {unknown}")
    return values


def drive_settings(params_file: str | Path | None, overrides: dict[str, Any], *, check_paths: bool = True) -> DriveSettings:
    """Node defaults <- params file <- command-line overrides, validated by the node's parser."""
    values = {name: spec.default for name, spec in SPECS.items()}
    if params_file is not None:
        values.update(load_params_file(params_file))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return parse_settings(values, check_paths=check_paths)


@dataclass(frozen=True)
class OdometryTrack:
    """Every odometry pose of a bag (header stamps, odometry frame), for the recorded future."""

    stamps_ns: np.ndarray
    xyz: np.ndarray

    @classmethod
    def from_bag(cls, bag: Path, topic: str) -> OdometryTrack:
        stamps, xyz = [], []
        for m in read_messages(bag, topics=[topic]):
            p = m.msg.pose.pose.position
            stamps.append(stamp_to_ns(m.msg.header.stamp))
            xyz.append((p.x, p.y, p.z))
        order = np.argsort(np.asarray(stamps, dtype=np.int64), kind="stable")
        stamps_arr = np.asarray(stamps, dtype=np.int64)[order]
        keep = np.concatenate([[True], np.diff(stamps_arr) > 0]) if len(stamps_arr) else np.zeros(0, bool)
        return cls(stamps_ns=stamps_arr[keep], xyz=np.asarray(xyz, dtype=np.float64).reshape(-1, 3)[order][keep])

    def future(self, assembly: Assembly, max_gap_ns: int) -> np.ndarray | str:
        """Recorded positions at t0 + 0.1 ... 6.4 s in the t0 ego frame, or a skip reason."""
        t0 = assembly.driving_input.t0_ns
        targets = t0 + np.arange(1, NUM_WAYPOINTS + 1, dtype=np.int64) * int(WAYPOINT_DT_S * NS_PER_S)
        if len(self.stamps_ns) < 2 or targets[-1] > self.stamps_ns[-1]:
            return FUTURE_UNAVAILABLE
        right = np.searchsorted(self.stamps_ns, targets, side="left")
        left = np.maximum(right - 1, 0)
        if (self.stamps_ns[right] - self.stamps_ns[left]).max() > max_gap_ns:
            return FUTURE_GAP
        span = np.maximum(self.stamps_ns[right] - self.stamps_ns[left], 1)
        w = ((targets - self.stamps_ns[left]) / span)[:, None]
        xyz = self.xyz[left] + w * (self.xyz[right] - self.xyz[left])
        ego = assembly.ego
        return ((xyz - ego.xyz_t0) @ ego.rot_t0).astype(np.float32)  # R_t0^T (p - p_t0), as the history


class RecordedPlans:
    """The plans a node published (TrajectorySet in its ego frame), looked up by t0.

    Scores what the node actually did online without running a model, and gives the t0s at
    which an offline re-plan must reproduce the node's plans.
    """

    def __init__(self, bag: str | Path, topic: str, ego_frame_id: str) -> None:
        self.plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # t0 -> (xyz (S, N, 3), quat xyzw (S, N, 4))
        for m in read_messages(bag, topics=[topic]):
            if m.msgtype != TRAJECTORY_SET:
                raise ValueError(f"plans topic {topic}: is {m.msgtype}, expected {TRAJECTORY_SET}")
            if m.msg.header.frame_id != ego_frame_id or not m.msg.samples:
                raise ValueError(f"plans topic {topic}: need plans in the ego frame {ego_frame_id!r} (output.frame: ego), "
                                 f"got frame {m.msg.header.frame_id!r} with {len(m.msg.samples)} samples")
            poses = [[(p.position, p.orientation) for p in s.poses] for s in m.msg.samples]
            self.plans[stamp_to_ns(m.msg.header.stamp)] = (
                np.array([[(p.x, p.y, p.z) for p, _ in row] for row in poses], dtype=np.float32),
                np.array([[(q.x, q.y, q.z, q.w) for _, q in row] for row in poses], dtype=np.float64))
        if not self.plans:
            raise ValueError(f"plans topic {topic}: no messages in {bag}")

    @property
    def t0s_ns(self) -> list[int]:
        return sorted(self.plans)

    def plan(self, driving_input: DrivingInput, settings: SamplingSettings) -> Plan:
        if driving_input.t0_ns not in self.plans:
            raise KeyError(f"no recorded plan for t0 {driving_input.t0_ns}")
        xyz, quat = self.plans[driving_input.t0_ns]
        return Plan(xyz=xyz, rot=quaternion_to_matrix(quat).astype(np.float32), coc=[""] * len(xyz),
                    generated_ids=[[] for _ in xyz], t0_ns=driving_input.t0_ns, backend="recorded")


def plan_differences(result: BagResult, recorded: RecordedPlans) -> dict[int, float]:
    """t0 -> largest waypoint distance (m) between a re-planned and the recorded plan."""
    out = {}
    for t in result.scored:
        if t.t0_ns in recorded.plans and recorded.plans[t.t0_ns][0].shape == t.plan.xyz.shape:
            out[t.t0_ns] = float(np.abs(t.plan.xyz - recorded.plans[t.t0_ns][0]).max())
    return out


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
    assembly: Assembly | None = None

    def to_json(self, bag_start_ns: int) -> dict[str, Any]:
        out: dict[str, Any] = {"tick_s": (self.tick_ns - bag_start_ns) / NS_PER_S, "t0_ns": self.t0_ns}
        if self.score is None or self.plan is None:
            out.update(skipped=self.skip_reason, detail=self.skip_detail)
            return out
        out.update(min_ade=self.score.min_ade, mean_ade=self.score.mean_ade, min_fde=self.score.min_fde,
                   ade=self.score.ade, fde=self.score.fde, best_sample=self.score.best_sample,
                   coc=self.plan.coc, timings_ms=self.plan.timings_ms)
        return out


@dataclass
class BagResult:
    bag: Path
    start_ns: int
    ticks: list[TickResult] = field(default_factory=list)
    dropped_images: dict[str, int] = field(default_factory=dict)  # reason -> count, as the node counts

    @property
    def scored(self) -> list[TickResult]:
        return [t for t in self.ticks if t.score is not None]

    def skipped(self) -> Counter:
        return Counter(t.skip_reason for t in self.ticks if t.skip_reason)


def _bag_messages(bag: Path, settings: DriveSettings) -> Iterator[tuple[int, str, Any]]:
    """(log time, topic, message) of the configured topics, checked against the node's types."""
    expected = {c.topic: IMAGE if c.transport == "raw" else COMPRESSED_IMAGE for c in settings.cameras}
    expected[settings.odometry_topic] = ODOMETRY
    for m in read_messages(bag, topics=list(expected)):
        if m.msgtype != expected[m.topic]:
            key = "odometry.topic" if m.topic == settings.odometry_topic else "cameras.transports"
            raise ValueError(f"{key}: {m.topic} carries {m.msgtype} in {bag}, the node would subscribe {expected[m.topic]}")
        yield m.log_time_ns, m.topic, m.msg


class InputFeed:
    """The node's input path for one bag: decode, fit and buffer exactly as the callbacks do."""

    def __init__(self, settings: DriveSettings) -> None:
        self.settings = settings
        self.sync: FrameSync[np.ndarray] = FrameSync(settings.frame_sync)
        self.odometry = OdometryBuffer(settings.ego_history)
        self._cameras = {c.topic: c for c in settings.cameras}
        self.dropped: Counter = Counter()

    def add(self, topic: str, msg: Any) -> None:
        if topic == self.settings.odometry_topic:
            self.odometry.add(*odometry_pose(msg))
            return
        camera = self._cameras[topic]
        decode = raw_image_to_rgb if camera.transport == "raw" else compressed_image_to_rgb
        try:
            image = fit_image(decode(msg), self.settings.image_size)
        except ImageRejected as exc:
            self.dropped[exc.reason] += 1
            return
        self.sync.add(camera.index, stamp_to_ns(msg.header.stamp), image)

    def build(self, now_ns: int | None, t0_ns: int | None = None) -> Assembly | Rejection:
        return build_driving_input(self.sync, self.odometry, now_ns=now_ns, t0_ns=t0_ns)


def evaluate_bag(bag: str | Path, planner: Planner, settings: DriveSettings, *, max_ticks: int | None = None,
                 t0s_ns: Sequence[int] | None = None, progress: bool = False) -> BagResult:
    """Step one bag at settings' planning rate and score every plan (see module docstring).

    t0s_ns: plan exactly at these times instead (e.g. the t0s the node planned for online):
        messages logged up to t0 plus the frame-matching slack are fed, and t0 is forced.
    """
    bag = Path(bag)
    track = OdometryTrack.from_bag(bag, settings.odometry_topic)
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
    result = BagResult(bag=bag, start_ns=start_ns)
    for tick in tqdm(ticks, desc=bag.name, unit="tick", disable=not progress):
        while pending is not None and pending[0] <= tick + slack_ns:  # everything that had arrived
            feed.add(pending[1], pending[2])
            pending = next(messages, None)
        forced_t0 = None if t0s_ns is None else tick
        result.ticks.append(_tick(tick, feed, track, planner, settings, forced_t0))
    result.dropped_images = dict(feed.dropped)
    return result


def _tick(tick: int, feed: InputFeed, track: OdometryTrack, planner: Planner, settings: DriveSettings,
          forced_t0: int | None) -> TickResult:
    built = feed.build(None if forced_t0 is not None else tick, forced_t0)
    if isinstance(built, Rejection):
        return TickResult(tick, skip_reason=built.reason.value, skip_detail=built.detail)
    t0 = built.driving_input.t0_ns
    future = track.future(built, settings.ego_history.max_gap_ns)
    if isinstance(future, str):
        detail = {FUTURE_UNAVAILABLE: "recorded odometry ends before t0 + 6.4 s",
                  FUTURE_GAP: "recorded odometry has a gap inside t0 .. t0 + 6.4 s"}[future]
        return TickResult(tick, t0, skip_reason=future, skip_detail=detail)
    try:
        plan = planner.plan(built.driving_input, settings.sampling)
    except Exception as exc:  # a failing plan is a result to report, as the node reports it
        logger.exception("planner failed at t0 %d", t0)
        return TickResult(tick, t0, skip_reason=PLAN_FAILED, skip_detail=f"{type(exc).__name__}: {exc}")
    return TickResult(tick, t0, score=score_plan(plan.xyz, future), plan=plan, true_xyz=future, assembly=built)


def _camera_arg(text: str) -> CameraProjection:
    parts = [float(x) for x in text.split(",")]
    if len(parts) not in (6, 10):
        raise argparse.ArgumentTypeError("expected fx,fy,cx,cy,width,height[,x_m,y_m,z_m,yaw_rad]")
    return CameraProjection(parts[0], parts[1], parts[2], parts[3], int(parts[4]), int(parts[5]), *parts[6:])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="alpamayo-eval", description=__doc__.splitlines()[0])
    parser.add_argument("bags", nargs="+", type=Path, help="rosbag2 directories (sqlite3 or MCAP)")
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (not needed with --plans-topic)")
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
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    if args.checkpoint is None and args.plans_topic is None:
        parser.error("--checkpoint is required (or score recorded plans with --plans-topic)")
    overrides = {
        "model.checkpoint_path": str(args.checkpoint or "none (recorded plans)"), "model.backend": args.backend,
        "model.device": args.device, "planning.rate_hz": args.rate, "cameras.topics": args.camera_topics,
        "cameras.indices": args.camera_indices, "odometry.topic": args.odometry_topic,
        "sampling.num_samples": args.num_samples, "sampling.max_reasoning_tokens": args.max_reasoning_tokens,
        "cameras.transports": args.camera_transports or (["compressed"] * len(args.camera_topics) if args.camera_topics else None),
    }
    try:
        settings = drive_settings(args.params_file, overrides, check_paths=args.checkpoint is not None)
    except ParameterError as exc:
        parser.error(str(exc))
    meta: dict[str, Any] = {"checkpoint": str(args.checkpoint) if args.checkpoint else None, "backend": settings.backend}
    results: list[BagResult] = []
    differences: dict[int, float] = {}
    planner: Planner | None = None
    for bag in args.bags:
        if args.plans_topic:
            recorded = RecordedPlans(bag, args.plans_topic, settings.ego_frame_id)
            results.append(evaluate_bag(bag, recorded, settings, t0s_ns=recorded.t0s_ns, max_ticks=args.max_ticks,
                                        progress=not args.no_progress))
            meta["backend"] = f"recorded plans on {args.plans_topic}"
            continue
        if planner is None:
            planner = load_pipeline(settings)
        online = RecordedPlans(bag, args.t0s_from, settings.ego_frame_id) if args.t0s_from else None
        results.append(evaluate_bag(bag, planner, settings, t0s_ns=online.t0s_ns if online else None,
                                    max_ticks=args.max_ticks, progress=not args.no_progress))
        if online is not None:
            differences.update(plan_differences(results[-1], online))
    if args.t0s_from:
        meta["replan_max_difference_m"] = max(differences.values()) if differences else None
        meta["replan_compared"] = len(differences)
    doc = write_report(args.out, results, settings, ReportOptions(camera=args.front_camera), meta)
    s = doc["summary"]
    logger.info("minADE %.3f m (mean over %d plans), minFDE %.3f m, %.0f%% of %d ticks skipped %s; report in %s",
                s["min_ade_mean"], s["count"], s["min_fde_mean"], 100 * doc["skipped_share"], doc["ticks_total"],
                doc["skipped"], args.out)


def load_pipeline(settings: DriveSettings) -> Planner:
    """The model pipeline of the node's settings (torch is imported only here)."""
    from alpamayo_ros.core.pipeline import Pipeline

    return Pipeline.from_checkpoint(settings.checkpoint_path, backend=settings.backend, device=settings.device,
                                    dtype=settings.dtype, backend_options=settings.backend_options)


if __name__ == "__main__":
    main()
