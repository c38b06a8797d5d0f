"""Fleet evaluation on Ray: workers that each load the model once and score whole bags from a queue.

The driver (`alpamayo-eval --ray`) starts N actors, hands each idle one the next job and merges
the results in job order, so the report is the one the single process writes. A worker that
dies under a job (crash, OOM kill, lost node) is replaced and the job goes to another worker, at
most max_attempts times; an error the job raises itself (a corrupt bag) is not retried, since it
fails the same way everywhere. Ctrl-C kills the workers and keeps what finished.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from tqdm import tqdm

from alpamayo_ros.eval.evaluate import load_pipeline
from alpamayo_ros.eval.jobs import EvalJob, JobFailure, JobOptions, JobOutcome, RunSummary, run_job
from alpamayo_ros.settings import parse_settings

logger = logging.getLogger(__name__)

LOCAL_OBJECT_STORE_BYTES = 128 * 1024**2  # results carry only each input's newest frames
POLL_S = 0.5  # driver wake-up: finished jobs are picked up at once, progress is refreshed this often


@dataclass(frozen=True)
class FleetOptions:
    """address None starts a local Ray instance for this run; "auto" or HOST:PORT joins a cluster."""

    address: str | None = None
    workers: int = 2
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    max_attempts: int = 3  # tries of one job when workers die under it
    progress: bool = True


class BagWorker:
    """A Ray actor: the node's settings and one Pipeline, loaded once, scoring the jobs it is given."""

    def __init__(self, values: dict[str, Any], options: JobOptions) -> None:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        self.settings = parse_settings(values)
        self.options = options
        self.planner = load_pipeline(self.settings) if options.needs_model else None
        self._progress: tuple[str, int, int] = ("", 0, 0)

    def info(self) -> dict[str, Any]:
        """Where this worker runs (its log is the Ray worker log of this pid on that node), and its
        torch thread count: Ray sets OMP_NUM_THREADS to the worker's CPUs unless the driver's
        environment already has it, and float sums differ with the thread count."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
                "torch_threads": torch.get_num_threads()}

    def run(self, job: EvalJob) -> JobOutcome:
        def on_tick(done: int, total: int) -> None:
            self._progress = (job.name, done, total)

        self._progress = (job.name, 0, 0)
        logger.info("%s: started", job.name)
        outcome = run_job(job, self.planner, self.settings, self.options, on_tick)
        outcome.result = outcome.result.compact()
        return outcome

    def progress(self) -> tuple[str, int, int]:
        """(job, ticks done, ticks in it); answered while run() works (the actor has two threads)."""
        return self._progress


@dataclass
class _Slot:
    """One worker position: its current actor, the job in flight and its throughput so far."""

    index: int
    actor: Any
    info_ref: Any
    pids: list[int] = field(default_factory=list)
    host: str = ""
    job: int | None = None
    ref: Any = None
    bags: int = 0
    ticks: int = 0
    plans: int = 0
    busy_s: float = 0.0
    deaths: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"worker": self.index, "host": self.host, "pids": self.pids, "bags": self.bags, "ticks": self.ticks,
                "plans": self.plans, "busy_s": round(self.busy_s, 3), "deaths": self.deaths,
                "plans_per_s": self.plans / self.busy_s if self.busy_s > 0 else None,
                # a replacement for a dead worker was started but not ready when the bags ran out
                "replacement_starting": bool(self.deaths) and self.info_ref is not None}


def run_on_ray(jobs: Sequence[EvalJob], values: dict[str, Any], options: JobOptions, fleet: FleetOptions) -> RunSummary:
    """Score jobs on fleet.workers Ray actors; values are the node parameters every worker parses."""
    if fleet.workers < 1 or fleet.max_attempts < 1:
        raise ValueError(f"--workers/--max-attempts: need at least 1, got {fleet.workers}/{fleet.max_attempts}")
    try:
        if fleet.address:
            ray.init(address=fleet.address, log_to_driver=True)
        else:  # a small private instance: only what the workers ask for, no dashboard
            ray.init(num_cpus=max(1, math.ceil(fleet.workers * fleet.cpus_per_worker)), include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=True)
    except Exception as exc:  # Ray raises bare Exception (and ConnectionError) when it cannot start or connect
        ray.shutdown()
        where = f"--ray-address {fleet.address}" if fleet.address else "a local Ray instance"
        raise RuntimeError(f"{where} did not start: {exc}") from None
    try:
        return _Driver(jobs, values, options, fleet).run()
    finally:
        ray.shutdown()


class _Driver:
    def __init__(self, jobs: Sequence[EvalJob], values: dict[str, Any], options: JobOptions, fleet: FleetOptions) -> None:
        self.jobs, self.values, self.options, self.fleet = jobs, values, options, fleet
        self.actor_class = ray.remote(BagWorker).options(
            num_cpus=fleet.cpus_per_worker, num_gpus=fleet.gpus_per_worker, max_concurrency=2, max_restarts=0)
        self.summary = RunSummary(outcomes=[None] * len(jobs))
        self.queue: deque[int] = deque(range(len(jobs)))
        self.attempts = [0] * len(jobs)
        self.died_on: dict[int, int] = {}  # job -> slot whose worker last died under it
        self.slots = [self._start(k) for k in range(fleet.workers)]
        self.bags_bar = tqdm(total=len(jobs), desc="bags", unit="bag", disable=not fleet.progress)
        self.ticks_bar = tqdm(total=0, desc="ticks", unit="tick", disable=not fleet.progress)
        self.ticks_finished = self.ticks_known = 0

    def _start(self, index: int) -> _Slot:
        actor = self.actor_class.remote(self.values, self.options)
        return _Slot(index, actor, actor.info.remote())

    def run(self) -> RunSummary:
        try:
            self._wait_ready()
            last_poll = 0.0
            while self.queue or any(s.ref is not None for s in self.slots):
                self._dispatch()
                busy = {s.ref: s for s in self.slots if s.ref is not None}
                done, _ = ray.wait(list(busy), num_returns=1, timeout=POLL_S)
                for ref in done:
                    self._finish(busy[ref])
                if time.monotonic() - last_poll > 2 * POLL_S:
                    self._show_progress()
                    last_poll = time.monotonic()
        except KeyboardInterrupt:
            logger.warning("interrupted: stopping the workers, keeping the %d finished bag(s)",
                           sum(o is not None for o in self.summary.outcomes))
            self.summary.interrupted = True
            for slot in self.slots:
                ray.kill(slot.actor)
        finally:
            self.bags_bar.close()
            self.ticks_bar.close()
        if not self.summary.interrupted:
            self._note_replacements()  # a replacement may be up without a poll since
        self.summary.workers = [s.to_json() for s in self.slots]
        return self.summary

    def _wait_ready(self) -> None:
        """Every worker has loaded its model (a worker that cannot start fails the run, with its reason)."""
        for slot in self.slots:
            try:
                self._note_info(slot, ray.get(slot.info_ref))
            except RayError as exc:
                cause = getattr(exc, "cause", None) or exc
                raise RuntimeError(f"worker {slot.index} did not start: {type(cause).__name__}: "
                                   f"{str(cause).strip().splitlines()[0] if str(cause).strip() else ''}") from None

    def _note_info(self, slot: _Slot, info: dict[str, Any]) -> None:
        slot.pids.append(info["pid"])
        slot.host = info["host"]
        slot.info_ref = None
        logger.info("worker %d ready: pid %d on %s (%s), %d torch thread(s)", slot.index, info["pid"], info["host"],
                    info["node_ip"], info["torch_threads"])

    def _dispatch(self) -> None:
        for slot in self.slots:
            if slot.ref is not None or not self.queue:
                continue
            # a job whose worker died goes to another worker when there is one
            pick = next((j for j in self.queue if self.died_on.get(j) != slot.index or len(self.slots) == 1), None)
            if pick is None:
                continue
            self.queue.remove(pick)
            self.attempts[pick] += 1
            slot.job, slot.ref = pick, slot.actor.run.remote(self.jobs[pick])
            logger.info("%s -> worker %d (pid %s), attempt %d", self.jobs[pick].name, slot.index,
                        slot.pids[-1] if slot.pids and slot.info_ref is None else "starting", self.attempts[pick])

    def _finish(self, slot: _Slot) -> None:
        job, ref = slot.job, slot.ref
        slot.job = slot.ref = None
        name = self.jobs[job].name
        try:
            outcome: JobOutcome = ray.get(ref)
        except RayActorError as exc:  # the worker died under the job: replace it, retry the job elsewhere
            slot.deaths += 1
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            logger.warning("worker %d (pid %s) died during %s: %s", slot.index, slot.pids[-1] if slot.pids else "?",
                           name, first_line)
            ray.kill(slot.actor)
            replacement = self._start(slot.index)
            slot.actor, slot.info_ref = replacement.actor, replacement.info_ref
            if self.attempts[job] < self.fleet.max_attempts:
                self.summary.retries += 1
                self.died_on[job] = slot.index
                self.queue.appendleft(job)
            else:
                self._fail(JobFailure(name, f"worker died on every attempt (last: {first_line})", self.attempts[job]))
            return
        except RayTaskError as exc:  # the job itself raised (a corrupt bag): the same everywhere, no retry
            cause = exc.cause if exc.cause is not None else exc
            self._fail(JobFailure(name, f"{type(cause).__name__}: {cause}", self.attempts[job]))
            return
        self.summary.outcomes[job] = outcome
        slot.bags += 1
        slot.ticks += len(outcome.result.ticks)
        slot.plans += len(outcome.result.scored)
        slot.busy_s += outcome.wall_s
        self.ticks_finished += len(outcome.result.ticks)
        self.bags_bar.update(1)
        logger.info("%s: %d ticks, %d plans on worker %d in %.1f s", name, len(outcome.result.ticks),
                    len(outcome.result.scored), slot.index, outcome.wall_s)

    def _fail(self, failure: JobFailure) -> None:
        logger.error("%s failed: %s", failure.name, failure.error)
        self.summary.failures.append(failure)
        self.bags_bar.update(1)

    def _note_replacements(self) -> None:
        """Record the workers that replaced dead ones and are ready now (no waiting)."""
        for slot in self.slots:
            if slot.info_ref is not None and ray.wait([slot.info_ref], timeout=0)[0]:
                try:
                    self._note_info(slot, ray.get(slot.info_ref))
                except RayError as exc:
                    logger.warning("worker %d: replacement did not start: %s", slot.index, exc)
                    slot.info_ref = None

    def _show_progress(self) -> None:
        """Tick counts of the jobs in flight (workers answer between their ticks); notes restarted workers."""
        self._note_replacements()
        busy = [s for s in self.slots if s.ref is not None and s.info_ref is None]
        try:
            states = ray.get([s.actor.progress.remote() for s in busy], timeout=5 * POLL_S)
        except (GetTimeoutError, RayError):
            return  # a worker busy dying or starting: the next poll will see it
        done = sum(d for _, d, _ in states)
        self.ticks_known = max(self.ticks_known, self.ticks_finished + sum(t for _, _, t in states))
        self.ticks_bar.total = self.ticks_known
        self.ticks_bar.n = self.ticks_finished + done
        self.ticks_bar.refresh()
