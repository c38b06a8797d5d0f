"""One drive loop per simulator session: the node's scheduler, planner port and output gate.

This module is the one place the egodriver service touches the node's input assembly
(PlanScheduler: frame selection by time, ego history, route checks, exact counters) and its
output gate, so the service assembles each tick's input exactly as the drive node and the
evaluator do. step() is the node's planning tick followed by its worker's plan and gate, run
synchronously: a simulator waits for its answer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from alpamayo_ros.core.types import DrivingInput, Plan, PlanCancelled, SamplingSettings
from alpamayo_ros.inputs.scheduler import PlanScheduler, Problem, TickOutcome
from alpamayo_ros.ros.gate import gate_plan
from alpamayo_ros.ros.planner import Planner, PlanUnavailable
from alpamayo_ros.settings import DriveSettings

SEED_MODULUS = 2**63  # torch and vLLM take seeds below this


@dataclass(frozen=True)
class Planned:
    """A plan that passed the gate, with the input it was made from."""

    plan: Plan
    driving_input: DrivingInput
    xyz_t0: np.ndarray  # ego pose at t0 in the odometry frame
    rot_t0: np.ndarray
    frame_id: str
    seed: int
    assemble_ms: float
    plan_ms: float  # planner call, waiting for the shared model included

    @property
    def t0_ns(self) -> int:
        return self.driving_input.t0_ns


@dataclass(frozen=True)
class Skipped:
    """No plan this tick: the node's reason key (not_ready inputs, a gate refusal, a model error)."""

    reason: str
    detail: str


class ModelFailed(RuntimeError):
    """The planner raised on a valid input: a fault of the model, not of the session's input."""


class SessionLoop:
    """Inputs of one session in, one outcome per step out. Not thread-safe: the caller holds a lock.

    planner_lock: held around every plan, so sessions share one model one plan at a time.
    source: the session's name on its inputs (DrivingInput.frame_source): two sessions of one
        scene see equal stamps and near-equal frames, which must never share the model's caches.
    """

    def __init__(self, settings: DriveSettings, planner: Planner, planner_lock: threading.Lock, *, seed: int,
                 source: str) -> None:  # fmt: skip
        self.settings = settings
        self.source = source
        self._planner = planner
        self._planner_lock = planner_lock
        self._seed = seed
        self._scheduler = PlanScheduler(settings)
        self._scheduler.worker_ready(0)
        self.plans = 0

    @property
    def counters(self):  # noqa: ANN201 - the scheduler's Counters
        return self._scheduler.counters

    def on_camera(self, camera: int, stamp_ns: int, rgb: np.ndarray, now_ns: int) -> None:
        self._scheduler.add_frame(camera, stamp_ns, rgb, now_ns)

    def on_camera_fault(self, camera: int, reason: str, detail: str) -> None:
        self._scheduler.camera_fault(camera, reason, detail)

    def on_odometry(self, stamp_ns: int, xyz: np.ndarray, quat_xyzw: np.ndarray, frame_id: str, now_ns: int) -> Problem | None:
        return self._scheduler.add_odometry(stamp_ns, xyz, quat_xyzw, frame_id, now_ns)

    def on_route(self, text: str, now_ns: int) -> Problem | None:
        return self._scheduler.set_route(text, now_ns)

    def sampling(self) -> SamplingSettings:
        """This plan's settings: the session's seed advanced by one per plan (reproducible per session)."""
        return replace(self.settings.sampling, seed=(self._seed + self.plans) % SEED_MODULUS)

    def step(self, now_ns: int) -> Planned | Skipped:
        """One planning tick at now_ns, then its plan and the output gate."""
        result = self._scheduler.tick(now_ns)
        if result.outcome is not TickOutcome.STARTED:
            problem = result.problem
            if problem is None:
                return Skipped(result.outcome.value, "no frames newer than the last plan")
            return Skipped(problem.reason, problem.detail)
        request = result.request
        driving_input = replace(request.assembly.driving_input, frame_source=self.source)
        sampling = self.sampling()
        started = time.perf_counter()
        try:
            with self._planner_lock:
                plan = self._planner.plan(driving_input, sampling)
        except PlanUnavailable as error:
            self._scheduler.counters.rejected[error.reason] += 1
            return Skipped(error.reason, error.detail)
        except PlanCancelled:
            raise
        except Exception as error:
            self._scheduler.counters.rejected["model_error"] += 1
            raise ModelFailed(f"{type(error).__name__}: {error}") from error
        finally:
            self._scheduler.worker_idle(now_ns)
        plan_ms = (time.perf_counter() - started) * 1e3
        self.plans += 1
        refused = gate_plan(plan, self.settings.max_lateral_accel_mps2)
        if refused is not None:
            self._scheduler.counters.rejected[refused[0]] += 1
            return Skipped(*refused)
        ego = request.assembly.ego
        return Planned(plan=plan, driving_input=driving_input, xyz_t0=ego.xyz_t0,
                       rot_t0=ego.rot_t0, frame_id=request.frame_id, seed=sampling.seed,
                       assemble_ms=request.assemble_ms, plan_ms=plan_ms)  # fmt: skip
