"""What an evaluation run scores: rosbags and PhysicalAI-AV clips as jobs, run here or in a Ray worker.

A job is one bag, or one dataset clip converted to a temporary bag where it runs (a Ray worker
converts its own clips, so the driver never copies video). Every input is checked before any
model loads, and a job that fails is a result (its error goes into the report), not a crash
that loses the bags already scored.
"""

from __future__ import annotations

import logging
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from alpamayo_ros.core.types import CAMERAS
from alpamayo_ros.drive.planner import Planner
from alpamayo_ros.eval.evaluate import BagResult, check_bag, evaluate_bag
from alpamayo_ros.eval.recorded_plans import RecordedPlans, plan_differences
from alpamayo_ros.eval.physical_ai_av import ClipFiles, convert_clip
from alpamayo_ros.settings import DriveSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalJob:
    """One bag (bag set) or one PhysicalAI-AV clip (clip and pai_root set); name labels it in the report."""

    name: str
    bag: Path | None = None
    clip: str | None = None
    pai_root: Path | None = None


@dataclass(frozen=True)
class JobOptions:
    """How every job is scored (the evaluator's command-line choices)."""

    max_ticks: int | None = None
    plans_topic: str | None = None  # score the plans recorded on this topic (no model)
    t0s_from: str | None = None  # re-plan at the t0s of the plans recorded on this topic
    progress: bool = False  # a per-bag tick bar (single process only)

    @property
    def needs_model(self) -> bool:
        return self.plans_topic is None


@dataclass
class JobOutcome:
    """A scored job: its result, how far re-plans differ from recorded plans, and its wall time."""

    result: BagResult
    replan_differences: dict[int, float] = field(default_factory=dict)
    wall_s: float = 0.0


@dataclass(frozen=True)
class JobFailure:
    """A job that produced no result: the error of its last attempt."""

    name: str
    error: str
    attempts: int = 1

    def to_json(self) -> dict[str, object]:
        return {"bag": self.name, "error": self.error, "attempts": self.attempts}


def make_jobs(bags: Sequence[Path], clips_file: Path | None, pai_root: Path | None) -> list[EvalJob]:
    """Jobs for the command line, every path checked now (ValueError naming the first bad one)."""
    jobs = [EvalJob(name=str(bag), bag=check_bag(bag)) for bag in bags]
    if clips_file is None:
        if pai_root is not None:
            raise ValueError("--pai-root: given without --clips")
        return jobs
    if pai_root is None:
        raise ValueError("--clips: needs --pai-root (the local PhysicalAI-AV copy)")
    try:
        lines = clips_file.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--clips {clips_file}: {exc.strerror or exc}") from None
    clips = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not clips:
        raise ValueError(f"--clips {clips_file}: no clip ids (one per line)")
    for clip in clips:
        ClipFiles(pai_root, clip)  # raises naming the root or a clip the index does not have
        jobs.append(EvalJob(name=clip, clip=clip, pai_root=pai_root))
    return jobs


@contextmanager
def job_bag(job: EvalJob, settings: DriveSettings) -> Iterator[Path]:
    """The job's bag directory; a clip is converted (the settings' cameras, on their topics) into a
    temporary bag removed afterwards."""
    if job.bag is not None:
        yield job.bag
        return
    topics = {CAMERAS[c.index][0]: c.topic for c in settings.cameras}
    with tempfile.TemporaryDirectory(prefix="alpamayo-pai-") as tmp:
        bag = Path(tmp) / job.name
        convert_clip(job.pai_root, job.clip, bag, cameras=list(topics), odom_topic=settings.odometry_topic,
                     camera_topics=topics)
        yield bag


def run_job(job: EvalJob, planner: Planner | None, settings: DriveSettings, options: JobOptions,
            on_tick: Callable[[int, int], None] | None = None) -> JobOutcome:
    """Score one job (planner None only when options.plans_topic scores recorded plans)."""
    started = time.monotonic()
    with job_bag(job, settings) as bag:
        kwargs = dict(max_ticks=options.max_ticks, progress=options.progress, on_tick=on_tick)
        if options.plans_topic:
            recorded = RecordedPlans(bag, options.plans_topic, settings.ego_frame_id)
            result, differences = evaluate_bag(bag, recorded, settings, t0s_ns=recorded.t0s_ns, **kwargs), {}
        else:
            if planner is None:
                raise ValueError("planner: a model is needed unless --plans-topic scores recorded plans")
            online = RecordedPlans(bag, options.t0s_from, settings.ego_frame_id) if options.t0s_from else None
            result = evaluate_bag(bag, planner, settings, t0s_ns=online.t0s_ns if online else None, **kwargs)
            differences = plan_differences(result, online) if online else {}
    return JobOutcome(replace(result, bag=Path(job.name)), differences, time.monotonic() - started)


@dataclass
class RunSummary:
    """Everything a run produced: outcomes in job order (None: failed or not reached), failures,
    whether Ctrl-C stopped it, and on Ray the per-worker throughput and worker deaths retried."""

    outcomes: list[JobOutcome | None]
    failures: list[JobFailure] = field(default_factory=list)
    interrupted: bool = False
    workers: list[dict[str, object]] = field(default_factory=list)
    retries: int = 0

    def unfinished(self, jobs: Sequence[EvalJob]) -> list[str]:
        failed = {f.name for f in self.failures}
        return [j.name for j, o in zip(jobs, self.outcomes) if o is None and j.name not in failed]


def run_here(jobs: Sequence[EvalJob], settings: DriveSettings, options: JobOptions,
             load_planner: Callable[[DriveSettings], Planner]) -> RunSummary:
    """Run every job in this process, in order; the model loads once, on the first job that needs it.

    Ctrl-C stops the run and keeps the finished jobs.
    """
    summary = RunSummary(outcomes=[None] * len(jobs))
    planner = None
    try:
        for k, job in enumerate(jobs):
            if planner is None and options.needs_model:
                planner = load_planner(settings)
            try:
                summary.outcomes[k] = run_job(job, planner, settings, options)
            except Exception as exc:  # one bad bag must not lose the others: it is reported
                logger.error("%s: %s: %s", job.name, type(exc).__name__, exc)
                summary.failures.append(JobFailure(job.name, f"{type(exc).__name__}: {exc}"))
    except KeyboardInterrupt:
        logger.warning("interrupted: keeping the %d finished bag(s)", sum(o is not None for o in summary.outcomes))
        summary.interrupted = True
    return summary
