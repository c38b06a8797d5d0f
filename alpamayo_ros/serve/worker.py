"""The one thread that runs the Pipeline, fed by a bounded queue.

The pipeline is not thread-safe and a GPU serves one plan at a time best, so every request
becomes a job for this thread; the event loop only waits on an asyncio future. A full queue is
refused at once (the caller answers 503), so the backlog, and the wait, stay bounded.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The pipeline's queue is full; the request was not taken."""


class PipelineWorker:
    """Runs load() once, then jobs in arrival order on one thread.

    load: builds the pipeline (and warms it up); its return value is passed to every job.
    queue_size: jobs waiting (the running one not counted) before submit refuses.
    """

    def __init__(self, load: Callable[[], Any], queue_size: int) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size: must be >= 1, got {queue_size}")
        self._load = load
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self._in_flight = 0  # queued + running, for the queue-depth gauge
        self._lock = threading.Lock()
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.pipeline: Any = None
        self._thread = threading.Thread(target=self._run, name="pipeline", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the jobs already queued, then end the thread (and close the pipeline)."""
        if not self._thread.is_alive():
            return
        try:
            self._jobs.put(None, timeout=timeout_s)
        except queue.Full:
            logger.warning("pipeline thread still busy after %.0f s; not waiting for it", timeout_s)
            return
        self._thread.join(timeout_s)

    @property
    def depth(self) -> int:
        with self._lock:
            return self._in_flight

    def submit(self, job: Callable[[Any], Any]) -> asyncio.Future:
        """Queue job(pipeline); the returned future (of the running loop) gets its result or error."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            try:
                self._jobs.put_nowait((job, future, loop))
            except queue.Full:
                raise QueueFull(f"{self._jobs.maxsize} requests already waiting") from None
            self._in_flight += 1
        return future

    def _run(self) -> None:
        try:
            self.pipeline = self._load()
        except BaseException as error:  # noqa: BLE001 - reported through /health, the server stays up
            logger.exception("pipeline failed to load")
            self.failed = error
            return
        self.ready.set()
        while (item := self._jobs.get()) is not None:
            job, future, loop = item
            try:
                result, error = job(self.pipeline), None
            except Exception as failure:  # noqa: BLE001 - handed to the request that asked
                result, error = None, failure
            with self._lock:
                self._in_flight -= 1
            loop.call_soon_threadsafe(_settle, future, result, error)
        close = getattr(self.pipeline, "close", None)
        if close is not None:
            close()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
