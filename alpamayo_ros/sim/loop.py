"""One drive loop per simulator session, all sessions planning on one shared model.

A session's inputs go through the node's own DriveLoop (decoding and fitting, frame selection
by time, ego history, route checks, the scheduler's counters, the output gate), so the service
assembles each tick's input exactly as the drive node and the evaluator do. What the sessions
share is the planner: SessionPlanner plans one session at a time. Two sessions of one scene
(equal stamps, near-equal frames) can share the model's frame caches safely because frame keys
hash every pixel (core/frame_cache.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from alpamayo_ros.core.types import DrivingInput, Plan, SamplingSettings
from alpamayo_ros.drive.loop import DriveLoop, Outcome
from alpamayo_ros.drive.messages import CameraFrame, Odometry
from alpamayo_ros.drive.planner import Planner
from alpamayo_ros.drive.scheduler import Problem
from alpamayo_ros.settings import DriveSettings

SEED_MODULUS = 2**63  # torch and vLLM take seeds below this


class SessionPlanner:
    """The shared planner as one session's Planner: its lock held around each plan. Warm-up and
    shutdown stay with the shared planner's owner."""

    def __init__(self, planner: Planner, lock: threading.Lock) -> None:
        self._planner = planner
        self._lock = lock

    def plan(self, driving_input: DrivingInput, sampling: SamplingSettings) -> Plan:
        with self._lock:
            return self._planner.plan(driving_input, sampling)

    def warm_up(self, driving_input: DrivingInput, sampling: SamplingSettings) -> None:
        """Nothing: the service warmed the shared planner up before the first session."""

    def cancel(self) -> None:
        """Nothing: cancelling the shared planner is the service's (shutdown)."""

    def close(self) -> None:
        """Nothing: the shared planner outlives its sessions."""


@dataclass(frozen=True)
class Step:
    """One drive(): the loop's outcome and how long the tick took (the shared model's queue included)."""

    outcome: Outcome
    seed: int
    step_ms: float


class SessionLoop:
    """A session's DriveLoop; its settings' sampling seed is the session's (every plan, as the node's
    sampling.seed). Not thread-safe across calls: the session serialises them."""

    def __init__(self, settings: DriveSettings, planner: Planner, planner_lock: threading.Lock, *, seed: int) -> None:
        self.seed = seed % SEED_MODULUS
        self.settings = replace(settings, sampling=replace(settings.sampling, seed=self.seed))
        self.loop = DriveLoop(self.settings, SessionPlanner(planner, planner_lock))
        self.loop.ready(0)

    def on_camera(self, camera: int, stamp_ns: int, rgb: np.ndarray, now_ns: int) -> None:
        self.loop.on_camera(CameraFrame(camera, stamp_ns, rgb), now_ns)

    def on_odometry(self, odometry: Odometry, now_ns: int) -> Problem | None:
        return self.loop.on_odometry(odometry, now_ns)

    def step(self, now_ns: int) -> Step:
        started = time.perf_counter()
        outcome = self.loop.step(now_ns)
        return Step(outcome, self.seed, (time.perf_counter() - started) * 1e3)
