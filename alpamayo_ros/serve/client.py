"""RemotePlanner: Pipeline.plan's call shape over alpamayo-serve's binary endpoint, without ROS.

    planner = RemotePlanner("http://gpu-host:8000", timeout_s=2.0, api_key=key)
    plan = planner.plan(inputs, settings)   # -> Plan, or raises a RemoteError

Frames are resized here, the way the pipeline resizes them (core.frame_cache on the CPU, with a
cache so a streamed window resizes only its new frames), and travel as raw uint8: a fraction of
the bytes and none of the JPEG loss. The geometry comes from the server (GET /v1/plan/info).

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
    """The server answered with an error status; status and the server's message are kept, and
    for a busy server (503) the seconds it asked the caller to wait (Retry-After)."""

    reason = "remote_rejected"

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


class RemotePlanner:
    """Plans on an alpamayo-serve server. Thread-safe; one HTTP connection pool.

    timeout_s: the longest one plan() may take (connect + send + plan + answer).
    backoff_s / max_backoff_s: wait after a failed connection before trying again.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        api_key: str | None = None,
        backoff_s: float = 0.25,
        max_backoff_s: float = 2.0,
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
        self.backend = "remote"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout_s))

    def close(self) -> None:
        self._http.close()

    def plan(self, inputs: DrivingInput, settings: SamplingSettings = SamplingSettings()) -> Plan:
        """Plan remotely; the returned Plan's timings gain remote.* stages (encode, roundtrip)."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            self._check_backoff()
            started = time.perf_counter()
            frames = self._resized(inputs, deadline)
            body = wire.encode_request(frames, settings)
            encoded = time.perf_counter()
            response = self._request("POST", "/v1/plan", deadline, content=body,
                                     headers={"content-type": wire.CONTENT_TYPE})
            plan = wire.decode_reply(response.content)
        plan.timings_ms["remote.encode"] = (encoded - started) * 1e3
        plan.timings_ms["remote.roundtrip"] = (time.perf_counter() - encoded) * 1e3
        return plan

    # -- internals -----------------------------------------------------------------------

    def _resized(self, inputs: DrivingInput, deadline: float) -> DrivingInput:
        """inputs with every frame resized for the server's vision tower (cached per frame key)."""
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
        )

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
                                 float(retry_after) if retry_after.isdigit() else None)
        self._backoff_s = self._backoff_initial_s
        self._retry_at = 0.0
        return response

    def _fail_connection(self) -> None:
        """Back off, and forget the geometry: the server that returns may serve another model."""
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
        self._frames = None


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
