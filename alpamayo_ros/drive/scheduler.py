"""Planning scheduler: which input to plan, and when, with exact counters. ROS-free.

The drive node hands it every decoded sensor message and every planning tick, with the node
clock's time; it answers with a request for the inference worker, a problem to report, or
nothing. It never reads a clock and starts no threads; the caller serialises the calls (the
node holds one lock), so each rule is unit-tested by feeding stamps, without timing.

Counter contract: each tick has exactly one outcome, so at any reading
    ticks == not_ready + overruns + rejected + repeated_t0 + started
(`tick_outcomes` holds the five). Plans started by a frame set (planning.trigger = frames)
are counted in `frame_starts`, never as ticks.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from alpamayo_ros.core.frame_key import KeyedFrame
from alpamayo_ros.inputs import RejectReason, Rejection
from alpamayo_ros.inputs.builder import Assembly, build_driving_input
from alpamayo_ros.inputs.ego_history import OdometryBuffer
from alpamayo_ros.inputs.frame_sync import FrameSync
from alpamayo_ros.inputs.route import RouteRejected, check_route
from alpamayo_ros.settings import DriveSettings

NS_PER_S = 1_000_000_000


class TickOutcome(str, Enum):
    """What one planning tick did (diagnostic keys `ticks.<value>`)."""

    NOT_READY = "not_ready"  # the worker is loading, warming up or failed
    OVERRUN = "overrun"  # the worker was busy with an earlier plan
    REJECTED = "rejected"  # the inputs could not be assembled (see the problem)
    REPEATED = "repeated_t0"  # no newer frames than the last plan
    STARTED = "started"  # a request went to the worker


@dataclass(frozen=True)
class Problem:
    """Why no plan was made: a stable reason key and a detail that names the input at fault."""

    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


@dataclass(frozen=True)
class Dropped(Problem):
    """A camera message refused on arrival (counted in dropped.<reason>); planning waits for a good one."""


@dataclass(frozen=True)
class PlanRequest:
    """One accepted input, with what the publisher needs to label its outputs."""

    assembly: Assembly
    frame_id: str  # the odometry frame the input's ego pose is in (output.frame odom)
    route_text: str
    assemble_ms: float  # building the DrivingInput (frame selection, ego history, image stacking)
    last_arrival_ns: int  # node clock when the newest frame used reached its callback
    tick_ns: int  # node clock of the tick (or frame set) that started it


@dataclass(frozen=True)
class TickResult:
    outcome: TickOutcome
    request: PlanRequest | None = None
    problem: Problem | None = None


@dataclass
class Counters:
    """What the scheduler counted since start (read under the caller's lock)."""

    tick_outcomes: Counter = field(default_factory=Counter)  # TickOutcome -> ticks
    frame_starts: int = 0  # plans started by a complete frame set (trigger frames)
    rejected: Counter = field(default_factory=Counter)  # reason -> planning attempts refused
    dropped: Counter = field(default_factory=Counter)  # reason -> sensor and route messages refused
    frames: int = 0

    @property
    def ticks(self) -> int:
        return sum(self.tick_outcomes.values())

    @property
    def started(self) -> int:
        return self.tick_outcomes[TickOutcome.STARTED] + self.frame_starts


class PlanScheduler:
    """Buffers inputs and decides every planning attempt; see the module docstring."""

    def __init__(self, settings: DriveSettings) -> None:
        self.settings = settings
        self.counters = Counters()
        self.frame_sync: FrameSync[KeyedFrame] = FrameSync(settings.frame_sync)
        self.odometry = OdometryBuffer(settings.ego_history)
        self.ready = False  # the worker can take requests
        self.busy = False  # a request is in the worker
        self.route_problem: Problem | None = None  # the latest route message was refused
        self._topics = {camera.index: camera.topic for camera in settings.cameras}
        self._camera_problems: dict[int, Problem] = {}  # camera -> its newest message's fault
        self._odometry_problem: Problem | None = None
        self._frame_id = ""
        self._route: tuple[str, int] | None = None  # (text, node clock ns at arrival)
        self._last_tick_ns: int | None = None
        self._last_planned_t0_ns = -1
        self._last_tried_t0_ns = -1  # frames trigger: each complete frame set gets one attempt
        self._arrived_ns: dict[int, int] = {}  # node clock at each camera's newest frame
        self._idle_since_ns = 0  # node clock when the worker last became free

    # -- worker state --

    def worker_ready(self, now_ns: int) -> None:
        self.ready = True
        self._idle_since_ns = now_ns

    def worker_idle(self, now_ns: int) -> None:
        """The request in the worker ended (published, gated or failed)."""
        self.busy = False
        self._idle_since_ns = now_ns

    # -- sensors --

    def camera_fault(self, camera: int, reason: str, detail: str) -> Dropped:
        """A camera's newest message could not be used; planning waits for a good one."""
        dropped = Dropped(reason, f"camera {camera} ({self._topics[camera]}): {detail}")
        self._camera_problems[camera] = dropped
        self.counters.dropped[reason] += 1
        return dropped

    def add_frame(self, camera: int, stamp_ns: int, frame: KeyedFrame, now_ns: int) -> PlanRequest | Problem | None:
        """Buffer a decoded frame; with trigger frames, a fresh complete set starts a plan (or a
        Problem says why not). A frame stamped ahead of the clock is refused: Dropped."""
        ahead_ns = stamp_ns - now_ns
        if ahead_ns > self.settings.max_future_ns:
            detail = f"stamp {_s(ahead_ns)} ahead of the node clock (max {_s(self.settings.max_future_ns)})"
            return self.camera_fault(camera, RejectReason.CAMERA_FUTURE.value, detail)
        self._camera_problems.pop(camera, None)
        self.frame_sync.add(camera, stamp_ns, frame)
        self.counters.frames += 1
        self._arrived_ns[camera] = now_ns
        if self.settings.planning_trigger != "frames":
            return None
        t0_ns = self._fresh_set_t0()
        if t0_ns is None:
            return None
        self._last_tried_t0_ns = t0_ns
        outcome = self._start(now_ns)
        if isinstance(outcome, PlanRequest):
            self.counters.frame_starts += 1
        elif outcome is not None:
            self.counters.rejected[outcome.reason] += 1
        return outcome

    def add_odometry(
        self, stamp_ns: int, xyz: np.ndarray, quat: np.ndarray, frame_id: str, now_ns: int
    ) -> Problem | None:
        """Buffer an odometry pose; a sample ahead of the clock or in a new frame is reported."""
        ahead_ns = stamp_ns - now_ns
        if ahead_ns > self.settings.max_future_ns:
            detail = (
                f"odometry ({self.settings.odometry_topic}) stamp {_s(ahead_ns)} ahead of the node clock "
                f"(max {_s(self.settings.max_future_ns)})"
            )
            problem = Problem(RejectReason.ODOMETRY_FUTURE.value, detail)
            new = self._odometry_problem is None
            self._odometry_problem = problem
            self.counters.dropped[problem.reason] += 1
            return problem if new else None
        self._odometry_problem = None
        changed = None
        if self._frame_id and frame_id != self._frame_id:
            detail = f"odometry frame changed from '{self._frame_id}' to '{frame_id}'"
            self.odometry.reset(detail, RejectReason.ODOMETRY_FRAME_CHANGED)
            changed = Problem(RejectReason.ODOMETRY_FRAME_CHANGED.value, f"{detail}; history cleared")
        self._frame_id = frame_id
        self.odometry.add(stamp_ns, xyz, quat)
        return changed

    def set_route(self, text: str, now_ns: int) -> Problem | None:
        """Take a route message; a refused one is forgotten (planning goes on without a route)."""
        try:
            route = check_route(text, self.settings.navigation_max_chars)
        except RouteRejected as refused:
            self._route = None
            self.route_problem = Problem(refused.reason, f"route ({self.settings.navigation_topic}): {refused.detail}")
            self.counters.dropped[refused.reason] += 1
            return self.route_problem
        self._route = None if route is None else (route, now_ns)
        self.route_problem = None
        return None

    # -- ticks --

    def tick(self, now_ns: int, t0_ns: int | None = None) -> TickResult:
        """planning.trigger timer: one planning attempt.

        t0_ns: plan exactly this t0 (offline re-planning at the t0s a node planned); camera
        staleness is then not checked, since frames are selected around a given time.
        """
        self._check_clock(now_ns)
        if not self.ready:
            return self._count(TickResult(TickOutcome.NOT_READY))
        if self.busy:
            return self._count(TickResult(TickOutcome.OVERRUN))
        outcome = self._start(now_ns, t0_ns)
        if isinstance(outcome, PlanRequest):
            return self._count(TickResult(TickOutcome.STARTED, request=outcome))
        if outcome is None:
            return self._count(TickResult(TickOutcome.REPEATED))
        self.counters.rejected[outcome.reason] += 1
        return self._count(TickResult(TickOutcome.REJECTED, problem=outcome))

    def watchdog(self, now_ns: int) -> Problem | None:
        """planning.trigger frames: report missing, stale or faulty input (frame selection only)."""
        self._check_clock(now_ns)
        if not self.ready or self.busy:
            return None
        problem = self._sensor_problem()
        if problem is None:
            frames = self.frame_sync.select(now_ns=now_ns)
            if isinstance(frames, Rejection):
                problem = self._rejected(frames)
        if problem is not None:
            self.counters.rejected[problem.reason] += 1
        return problem

    # -- internals (all under the caller's lock) --

    def _count(self, result: TickResult) -> TickResult:
        self.counters.tick_outcomes[result.outcome] += 1
        return result

    def _start(self, now_ns: int, t0_ns: int | None = None) -> PlanRequest | Problem | None:
        """Assemble the newest input and mark the worker busy; None when its t0 was planned."""
        problem = self._sensor_problem()
        if problem is not None:
            return problem
        route_text = None
        if self._route is not None:
            text, arrived_ns = self._route
            max_age_ns = self.settings.navigation_max_age_ns
            route_text = text if max_age_ns == 0 or now_ns - arrived_ns <= max_age_ns else None
        started = time.perf_counter()
        assembled = build_driving_input(self.frame_sync, self.odometry, now_ns=now_ns if t0_ns is None else None,
                                        t0_ns=t0_ns, route_text=route_text)
        assemble_ms = (time.perf_counter() - started) * 1e3
        if isinstance(assembled, Rejection):
            return self._rejected(assembled)
        if assembled.driving_input.t0_ns <= self._last_planned_t0_ns:
            return None
        self._last_planned_t0_ns = assembled.driving_input.t0_ns
        self.busy = True
        return PlanRequest(
            assembly=assembled,
            frame_id=self._frame_id,
            route_text=route_text or "",
            assemble_ms=assemble_ms,
            last_arrival_ns=max(self._arrived_ns.values(), default=now_ns),
            tick_ns=now_ns,
        )

    def _sensor_problem(self) -> Problem | None:
        """The first camera whose newest message was bad, else a future odometry stamp."""
        for camera in self.frame_sync.config.camera_indices:
            if camera in self._camera_problems:
                return self._camera_problems[camera]
        return self._odometry_problem

    def _rejected(self, rejection: Rejection) -> Problem:
        if rejection.reason is RejectReason.TIME_BACKWARDS:
            self._forget_t0s()  # the new timeline's t0s are all smaller
        return Problem(rejection.reason.value, rejection.detail)

    def _fresh_set_t0(self) -> int | None:
        """The t0 of a frame set to plan now: every camera's newest frame arrived after the
        worker became free (a set completed during the last plan waits for its successor
        instead of going out stale), and that t0 was not tried yet. t0 is the lagging camera's
        newest stamp, as FrameSync.select picks it."""
        if self.busy or not self.ready:
            return None
        if any(self._arrived_ns.get(c, -1) < self._idle_since_ns for c in self.frame_sync.config.camera_indices):
            return None
        newest = self.frame_sync.newest_stamps().values()
        if None in newest:
            return None
        t0_ns = min(newest)
        return t0_ns if t0_ns > self._last_tried_t0_ns else None

    def _check_clock(self, now_ns: int) -> None:
        """A node clock that went back (a looping bag under use_sim_time) clears all input."""
        if self._last_tick_ns is not None and now_ns < self._last_tick_ns:
            detail = f"node clock went back {(self._last_tick_ns - now_ns) / NS_PER_S:.3f} s"
            self.frame_sync.reset(detail)
            self.odometry.reset(detail)
            self._forget_t0s()
        self._last_tick_ns = now_ns

    def _forget_t0s(self) -> None:
        """After time went back: the new timeline's times are all smaller than the ones seen."""
        self._last_planned_t0_ns = self._last_tried_t0_ns = -1
        self._idle_since_ns = 0
        self._arrived_ns.clear()


def _s(ns: int) -> str:
    return f"{ns / NS_PER_S:.3f} s"
