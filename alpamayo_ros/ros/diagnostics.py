"""The drive node's diagnostics: what its plans did, and the one DiagnosticStatus that reports it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

from alpamayo_ros.drive.scheduler import PlanScheduler, TickOutcome
from alpamayo_ros.drive.worker import WorkerState
from alpamayo_ros.settings import DriveSettings

NS_PER_MS = 1_000_000


@dataclass
class Outcomes:
    """What the node's plans did (guarded by DriveNode._lock)."""

    plans: int = 0  # published
    errors: int = 0
    outcome: str = "none"  # none | planned | rejected | error
    last_rejection: str = ""
    last_error: str = ""
    gated: dict[str, int] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)
    input_age_ms: float = math.nan
    latency_ms: float = math.nan
    skew_ms: float = math.nan
    last_plan_ns: int | None = None  # node clock at the last published plan (or at ready)


def planner_status(
    name: str,
    settings: DriveSettings,
    now_ns: int,
    *,
    state: WorkerState,
    worker_error: str,
    load_ms: float,
    warmup_ms: float,
    outcomes: Outcomes,
    scheduler: PlanScheduler,
    publishers: str,
) -> DiagnosticStatus:
    """The node's one status; the caller holds the lock that guards outcomes and scheduler.

    publishers: each input subscription's matched publisher count ("camera 1 (/topic) 1, ...").
    Never OK while no plan comes out: a failed worker is ERROR, a stall (no plan for
    diagnostics.max_plan_silence_s once ready) outranks the last rejection, and a refused route is
    WARN while planning goes on without it.
    """
    counters = scheduler.counters
    silence_ns = None if outcomes.last_plan_ns is None else now_ns - outcomes.last_plan_ns
    stalled = state is WorkerState.READY and silence_ns is not None and silence_ns > settings.max_plan_silence_ns
    if state is WorkerState.FAILED:
        level, message = DiagnosticStatus.ERROR, worker_error
    elif state is not WorkerState.READY:
        level, message = DiagnosticStatus.WARN, f"{state.value.replace('_', ' ')}: not ready"
    elif outcomes.outcome == "error":
        level, message = DiagnosticStatus.ERROR, outcomes.last_error
    elif stalled:  # before the last rejection: a plan in flight for ages is no better
        last = f"; last rejection {outcomes.last_rejection}" if outcomes.outcome == "rejected" else ""
        level, message = DiagnosticStatus.WARN, (
            f"planning_stalled: no plan published for {silence_ns / 1e9:.1f} s "
            f"(max {settings.max_plan_silence_ns / 1e9:.1f} s, diagnostics.max_plan_silence_s){last}"
        )
    elif outcomes.outcome == "rejected":
        level, message = DiagnosticStatus.WARN, f"no plan: {outcomes.last_rejection}"
    elif scheduler.route_problem is not None:
        level, message = DiagnosticStatus.WARN, f"planning without route: {scheduler.route_problem}"
    elif outcomes.outcome == "planned":
        level, message = DiagnosticStatus.OK, "planning"
    else:
        level, message = DiagnosticStatus.OK, "ready, waiting for inputs"
    frames_dropped = sum(n for reason, n in counters.dropped.items() if not reason.startswith(("route", "odometry")))
    values: dict[str, Any] = {
        "state": state.value,
        "ready": state is WorkerState.READY,
        "backend": settings.backend,
        "model_id": settings.model_id,
        "load_ms": load_ms,
        "warmup_ms": warmup_ms,
        "ticks": counters.ticks,
        **{f"ticks.{outcome.value}": counters.tick_outcomes[outcome] for outcome in TickOutcome},
        "overruns": counters.tick_outcomes[TickOutcome.OVERRUN],
        "repeated_t0": counters.tick_outcomes[TickOutcome.REPEATED],
        "plans_started": counters.started,
        "frame_starts": counters.frame_starts,
        "plans": outcomes.plans,
        "frames": counters.frames,
        "errors": outcomes.errors,
        "drop_ratio": frames_dropped / max(counters.frames + frames_dropped, 1),
        "input_age_ms": outcomes.input_age_ms,
        "latency_ms": outcomes.latency_ms,
        "camera_skew_ms": outcomes.skew_ms,
        "since_plan_s": math.nan if silence_ns is None else silence_ns / 1e9,
        "last_rejection": outcomes.last_rejection,
        "last_error": outcomes.last_error or worker_error,
        "route_rejection": "" if scheduler.route_problem is None else str(scheduler.route_problem),
        "matched_publishers": publishers,
    }
    for camera, newest in scheduler.frame_sync.newest_stamps().items():
        values[f"camera_age_ms.{camera}"] = math.nan if newest is None else (now_ns - newest) / NS_PER_MS
    odometry_newest = scheduler.odometry.newest_ns
    values["odometry_age_ms"] = math.nan if odometry_newest is None else (now_ns - odometry_newest) / NS_PER_MS
    values.update({f"rejected.{reason}": count for reason, count in sorted(counters.rejected.items())})
    values.update({f"dropped.{reason}": count for reason, count in sorted(counters.dropped.items())})
    values.update({f"stage_ms.{stage}": ms for stage, ms in outcomes.timings_ms.items()})
    return DiagnosticStatus(
        level=level,
        name=name,
        message=message,
        hardware_id=settings.model_id,
        values=[KeyValue(key=key, value=_format(value)) for key, value in values.items()],
    )


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.1f}"
    return str(value)
