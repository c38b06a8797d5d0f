"""The drive loop: plain timestamped messages and ticks in, one outcome per tick out. ROS-free.

One object holds everything a planning decision depends on: decoding and fitting camera
images, frame selection, ego history, the route check, the scheduler with its counters, the
planner port and the output gate. The node feeds it from its callbacks and runs its requests in
the inference worker thread (`run`); the bag evaluator and other synchronous drivers call
`step`. Feeding two front doors the same messages at the same clock therefore gives the same
decisions: same t0s, same skip reasons, same plans.

Thread safety: every method takes the loop's lock (re-entrant: a caller can hold it across
calls, and must while it reads `counters` or `scheduler`); `run` holds it only around the
counters, not while the planner plans.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np

from alpamayo_ros.core.frame_key import keyed_frame
from alpamayo_ros.core.types import Plan, SamplingSettings
from alpamayo_ros.drive.gate import gate_plan
from alpamayo_ros.drive.messages import CameraFrame, CompressedImage, Image, Odometry, RawImage, Route
from alpamayo_ros.drive.planner import Planner, PlanUnavailable
from alpamayo_ros.drive.scheduler import Counters, Dropped, PlanRequest, PlanScheduler, Problem, TickOutcome, TickResult
from alpamayo_ros.inputs.messages import ImageRejected, compressed_image_to_rgb, fit_image, raw_image_to_rgb
from alpamayo_ros.settings import DriveSettings

logger = logging.getLogger(__name__)

MODEL_ERROR = "model_error"  # the planner raised: counted in rejected.model_error


@dataclass(frozen=True)
class Planned:
    """A tick whose plan passed the gate: the plan and the request it was made from."""

    request: PlanRequest
    plan: Plan

    @property
    def tick_ns(self) -> int:
        return self.request.tick_ns

    @property
    def t0_ns(self) -> int:
        return self.request.assembly.driving_input.t0_ns


@dataclass(frozen=True)
class Skipped:
    """A tick without a plan: one reason key (the node's diagnostic keys) and a detail naming the input."""

    tick_ns: int
    t0_ns: int | None  # known once an input was assembled (a gated plan, an unavailable server)
    reason: str
    detail: str


Outcome = Planned | Skipped


def decode_image(image: Image, size: tuple[int, int] | None) -> np.ndarray:
    """H x W x 3 uint8 RGB at size (width, height; None keeps it), an array of its own (a decoded
    array is copied unless fitting made a new one); ImageRejected names the fault."""
    if isinstance(image, RawImage):
        return fit_image(raw_image_to_rgb(image), size)
    if isinstance(image, CompressedImage):
        return fit_image(compressed_image_to_rgb(image), size)
    fitted = fit_image(image, size)
    return fitted.copy() if fitted is image else fitted  # the caller may go on writing to its array


class DriveLoop:
    """See the module docstring. planner: what `step` plans with (`run` may be handed another)."""

    def __init__(self, settings: DriveSettings, planner: Planner | None = None) -> None:
        self.settings = settings
        self.planner = planner
        self.lock = threading.RLock()
        self.scheduler = PlanScheduler(settings)
        self.received: Counter = Counter()  # "camera.<index>" | "odometry" | "route" -> messages taken
        self._topics = {camera.index: camera.topic for camera in settings.cameras}

    @property
    def counters(self) -> Counters:
        return self.scheduler.counters

    # -- the planner's availability --

    def ready(self, now_ns: int) -> None:
        """The planner can take requests (loaded and warmed up); ticks before read not_ready."""
        with self.lock:
            self.scheduler.worker_ready(now_ns)

    def idle(self, now_ns: int) -> None:
        """The request handed out last has ended (planned, skipped or failed)."""
        with self.lock:
            self.scheduler.worker_idle(now_ns)

    # -- messages --

    def on_camera(self, frame: CameraFrame, now_ns: int) -> Dropped | Problem | PlanRequest | None:
        """Decode, fit, key (frame_key, read-only from now on) and buffer one camera message. Dropped: refused (it is kept from planning
        until a good one follows); with planning.trigger frames, a fresh complete set returns the
        request it started, or the Problem that kept it from starting."""
        with self.lock:
            self.received[f"camera.{frame.camera}"] += 1
            if frame.camera not in self._topics:
                raise ValueError(f"camera: {frame.camera} is not one of cameras.indices {sorted(self._topics)}")
            try:
                rgb = decode_image(frame.image, self.settings.image_size)
            except ImageRejected as refused:
                return self.scheduler.camera_fault(frame.camera, refused.reason, refused.detail)
            # keyed once, here: every plan this frame is part of reuses the key instead of hashing it
            keyed = keyed_frame(frame.camera, frame.stamp_ns, rgb)
            return self.scheduler.add_frame(frame.camera, frame.stamp_ns, keyed, now_ns)

    def on_odometry(self, odometry: Odometry, now_ns: int) -> Problem | None:
        """Buffer one pose; a Problem when it is refused (ahead of the clock) or its frame_id changed
        (the ego history is cleared and rebuilt in the new frame)."""
        with self.lock:
            self.received["odometry"] += 1
            return self.scheduler.add_odometry(odometry.stamp_ns, odometry.xyz, odometry.quat_xyzw,
                                               odometry.frame_id, now_ns)  # fmt: skip

    def on_route(self, route: Route, now_ns: int) -> Problem | None:
        """Take a route; a refused one (too long, model tokens) is forgotten and named."""
        with self.lock:
            self.received["route"] += 1
            return self.scheduler.set_route(route.text, now_ns)

    # -- ticks --

    def tick(self, now_ns: int, t0_ns: int | None = None) -> TickResult:
        """One planning attempt (planning.trigger timer): a request to run, or why not.
        t0_ns forces the plan time (offline re-planning at a node's t0s)."""
        with self.lock:
            return self.scheduler.tick(now_ns, t0_ns)

    def watchdog(self, now_ns: int) -> Problem | None:
        """planning.trigger frames: the input fault a tick would report, if any."""
        with self.lock:
            return self.scheduler.watchdog(now_ns)

    def run(self, request: PlanRequest, *, planner: Planner | None = None, sampling: SamplingSettings | None = None,
            max_lateral_accel_mps2: float | None = None) -> Outcome:  # fmt: skip
        """Plan one request and gate the plan. A refused plan or an unavailable server is Skipped
        (and counted); another planner error propagates (the caller counts it: count_error).

        planner, sampling, max_lateral_accel_mps2: default to the loop's planner and settings
        (the node passes the worker's planner and the values current when the tick started).
        """
        planner = planner or self.planner
        if planner is None:
            raise ValueError("planner: the loop was made without one and run() was given none")
        sampling = sampling or self.settings.sampling
        limit = self.settings.max_lateral_accel_mps2 if max_lateral_accel_mps2 is None else max_lateral_accel_mps2
        driving_input = request.assembly.driving_input
        try:
            plan = planner.plan(driving_input, sampling)
            refused = gate_plan(plan, limit)
        except PlanUnavailable as exc:  # the server's fault, not the input's or the model's: no plan, go on
            refused = (exc.reason, exc.detail)
        if refused is None:
            return Planned(request, plan)
        with self.lock:
            self.counters.rejected[refused[0]] += 1
        return Skipped(request.tick_ns, driving_input.t0_ns, *refused)

    def count_error(self) -> None:
        """A planner error run() let through (rejected.model_error)."""
        with self.lock:
            self.counters.rejected[MODEL_ERROR] += 1

    def step(self, now_ns: int, t0_ns: int | None = None) -> Outcome:
        """tick + run, synchronously: what the evaluator and simulator drivers call each period.
        A planner error is a Skipped model_error here (logged), not an exception."""
        if self.planner is None:
            raise ValueError("planner: step() plans with the loop's planner, and the loop was made without one")
        result = self.tick(now_ns, t0_ns)
        if result.request is None:
            return skipped(now_ns, result)
        try:
            return self.run(result.request)
        except Exception as exc:  # noqa: BLE001 - one failed plan is this tick's outcome, as in the node
            logger.exception("planner failed at t0 %d", result.request.assembly.driving_input.t0_ns)
            self.count_error()
            return Skipped(now_ns, result.request.assembly.driving_input.t0_ns, MODEL_ERROR,
                           f"{type(exc).__name__}: {exc}")  # fmt: skip
        finally:
            self.idle(now_ns)


def skipped(now_ns: int, result: TickResult) -> Skipped:
    """The Skipped of a tick that started nothing (reason: the problem's, else the tick outcome's)."""
    if result.problem is not None:
        return Skipped(now_ns, None, result.problem.reason, result.problem.detail)
    details = {TickOutcome.NOT_READY: "the planner is not ready", TickOutcome.OVERRUN: "the planner was busy",
               TickOutcome.REPEATED: "no newer frames than the last plan"}  # fmt: skip
    return Skipped(now_ns, None, result.outcome.value, details.get(result.outcome, ""))
