"""Time-based camera frame selection: the frames nearest t0 - k*spacing on every camera.

Frames are matched by capture stamp, never by arrival order, and a mismatch is reported rather
than paired silently. t0 is the oldest of the cameras' newest stamps, the latest time for which
every camera can have a frame.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from alpamayo_ros.core.types import FRAME_SPACING_S, FRAMES_PER_CAMERA
from alpamayo_ros.inputs import RejectReason, Rejection

FrameT = TypeVar("FrameT")

NS_PER_S = 1_000_000_000
MAX_FRAMES_BUFFERED = 64  # per camera; bounds memory when stamps barely advance


def _s(ns: int) -> str:
    return f"{ns / NS_PER_S:.3f} s"


@dataclass(frozen=True)
class FrameSyncConfig:
    """Which cameras to sync and how strictly.

    max_skew_ns: how much older the slowest camera's newest frame may be than the other
        cameras' previous frames (one frame of natural trailing between free-running cameras
        is always allowed on top).
    max_age_ns: newest frame of every camera must be at most this old against the caller's
        clock; 0 disables the check (offline evaluation without a clock).
    """

    camera_indices: tuple[int, ...]
    frames_per_camera: int = FRAMES_PER_CAMERA
    frame_spacing_ns: int = int(FRAME_SPACING_S * NS_PER_S)
    max_frame_error_ns: int = 50_000_000
    max_skew_ns: int = 50_000_000
    max_age_ns: int = 300_000_000

    def __post_init__(self) -> None:
        if not self.camera_indices or len(set(self.camera_indices)) != len(self.camera_indices):
            raise ValueError(f"camera_indices: need unique indices, got {self.camera_indices}")
        if self.frames_per_camera < 1:
            raise ValueError(f"frames_per_camera: must be >= 1, got {self.frames_per_camera}")
        if self.frame_spacing_ns <= 0:
            raise ValueError(f"frame_spacing_ns: must be > 0, got {self.frame_spacing_ns}")
        for name in ("max_frame_error_ns", "max_skew_ns", "max_age_ns"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

    @property
    def window_ns(self) -> int:
        """Time from the oldest target to t0."""
        return (self.frames_per_camera - 1) * self.frame_spacing_ns

    @property
    def retention_ns(self) -> int:
        """How far behind a camera's newest frame frames are kept (covers lag and matching)."""
        return self.window_ns + self.max_skew_ns + self.max_frame_error_ns + 2 * self.frame_spacing_ns


@dataclass(frozen=True)
class FrameSet(Generic[FrameT]):
    """The frames chosen for one t0.

    frames: camera-major (same order as camera_indices), oldest first within a camera.
    stamps_ns: int64 (cameras, frames) capture stamps of those frames.
    newest_ns: newest buffered stamp per camera (for input-age reporting).
    max_error_ns: largest distance of a chosen frame from its target time.
    """

    t0_ns: int
    camera_indices: tuple[int, ...]
    frames: list[list[FrameT]]
    stamps_ns: np.ndarray
    newest_ns: tuple[int, ...]
    max_error_ns: int

    @property
    def skew_ns(self) -> int:
        """Spread of the cameras' newest stamps (diagnostics; up to one frame is normal)."""
        return max(self.newest_ns) - min(self.newest_ns)


