"""RemotePlanner: Pipeline.plan's call shape over alpamayo-serve's binary endpoint, without ROS.

    planner = RemotePlanner("http://gpu-host:8000", timeout_s=2.0, api_key=key)
    plan = planner.plan(inputs, settings)   # -> Plan, or raises a RemoteError

Frames are resized here, the way the pipeline resizes them (core.frame_cache on the CPU, with a
cache so a streamed window resizes only its new frames), and travel as raw uint8: a fraction of
the bytes and none of the JPEG loss. The geometry comes from the server (GET /v1/plan/info).
With delta (the default) only the frames the server does not hold yet travel: a streamed W16
window sends its 4 new frames and refers to the 12 it sent before. The planner remembers which
frame (by its full key, content fingerprint included) it last sent under each (camera, stamp,
size), and refers only to exactly that one; when the server no longer holds a referenced frame
(restarted, evicted) it answers 409 and the planner sends the whole window once more.

Failures are three exceptions with a stable `reason` a caller can report as is:
remote_unavailable (nothing answers, or the server is still loading), remote_timeout (no answer
within timeout_s), remote_rejected (a 4xx/5xx; the server's message is kept). Nothing blocks for
longer than timeout_s: construction does not touch the network, and after a failed connection
the next calls fail fast (RemoteUnavailable) until a backoff delay has passed, doubling up to
max_backoff_s, so a caller ticking at 10 Hz does not hammer a dead server.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict

import httpx
import torch

from ..core.frame_cache import FrameCache, frame_key
from ..core.preprocess import VisionGeometry
from ..core.types import DrivingInput, Plan, SamplingSettings
from . import wire

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
    delta: send only the frames the server lacks (False: every frame of every window).
    last_request_bytes: the body size of the last plan request sent.
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
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._backoff_initial_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._backoff_s = backoff_s
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._frames: FrameCache | None = None
        self.delta = delta
        self._session = uuid.uuid4().hex
        self._held: OrderedDict[tuple[int, int, int, int], str] = OrderedDict()  # (camera, stamp, h, w) -> frame key
        self.last_request_bytes = 0
        self.backend = "remote"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout_s))

    def close(self) -> None:
        self._http.close()

    def plan(self, inputs: DrivingInput, settings: SamplingSettings = SamplingSettings()) -> Plan:
        """Plan remotely; the returned Plan's timings gain remote.* stages (resize, encode,
        roundtrip: the exchange(s), a resend after a 409 included)."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            self._check_backoff()
            started = time.perf_counter()
            frames, keys = self._resized(inputs, deadline)
            resized = time.perf_counter()
            if not self.delta:
                body = wire.encode_request(frames, settings)
                encoded = time.perf_counter()
                response = self._post_plan(body, deadline)
            else:
                size = frames.images.shape[2:4]
                held_as = [(camera, int(stamp), *size) for camera, stamps in zip(frames.camera_indices, frames.frame_stamps_ns)
                           for stamp in stamps]
                missing = [slot for slot, (held, key) in enumerate(zip(held_as, keys)) if self._held.get(held) != key]
                body = self._delta_body(frames, settings, held_as, missing)
                encoded = time.perf_counter()
                try:
                    response = self._post_plan(body, deadline)
                except RemoteRejected as rejected:
                    if rejected.code != "frames_missing":
                        raise
                    logger.info("%s: %s; sending the whole window", self.url, rejected.message)
                    self._held.clear()
                    response = self._post_plan(self._delta_body(frames, settings, held_as, list(range(len(keys)))),
                                               deadline)
                self._remember(held_as, keys)
            plan = wire.decode_reply(response.content)
        plan.timings_ms["remote.resize"] = (resized - started) * 1e3
        plan.timings_ms["remote.encode"] = (encoded - resized) * 1e3
        plan.timings_ms["remote.roundtrip"] = (time.perf_counter() - encoded) * 1e3
        return plan

    # -- internals -----------------------------------------------------------------------

    def _delta_body(self, frames: DrivingInput, settings: SamplingSettings,
                    held_as: list[tuple[int, int, int, int]], slots: list[int]) -> bytes:
        """A delta request sending the frames of slots. What they replace is forgotten first: if
        this request fails after the server stored them, no later request may refer to the old."""
        for slot in slots:
            self._held.pop(held_as[slot], None)
        return wire.encode_request(frames, settings, session=self._session, sent_slots=slots)

    def _post_plan(self, body: bytes, deadline: float) -> httpx.Response:
        self.last_request_bytes = len(body)
        return self._request("POST", "/v1/plan", deadline, content=body, headers={"content-type": wire.CONTENT_TYPE})

    def _remember(self, held_as: list[tuple[int, int, int, int]], keys: list[str]) -> None:
        """The server now holds keys' frames under held_as (the last FRAME_CACHE of them are kept)."""
        for held, key in zip(held_as, keys):
            self._held[held] = key
            self._held.move_to_end(held)
        while len(self._held) > FRAME_CACHE:
            self._held.popitem(last=False)

    def _resized(self, inputs: DrivingInput, deadline: float) -> tuple[DrivingInput, list[str]]:
        """inputs with every frame resized for the server's vision tower (cached per frame key),
        and the frames' keys (camera-major)."""
        if self._frames is None:
            info = self._request("GET", "/v1/plan/info", deadline).json()
            self._frames = FrameCache(VisionGeometry(**info["vision"]), compute_device=torch.device("cpu"),
                                      store_device=torch.device("cpu"), capacity=FRAME_CACHE)
            self.backend = f"remote:{info['backend']}"
        cameras, count = inputs.images.shape[:2]
        keys = [
            frame_key(camera, int(stamp), image)
            for camera, stamps, row in zip(inputs.camera_indices, inputs.frame_stamps_ns, inputs.images)
            for stamp, image in zip(stamps, row)
        ]
        flat = inputs.images.reshape(cameras * count, *inputs.images.shape[2:])
        resized = self._frames.preprocess(flat, keys).frames  # (N, 3, h, w)
        images = resized.permute(0, 2, 3, 1).reshape(cameras, count, *resized.shape[2:], 3).numpy()
        return DrivingInput(
            images=images,
            camera_indices=inputs.camera_indices,
            frame_stamps_ns=inputs.frame_stamps_ns,
            t0_ns=inputs.t0_ns,
            ego_history_xyz=inputs.ego_history_xyz,
            ego_history_rot=inputs.ego_history_rot,
            route_text=inputs.route_text,
        ), keys

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
        self._frames = None
        self._held.clear()


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
