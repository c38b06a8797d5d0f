"""The inference worker: one thread that loads the planner, warms it up and runs one job at a time.

Its state machine is explicit and readable from any thread:

    loading -> warming_up -> ready -> stopping -> stopped
       |            |          |
       +------------+----------+--> failed   (load or warm-up failed, or the thread died)

A thread that ends for any reason other than stop() reads as failed, so diagnostics can never
say "ready" for a dead worker. Stopping is cooperative: stop() sets the flag and cancels the
planner, whose plan in flight ends at its next decode or flow step (PlanCancelled). Loading a
model cannot be interrupted; stop() then returns False and the caller decides (the node exits
without waiting for it). Once stopping, the worker calls none of the callbacks (the node behind
them is going away; a late failure goes to the log). ROS-free: the node passes callbacks.
"""

from __future__ import annotations

import logging
import threading
import time
from enum import Enum
from typing import Any, Callable

from alpamayo_ros.core.types import DrivingInput, PlanCancelled, SamplingSettings
from alpamayo_ros.drive.planner import Planner

logger = logging.getLogger(__name__)


class WorkerState(str, Enum):
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


LOAD_HINT = "check model.checkpoint_path, model.backend, model.device, model.dtype"


class InferenceWorker:
    """Runs jobs on a planner in its own thread; see the module docstring.

    make_planner: loads the model (runs in the worker thread).
    warm_up: the input and sampling settings of the warm-up plan.
    run_job(planner, job): plans and publishes one job; PlanCancelled ends the worker.
    on_job_error(job, exc): reports a job that raised; if it raises itself, the worker dies (failed).
    on_idle(): after every job, whatever its outcome.
    on_state(state, detail): every state change, from the thread that made it.
    """

    def __init__(
        self,
        make_planner: Callable[[], Planner],
        warm_up: tuple[DrivingInput, SamplingSettings],
        *,
        run_job: Callable[[Planner, Any], None],
        on_job_error: Callable[[Any, Exception], None],
        on_idle: Callable[[], None],
        on_state: Callable[[WorkerState, str], None],
    ) -> None:
        self._make_planner = make_planner
        self._warm_up = warm_up
        self._run_job = run_job
        self._on_job_error = on_job_error
        self._on_idle = on_idle
        self._on_state = on_state
        self._cond = threading.Condition()
        self._state = WorkerState.LOADING
        self._error = ""
        self._job: Any = None
        self._planner: Planner | None = None
        self._stopping = False
        self._release = True
        self.load_ms = float("nan")
        self.warmup_ms = float("nan")
        self._thread = threading.Thread(target=self._main, name="alpamayo_inference", daemon=True)

    @property
    def state(self) -> WorkerState:
        """The current state; a thread that ended without stop() is failed."""
        with self._cond:
            state = self._state
        if state in (WorkerState.LOADING, WorkerState.WARMING_UP, WorkerState.READY) and self._thread.ident:
            if not self._thread.is_alive():
                return WorkerState.FAILED
        return state

    @property
    def error(self) -> str:
        with self._cond:
            return self._error or ("inference worker thread ended" if self.state is WorkerState.FAILED else "")

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Any) -> None:
        """Hand over a job (the scheduler guarantees one at a time)."""
        with self._cond:
            self._job = job
            self._cond.notify()

    def stop(self, timeout_s: float, *, release: bool = True) -> bool:
        """Stop after the current decode or flow step; True when the thread has ended.

        release=False leaves the planner unclosed, for a process about to end whose planner holds
        nothing the exit does not free: vLLM's in-process teardown collects the whole heap while
        holding the interpreter lock, seconds in which the exiting thread cannot run.
        """
        with self._cond:
            self._stopping = True
            self._release = release
            if self._state is not WorkerState.FAILED:
                self._state = WorkerState.STOPPING
            planner = self._planner
            self._cond.notify()
        if planner is not None:
            planner.cancel()
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    # -- the thread --

    def _set(self, state: WorkerState, detail: str = "") -> None:
        with self._cond:
            if self._stopping and state is not WorkerState.FAILED:
                return
            self._state = state
            if state is WorkerState.FAILED:
                self._error = detail
            stopping = self._stopping
        if stopping:
            logger.warning(f"while stopping: {detail}")
            return
        self._on_state(state, detail)

    def _main(self) -> None:
        try:
            self._serve()
        except PlanCancelled:
            pass  # stop() during warm-up or a plan
        except BaseException as exc:  # noqa: BLE001 - a dead worker must read as failed, with why
            self._set(WorkerState.FAILED, f"inference worker died: {type(exc).__name__}: {exc}")
        finally:
            self._close_planner()
            with self._cond:
                if self._state is not WorkerState.FAILED:
                    self._state = WorkerState.STOPPED

    def _serve(self) -> None:
        self._set(WorkerState.LOADING, "loading model")
        started = time.perf_counter()
        try:
            planner = self._make_planner()
        except Exception as exc:  # noqa: BLE001 - reported as the failed state
            self._set(WorkerState.FAILED, f"model load failed: {type(exc).__name__}: {exc} ({LOAD_HINT})")
            return
        self.load_ms = (time.perf_counter() - started) * 1e3
        with self._cond:
            self._planner = planner
            if self._stopping:
                return
        self._set(WorkerState.WARMING_UP, f"model loaded in {self.load_ms / 1e3:.1f} s; warming up (1/1)")
        started = time.perf_counter()
        try:
            planner.warm_up(*self._warm_up)
        except PlanCancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as the failed state
            self._set(WorkerState.FAILED, f"warm-up plan failed: {type(exc).__name__}: {exc} ({LOAD_HINT})")
            return
        self.warmup_ms = (time.perf_counter() - started) * 1e3
        total_s = self.load_ms / 1e3 + self.warmup_ms / 1e3
        self._set(WorkerState.READY, f"warm-up plan took {self.warmup_ms / 1e3:.1f} s; ready in {total_s:.1f} s")
        while True:
            with self._cond:
                while self._job is None and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job, self._job = self._job, None
            try:
                self._run_job(planner, job)
            except PlanCancelled:
                raise
            except Exception as exc:  # noqa: BLE001 - one failed plan; the worker keeps serving
                self._on_job_error(job, exc)
            finally:
                self._on_idle()

    def _close_planner(self) -> None:
        with self._cond:
            planner, self._planner = self._planner, None
            release = self._release
        if planner is None or not release:
            return
        try:
            planner.close()  # in the thread that used the engine (vLLM releases GPU memory there)
        except Exception as exc:  # noqa: BLE001 - closing at exit must not mask why we exit
            logger.warning(f"closing the planner failed: {exc!r}")
