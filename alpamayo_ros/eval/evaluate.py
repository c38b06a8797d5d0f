"""The bag evaluator's library: offline, deterministic open-loop evaluation of rosbags (cli.py is `alpamayo-eval`).

The bag is stepped at the planning rate on its own log time, as the drive node would see it
replayed with /clock: every message logged up to a tick is fed to the node's own drive loop
(drive/loop.py: the same parameters, decoding, sensor checks, frame selection, ego history,
route check, scheduler and output gate), then its plan is compared with the ego future
recorded in the bag's odometry (6.4 s, in the t0 ego frame). Skipped ticks are counted by
reason, never silently dropped.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import yaml
from tqdm import tqdm

from alpamayo_ros.core.types import DrivingInput, Plan
from alpamayo_ros.drive import messages
from alpamayo_ros.drive.loop import MODEL_ERROR, DriveLoop, Skipped, skipped
from alpamayo_ros.drive.planner import Planner, make_planner
from alpamayo_ros.eval.bags import COMPRESSED_IMAGE, IMAGE, ODOMETRY, STRING, bag_time_range, bag_topics, read_messages
from alpamayo_ros.eval.ground_truth import FUTURE_DETAILS, OdometryTrack
from alpamayo_ros.eval.metrics import PlanScore, score_plan
from alpamayo_ros.settings import SPECS, DriveSettings, parse_settings

logger = logging.getLogger(__name__)

NS_PER_S = 1_000_000_000


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
                   coc=self.plan.coc, reasoning_closed=self.plan.reasoning_closed, timings_ms=self.plan.timings_ms,
                   drafted_tokens=self.plan.drafted_tokens, accepted_tokens=self.plan.accepted_tokens)
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


class BagFeed:
    """A bag's messages into a drive loop, as the node's callbacks give them to its own loop: each
    message at its log time (the node's clock under /clock replay), in log order."""

    def __init__(self, loop: DriveLoop) -> None:
        settings = loop.settings
        self.loop = loop
        self._cameras = {c.topic: c.index for c in settings.cameras}
        self._odometry_topic, self._navigation_topic = settings.odometry_topic, settings.navigation_topic

    def add(self, log_ns: int, topic: str, msg: Any) -> None:
        if topic == self._odometry_topic:
            self.loop.on_odometry(messages.odometry(msg), log_ns)
        elif topic == self._navigation_topic:
            refused = self.loop.on_route(messages.Route(msg.data), log_ns)
            if refused is not None:
                logger.warning("navigation.topic: route refused at log time %d (%s); planning goes on without it",
                               log_ns, refused)
        else:
            self.loop.on_camera(messages.camera_frame(self._cameras[topic], msg), log_ns)


def evaluate_bag(bag: str | Path, planner: Planner, settings: DriveSettings, *, max_ticks: int | None = None,
                 t0s_ns: Sequence[int] | None = None, ticks_ns: Sequence[int] | None = None, progress: bool = False,
                 on_tick: Callable[[int, int], None] | None = None) -> BagResult:
    """Step one bag at settings' planning rate and score every plan (see module docstring).

    t0s_ns: plan exactly at these times instead (e.g. the t0s the node planned for online):
        messages logged up to t0 plus the frame-matching slack are fed, and t0 is forced.
    ticks_ns: tick at these log times instead of the planning rate's (the ticks a node made online).
    on_tick: called with (ticks done, ticks in this bag) after every tick (a worker's progress).
    """
    bag = Path(bag)
    track = OdometryTrack.from_bag(bag, settings.odometry_topic)
    if track.jumps:
        logger.warning("%s: odometry stamps jump back %d time(s); ground truth is taken within one timeline",
                       bag, track.jumps)
    start_ns, end_ns = bag_time_range(bag)
    slack_ns = 0
    if t0s_ns is not None:
        ticks = sorted(int(t) for t in t0s_ns)
        sync = settings.frame_sync
        slack_ns = sync.max_skew_ns + sync.max_frame_error_ns + settings.ego_history.max_stale_ns
    elif ticks_ns is not None:
        ticks = [int(t) for t in ticks_ns]
    else:
        period_ns = int(round(settings.planning_period_s * NS_PER_S))
        ticks = [start_ns + (k + 1) * period_ns for k in range((end_ns - start_ns) // period_ns)]
    if max_ticks is not None:
        ticks = ticks[:max_ticks]
    loop = DriveLoop(settings, planner)
    loop.ready(start_ns)
    feed = BagFeed(loop)
    messages_in_bag = _bag_messages(bag, settings)
    pending = next(messages_in_bag, None)
    result = BagResult(bag=bag, start_ns=start_ns, timeline_jumps=track.jumps)
    for tick in tqdm(ticks, desc=bag.name, unit="tick", disable=not progress):
        while pending is not None and pending[0] <= tick + slack_ns:  # everything that had arrived
            feed.add(*pending)
            pending = next(messages_in_bag, None)
        forced_t0 = None if t0s_ns is None else tick
        result.ticks.append(_tick(tick, loop, track, settings, forced_t0))
        if on_tick is not None:
            on_tick(len(result.ticks), len(ticks))
    dropped = loop.counters.dropped
    result.dropped_images = {r: n for r, n in dropped.items() if not r.startswith(("route", "odometry"))}
    result.refused_routes = {r: n for r, n in dropped.items() if r.startswith("route")}
    return result


def _tick(tick: int, loop: DriveLoop, track: OdometryTrack, settings: DriveSettings, forced_t0: int | None) -> TickResult:
    """The loop's tick, with the ground truth checked before the planner runs: a tick whose
    recorded future is missing is skipped for that reason (there is nothing to score it by)."""
    started = loop.tick(tick, forced_t0)
    if started.request is None:
        skip = skipped(tick, started)
        return TickResult(tick, skip_reason=skip.reason, skip_detail=skip.detail)
    try:
        built = started.request.assembly
        t0 = built.driving_input.t0_ns
        future = track.future(built, tick, settings.ego_history.max_gap_ns)
        if isinstance(future, str):
            return TickResult(tick, t0, skip_reason=future, skip_detail=FUTURE_DETAILS[future])
        try:
            outcome = loop.run(started.request)
        except Exception as exc:  # a failing plan is a result to report, as the node reports it
            logger.exception("planner failed at t0 %d", t0)
            loop.count_error()
            return TickResult(tick, t0, skip_reason=MODEL_ERROR, skip_detail=f"{type(exc).__name__}: {exc}")
    finally:
        loop.idle(tick)
    if isinstance(outcome, Skipped):
        return TickResult(tick, t0, skip_reason=outcome.reason, skip_detail=outcome.detail)
    return TickResult(tick, t0, score=score_plan(outcome.plan.xyz, future), plan=outcome.plan, true_xyz=future,
                      inputs=built.driving_input)


def load_pipeline(settings: DriveSettings) -> Planner:
    """The node's planner for these settings (the model loads here; torch is imported only here)."""
    return make_planner(settings)
