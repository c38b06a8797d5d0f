"""InferenceWorker's state machine (alpamayo_ros/drive/worker.py) on the real planner and tiny checkpoint:
the states it passes, a failed load, a worker that dies inside error reporting (must read as
failed, never ready), and a cooperative stop in the middle of a long warm-up plan."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

import numpy as np

from alpamayo_ros.core.types import SamplingSettings
from alpamayo_ros.drive.planner import make_planner
from alpamayo_ros.drive.worker import InferenceWorker, WorkerState
from alpamayo_ros.settings import SPECS, parse_settings

HANG_GUARD_S = 300.0


def settings(checkpoint: Path):
    values = {name: spec.default for name, spec in SPECS.items()}
    values.update({"model.checkpoint_path": str(checkpoint), "cameras.topics": ["/a"], "cameras.indices": [1],
                   "cameras.transports": ["raw"]})  # fmt: skip
    return parse_settings(values, check_paths=False)


class Recorder:
    """The worker's callbacks, recording what it reported."""

    def __init__(self, fail_reporting: bool = False) -> None:
        self.states: list[WorkerState] = []
        self.errors: list[Exception] = []
        self.done = threading.Event()
        self.fail_reporting = fail_reporting

    def on_state(self, state: WorkerState, detail: str) -> None:
        self.states.append(state)

    def run_job(self, planner, job) -> None:
        planner.plan(*job)
        self.done.set()

    def on_job_error(self, job, exc: Exception) -> None:
        self.errors.append(exc)
        if self.fail_reporting:
            raise RuntimeError("diagnostics publisher is gone")

    def worker(self, checkpoint: Path, warm_up) -> InferenceWorker:
        return InferenceWorker(
            partial(make_planner, settings(checkpoint)), warm_up, run_job=self.run_job,
            on_job_error=self.on_job_error, on_idle=lambda: None, on_state=self.on_state,
        )  # fmt: skip


def wait_for(predicate, timeout_s: float = HANG_GUARD_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.02)
    return predicate()


SHORT = SamplingSettings(max_reasoning_tokens=4, flow_steps=2)


def test_states_then_a_job_then_stop(tiny_checkpoint: Path, make_driving_input) -> None:
    recorder = Recorder()
    worker = recorder.worker(tiny_checkpoint, (make_driving_input(height=48, width=64), SHORT))
    worker.start()
    assert wait_for(lambda: worker.state is WorkerState.READY)
    worker.submit((make_driving_input(height=48, width=64, seed=1), SHORT))
    assert recorder.done.wait(HANG_GUARD_S)
    assert worker.stop(timeout_s=HANG_GUARD_S) and worker.state is WorkerState.STOPPED
    assert recorder.states == [WorkerState.LOADING, WorkerState.WARMING_UP, WorkerState.READY]
    assert worker.load_ms > 0 and worker.warmup_ms > 0


def test_failed_load_is_failed_with_the_parameters_to_check(tmp_path: Path, make_driving_input) -> None:
    (tmp_path / "config.json").write_text("{not json")
    recorder = Recorder()
    worker = recorder.worker(tmp_path, (make_driving_input(height=48, width=64), SHORT))
    worker.start()
    assert wait_for(lambda: worker.state is WorkerState.FAILED)
    assert worker.error.startswith("model load failed") and "model.checkpoint_path" in worker.error
    assert recorder.states == [WorkerState.LOADING, WorkerState.FAILED]


def test_a_worker_that_dies_inside_error_reporting_reads_as_failed(tiny_checkpoint: Path, make_driving_input) -> None:
    recorder = Recorder(fail_reporting=True)
    worker = recorder.worker(tiny_checkpoint, (make_driving_input(height=48, width=64), SHORT))
    worker.start()
    assert wait_for(lambda: worker.state is WorkerState.READY)
    bad = make_driving_input(height=2, width=402)  # the vision tower refuses this aspect ratio
    worker.submit((bad, SHORT))
    assert wait_for(lambda: worker.state is not WorkerState.READY)
    assert len(recorder.errors) == 1
    assert worker.state is WorkerState.FAILED and worker.error.startswith("inference worker died: RuntimeError")


def test_stop_cancels_a_long_warm_up_plan(tiny_checkpoint: Path, make_driving_input) -> None:
    recorder = Recorder()
    long_plan = SamplingSettings(max_reasoning_tokens=4096, min_reasoning_tokens=4096, temperature=1.0)
    worker = recorder.worker(tiny_checkpoint, (make_driving_input(height=48, width=64), long_plan))
    worker.start()
    assert wait_for(lambda: worker.state is WorkerState.WARMING_UP)
    time.sleep(1.0)  # past the prefill, into the decode loop
    assert worker.stop(timeout_s=HANG_GUARD_S)
    assert worker.state is WorkerState.STOPPED and WorkerState.READY not in recorder.states
    assert np.isnan(worker.warmup_ms)  # cancelled: 4096 forced tokens never completed
