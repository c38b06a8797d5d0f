"""RemotePlanner: Pipeline.plan's call shape over alpamayo-serve's binary endpoint, without ROS.

    planner = RemotePlanner("http://gpu-host:8000", timeout_s=2.0, api_key=key)
    plan = planner.plan(inputs, settings)   # -> Plan, or raises a RemoteError

Frames are resized the way the pipeline resizes them and travel as raw uint8: a fraction of the
bytes and none of the JPEG loss. The geometry comes from the server (GET /v1/plan/info).
With delta (the default) only the frames the server does not hold yet travel: a streamed W16
window sends its 4 new frames and refers to the 12 it sent before. The planner remembers which
frame (by its full key, content fingerprint included) it last sent under each (camera, stamp,
size), and refers only to exactly that one; when the server no longer holds a referenced frame
(restarted, evicted) it answers 409 and the planner sends the whole window once more.

Where the new frames are resized depends on frame_transport. Resized: here (core.frame_cache on
the CPU, cached per frame), sent in the body. Shm, for a server on this host: written at capture
size into this planner's own shared-memory segment (shm.FrameSegment, unlinked on close and at
exit) and resized by the server on its device, like in-process planning; 25 MB of full-HD frames
then cost one memcpy here instead of tens of ms of CPU resizing. Auto (the default) takes shm for
a loopback URL and falls back to resized for good if the server cannot read the segment.

Failures are three exceptions with a stable `reason` a caller can report as is:
remote_unavailable (nothing answers, or the server is still loading), remote_timeout (no answer
within timeout_s), remote_rejected (a 4xx/5xx; the server's message is kept). Nothing blocks for
longer than timeout_s: construction does not touch the network, and after a failed connection
the next calls fail fast (RemoteUnavailable) until a backoff delay has passed, doubling up to
max_backoff_s, so a caller ticking at 10 Hz does not hammer a dead server.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import httpx
import numpy as np
import torch

from ..core.frame_cache import FrameCache, frame_keys
from ..core.preprocess import VisionGeometry, smart_resize
from ..core.types import DrivingInput, Plan, SamplingSettings
from ..frame_transport import FRAME_TRANSPORTS
from . import wire
from .shm import FrameSegment, is_loopback

logger = logging.getLogger(__name__)

FRAME_CACHE = 32  # two windows of 4 cameras x 4 frames, like the pipeline's


class RemoteError(RuntimeError):
    """A plan the server did not deliver; reason is the diagnostic key."""

    reason = "remote_error"


class RemoteUnavailable(RemoteError):
    reason = "remote_unavailable"


class RemoteTimeout(RemoteError):
    reason = "remote_timeout"


class RemoteRejected(RemoteError):
    """The server answered with an error status; status, the server's message and error code are
    kept, and for a busy server (503) the seconds it asked the caller to wait (Retry-After)."""

    reason = "remote_rejected"

    def __init__(self, status: int, message: str, retry_after_s: float | None = None, code: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.code = code


class RemotePlanner:
    """Plans on an alpamayo-serve server. Thread-safe; one HTTP connection pool.

    timeout_s: the longest one plan() may take (connect + send + plan + answer).
    backoff_s / max_backoff_s: wait after a failed connection before trying again.
    delta: send only the frames the server lacks (False: every frame of every window, resized).
    frame_transport: how a delta's new frames travel: "resized" (resized here, in the body),
        "shm" (at capture size in this client's shared memory; the server resizes them on its
        device) or "auto" (shm when the URL's host is loopback, falling back to resized for good
        if the server cannot read it).
    last_request_bytes: the body size of the last plan request sent.
    last_sent_frames: the frames that request carried (inline or in shared memory).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        api_key: str | None = None,
        backoff_s: float = 0.25,
        max_backoff_s: float = 2.0,
        delta: bool = True,
        frame_transport: str = "auto",
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http://host:port, got {url!r}")
        if frame_transport not in FRAME_TRANSPORTS:
            raise ValueError(f"frame_transport: expected one of {FRAME_TRANSPORTS}, got {frame_transport!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._backoff_initial_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._backoff_s = backoff_s
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._geometry: VisionGeometry | None = None
        self._frames: FrameCache | None = None
        self.delta = delta
        self.frame_transport = frame_transport
        local = is_loopback(httpx.URL(self.url).host)
        wants_shm = frame_transport == "shm" or (frame_transport == "auto" and local)
        self._segment = FrameSegment() if delta and wants_shm else None
        self._warned_shm = False
        self._session = uuid.uuid4().hex
        self._held: OrderedDict[tuple[int, int, int, int], str] = OrderedDict()  # (camera, stamp, h, w) -> frame key
        self.last_request_bytes = 0
        self.last_sent_frames = 0
        self.backend = "remote"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout_s))

    @property
    def uses_shm(self) -> bool:
        """Whether new frames travel through shared memory (until a fallback in auto mode)."""
        return self._segment is not None

    def close(self) -> None:
        """Close the connections, then (once a plan in flight ends) unlink the shared-memory segment."""
        self._http.close()
        with self._lock:
            if self._segment is not None:
                self._segment.close()
                self._segment = None

    def plan(self, inputs: DrivingInput, settings: SamplingSettings = SamplingSettings()) -> Plan:
        """Plan remotely; the returned Plan's timings gain remote.* stages that add up to this
        call's wall time: resize (frame keys, and resizing here unless frames go by shm),
        shm_write, encode, and roundtrip (the exchanges, a resend after a 409 included)."""
        deadline = time.monotonic() + self.timeout_s
        stages = dict.fromkeys(("remote.resize", "remote.shm_write", "remote.encode"), 0.0)
        with self._lock:
            self._check_backoff()
            started = time.perf_counter()
            geometry = self._server_geometry(deadline)
            with _timed(stages, "remote.resize"):
                keys = frame_keys(inputs)
            if not self.delta:
                with _timed(stages, "remote.resize"):
                    cameras, count = inputs.images.shape[:2]
                    resized = self._resized(inputs, keys, list(range(cameras * count)))
                    frames = dataclasses.replace(inputs, images=resized.reshape(cameras, count, *resized.shape[1:]))
                with _timed(stages, "remote.encode"):
                    body = wire.encode_request(frames, settings)
                response = self._post_plan(body, len(keys), deadline)
            else:
                size = smart_resize(*inputs.images.shape[2:4], geometry)
                held_as = [(camera, int(stamp), *size) for camera, stamps in zip(inputs.camera_indices, inputs.frame_stamps_ns)
                           for stamp in stamps]
                missing = [slot for slot, (held, key) in enumerate(zip(held_as, keys)) if self._held.get(held) != key]
                delta = _Delta(inputs, keys, settings, held_as, size)
                try:
                    response = self._send(delta, missing, deadline, stages)
                except RemoteRejected as rejected:
                    if rejected.code != "frames_missing":
                        raise
                    logger.info("%s: %s; sending the whole window", self.url, rejected.message)
                    self._held.clear()
                    response = self._send(delta, list(range(len(keys))), deadline, stages)
                self._remember(held_as, keys)
            plan = wire.decode_reply(response.content)
        plan.timings_ms.update(stages)
        plan.timings_ms["remote.roundtrip"] = (time.perf_counter() - started) * 1e3 - sum(stages.values())
        return plan

    # -- internals -----------------------------------------------------------------------

    def _send(self, delta: _Delta, slots: list[int], deadline: float, stages: dict[str, float]) -> httpx.Response:
        """Post a delta request sending the frames of slots: through shared memory while that
        works, else resized. What they replace is forgotten first: if this request fails after
        the server stored them, no later request may refer to the old."""
        for slot in slots:
            self._held.pop(delta.held_as[slot], None)
        if self._segment is not None:
            try:
                return self._send_shm(delta, slots, deadline, stages)
            except OSError as failure:  # /dev/shm missing or full here (a container's 64 MB): this request resized
                if self.frame_transport == "shm":
                    raise RemoteUnavailable(f"{self.url}: shared memory for frames: {failure}") from failure
                if not self._warned_shm:
                    logger.warning("%s: shared memory for frames failed (%s); these frames go resized", self.url, failure)
                    self._warned_shm = True
            except RemoteRejected as rejected:  # the server cannot read our segments: resized for good
                if self.frame_transport == "shm" or rejected.code != "shm_unavailable":
                    raise
                logger.warning("%s: %s; sending resized frames from now on", self.url, rejected.message)
                self._segment.close()
                self._segment = None
        with _timed(stages, "remote.resize"):
            sent = self._resized(delta.inputs, delta.keys, slots)
        with _timed(stages, "remote.encode"):
            body = wire.encode_request(delta.inputs, delta.settings, session=self._session, sent_slots=slots, sent=sent)
        return self._post_plan(body, len(slots), deadline)

    def _send_shm(self, delta: _Delta, slots: list[int], deadline: float, stages: dict[str, float]) -> httpx.Response:
        flat = delta.inputs.images.reshape(-1, *delta.inputs.images.shape[2:])
        with _timed(stages, "remote.shm_write"):
            name = self._segment.write([flat[slot] for slot in slots])
        with _timed(stages, "remote.encode"):
            where = wire.ShmFrames(name=name, offset=0, dtype="uint8", shape=[len(slots), *flat.shape[1:]])
            body = wire.encode_request(delta.inputs, delta.settings, session=self._session, sent_slots=slots,
                                       shm=(where, delta.size))
        return self._post_plan(body, len(slots), deadline)

    def _post_plan(self, body: bytes, frames: int, deadline: float) -> httpx.Response:
        self.last_request_bytes, self.last_sent_frames = len(body), frames
        return self._request("POST", "/v1/plan", deadline, content=body, headers={"content-type": wire.CONTENT_TYPE})

    def _remember(self, held_as: list[tuple[int, int, int, int]], keys: list[str]) -> None:
        """The server now holds keys' frames under held_as (the last FRAME_CACHE of them are kept)."""
        for held, key in zip(held_as, keys):
            self._held[held] = key
            self._held.move_to_end(held)
        while len(self._held) > FRAME_CACHE:
            self._held.popitem(last=False)

    def _server_geometry(self, deadline: float) -> VisionGeometry:
        """The server's frame geometry (GET /v1/plan/info, once per connection)."""
        if self._geometry is None:
            info = self._request("GET", "/v1/plan/info", deadline).json()
            self._geometry = VisionGeometry(**info["vision"])
            self._frames = None
            self.backend = f"remote:{info['backend']}"
        return self._geometry

    def _resized(self, inputs: DrivingInput, keys: list[str], slots: list[int]) -> np.ndarray:
        """The frames of slots (camera-major) resized for the server's vision tower, uint8
        (n, h, w, 3) (cached per frame key); only those frames are touched."""
        if self._frames is None:
            self._frames = FrameCache(self._geometry, compute_device=torch.device("cpu"),
                                      store_device=torch.device("cpu"), capacity=FRAME_CACHE)
        flat = inputs.images.reshape(-1, *inputs.images.shape[2:])
        if not slots:
            return np.empty((0, *smart_resize(*flat.shape[1:3], self._geometry), 3), dtype=np.uint8)
        resized = self._frames.preprocess([flat[slot] for slot in slots], [keys[slot] for slot in slots]).frames
        return np.ascontiguousarray(resized.permute(0, 2, 3, 1).numpy())

    def _check_backoff(self) -> None:
        wait_s = self._retry_at - time.monotonic()
        if wait_s > 0:
            raise RemoteUnavailable(f"{self.url}: unreachable, next try in {wait_s:.2f} s")

    def _request(self, method: str, path: str, deadline: float, **kwargs) -> httpx.Response:
        """One HTTP exchange within the deadline, its failures mapped to the RemoteError taxonomy."""
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise RemoteTimeout(f"{self.url}{path}: no time left of {self.timeout_s} s")
        try:
            response = self._http.request(method, path, timeout=httpx.Timeout(left_s), **kwargs)
        except httpx.TimeoutException as error:
            raise RemoteTimeout(f"{self.url}{path}: no answer within {self.timeout_s} s ({type(error).__name__})") from error
        except httpx.TransportError as error:
            self._fail_connection()
            raise RemoteUnavailable(f"{self.url}{path}: {type(error).__name__}: {error}") from error
        if response.status_code == 503 and _code(response) == "not_ready":
            self._fail_connection()
            raise RemoteUnavailable(f"{self.url}: {_message(response)}")
        if response.status_code >= 400:
            retry_after = response.headers.get("retry-after", "")
            raise RemoteRejected(response.status_code, _message(response),
                                 float(retry_after) if retry_after.isdigit() else None, _code(response))
        self._backoff_s = self._backoff_initial_s
        self._retry_at = 0.0
        return response

    def _fail_connection(self) -> None:
        """Back off, and forget the geometry: the server that returns may serve another model."""
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
        self._geometry = None
        self._held.clear()


@dataclass(frozen=True)
class _Delta:
    """One window of a delta plan: inputs at capture size, their frame keys and settings, where
    the server holds each slot's frame (camera, stamp, h, w), and the size it resizes to."""

    inputs: DrivingInput
    keys: list[str]
    settings: SamplingSettings
    held_as: list[tuple[int, int, int, int]]
    size: tuple[int, int]


@contextmanager
def _timed(stages: dict[str, float], stage: str) -> Iterator[None]:
    """Add the block's wall time (ms) to stages[stage]."""
    started = time.perf_counter()
    try:
        yield
    finally:
        stages[stage] += (time.perf_counter() - started) * 1e3


def _code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500] or response.reason_phrase