class FrameSync(Generic[FrameT]):
    """Per-camera time-indexed ring buffers plus the t0/nearest-frame selection rule.

    Not thread-safe: the ROS node serialises access with its own lock.
    """

    def __init__(self, config: FrameSyncConfig) -> None:
        self.config = config
        cameras = sorted(config.camera_indices)  # DrivingInput rows are in ascending camera index
        self._stamps: dict[int, deque[int]] = {i: deque() for i in cameras}
        self._frames: dict[int, deque[FrameT]] = {i: deque() for i in cameras}
        self._pending_reset: Rejection | None = None

    def add(self, camera_index: int, stamp_ns: int, frame: FrameT) -> None:
        """Buffer one frame; a stamp older than the camera's newest clears every buffer."""
        if camera_index not in self._stamps:
            raise ValueError(f"camera_index: {camera_index} is not synced (cameras {self.config.camera_indices})")
        stamps, frames = self._stamps[camera_index], self._frames[camera_index]
        if stamps and stamp_ns < stamps[-1]:
            self.reset(f"camera {camera_index} stamp went back {_s(stamps[-1] - stamp_ns)}")
        elif stamps and stamp_ns == stamps[-1]:
            frames[-1] = frame  # a re-sent frame replaces its twin instead of doubling it
            return
        stamps.append(stamp_ns)
        frames.append(frame)
        horizon = stamp_ns - self.config.retention_ns
        while len(stamps) > MAX_FRAMES_BUFFERED or (len(stamps) > 1 and stamps[0] < horizon):
            stamps.popleft()
            frames.popleft()

    def reset(self, detail: str) -> None:
        """Clear all buffers after a time jump; the next select() reports it once."""
        for camera in self._stamps:
            self._stamps[camera].clear()
            self._frames[camera].clear()
        self._pending_reset = Rejection(RejectReason.TIME_BACKWARDS, f"{detail}; frame buffers cleared")

    def newest_stamps(self) -> dict[int, int | None]:
        """Newest buffered stamp per camera (None when empty)."""
        return {camera: (stamps[-1] if stamps else None) for camera, stamps in self._stamps.items()}

    def select(self, now_ns: int | None = None, t0_ns: int | None = None) -> FrameSet[FrameT] | Rejection:
        """Pick the frame nearest each target t0 - k*spacing on every camera.

        now_ns: the caller's clock, for the staleness check (None skips it).
        t0_ns: plan for this time instead of the oldest newest stamp (offline evaluation);
            the skew check is skipped then, because t0 no longer derives from the newest frames.
        """
        if self._pending_reset is not None:
            rejection, self._pending_reset = self._pending_reset, None
            return rejection
        cfg = self.config
        for camera, stamps in self._stamps.items():
            if not stamps:
                return Rejection(RejectReason.NO_FRAMES, f"camera {camera}: no frames received")
        newest = {camera: stamps[-1] for camera, stamps in self._stamps.items()}
        if now_ns is not None and cfg.max_age_ns > 0:
            camera, stamp = min(newest.items(), key=lambda item: item[1])
            if now_ns - stamp > cfg.max_age_ns:
                return Rejection(
                    RejectReason.CAMERA_STALE,
                    f"camera {camera}: newest frame is {_s(now_ns - stamp)} old (max {_s(cfg.max_age_ns)})",
                )
        if t0_ns is None:
            lagging = min(newest, key=newest.__getitem__)
            # Free-running cameras naturally trail each other by up to one frame, so the lag
            # is measured against the others' previous frames, not their newest ones.
            previous = {
                camera: stamps[-2] if len(stamps) > 1 else stamps[-1] for camera, stamps in self._stamps.items()
            }
            leading = max(previous, key=previous.__getitem__)
            lag = previous[leading] - newest[lagging]
            if lag > cfg.max_skew_ns:
                return Rejection(
                    RejectReason.CAMERA_SKEW,
                    f"camera {lagging} lags: its newest frame is {_s(lag)} older than camera {leading}'s "
                    f"previous one (max {_s(cfg.max_skew_ns)})",
                )
            t0_ns = newest[lagging]
        targets = [t0_ns - (cfg.frames_per_camera - 1 - k) * cfg.frame_spacing_ns for k in range(cfg.frames_per_camera)]
        chosen_frames: list[list[FrameT]] = []
        worst_error = 0
        chosen_stamps = np.empty((len(self._stamps), cfg.frames_per_camera), dtype=np.int64)
        for row, (camera, stamps) in enumerate(self._stamps.items()):
            frames = self._frames[camera]
            row_frames = []
            for col, target in enumerate(targets):
                index = _nearest(stamps, target)
                error = abs(stamps[index] - target)
                if error > cfg.max_frame_error_ns:
                    return Rejection(
                        RejectReason.FRAME_MISMATCH,
                        f"camera {camera}: nearest frame to t0-{_s(t0_ns - target)} is {_s(error)} off "
                        f"(max {_s(cfg.max_frame_error_ns)})",
                    )
                worst_error = max(worst_error, error)
                row_frames.append(frames[index])
                chosen_stamps[row, col] = stamps[index]
            chosen_frames.append(row_frames)
        return FrameSet(
            t0_ns=t0_ns,
            camera_indices=tuple(self._stamps),
            frames=chosen_frames,
            stamps_ns=chosen_stamps,
            newest_ns=tuple(newest.values()),
            max_error_ns=worst_error,
        )


def _nearest(stamps: deque[int], target: int) -> int:
    """Index of the stamp closest to target (ties go to the older frame)."""
    right = bisect.bisect_left(stamps, target)
    if right == 0:
        return 0
    if right == len(stamps):
        return right - 1
    return right - 1 if target - stamps[right - 1] <= stamps[right] - target else right
