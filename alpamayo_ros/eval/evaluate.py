"""The bag evaluator's library: offline, deterministic open-loop evaluation of rosbags (cli.py is `alpamayo-eval`).

The bag is stepped at the planning rate on its own log time, as the drive node would see it
replayed with /clock: every message logged up to a tick is fed to the node's input code
(parameters, frame sync, ego history and builder are the node's own modules), then the
planner runs and its plan is compared with the ego future recorded in the bag's odometry
(6.4 s, in the t0 ego frame). Skipped ticks are counted by reason, never silently dropped.
"""

from __future__ import annotations

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


def load_pipeline(settings: DriveSettings) -> Planner:
    """The model pipeline of the node's settings (torch is imported only here)."""
    from alpamayo_ros.core.pipeline import Pipeline

    return Pipeline.from_checkpoint(settings.checkpoint_path, backend=settings.backend, device=settings.device,
                                    dtype=settings.dtype, backend_options=settings.backend_options)
