"""ROS-free input assembly shared by the drive node and the bag evaluator.

Stamps are int nanoseconds and images plain numpy, so bags and live topics go through the same
code. Each stage returns its result or a Rejection: skipping a tick on bad input is a normal
outcome to count and report, not an error to raise.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RejectReason(str, Enum):
    """Why no planning input could be assembled (values are stable diagnostic keys)."""

    NO_FRAMES = "no_frames"  # a camera has delivered nothing since start or the last reset
    CAMERA_STALE = "camera_stale"  # a camera's newest frame is too old against the clock
    CAMERA_SKEW = "camera_skew"  # cameras' newest frames are too far apart
    FRAME_MISMATCH = "frame_mismatch"  # no frame close enough to a target time t0 - k*spacing
    IMAGE_SIZE = "image_size"  # selected frames differ in shape
    TIME_BACKWARDS = "time_backwards"  # a stamp or the clock jumped back; buffers were cleared
    NO_ODOMETRY = "no_odometry"
    ODOMETRY_STALE = "odometry_stale"  # newest odometry too old relative to t0
    HISTORY_SHORT = "history_short"  # odometry does not reach back to t0 - history span
    HISTORY_GAP = "history_gap"  # odometry samples around a history time too far apart
    ODOMETRY_NONFINITE = "odometry_nonfinite"  # NaN/inf odometry inside the history window
    ODOMETRY_FRAME_CHANGED = "odometry_frame_changed"  # odometry header.frame_id changed; history cleared
    CAMERA_FUTURE = "camera_future"  # a camera's stamps are ahead of the node clock beyond the tolerance
    ODOMETRY_FUTURE = "odometry_future"  # odometry stamps are ahead of the node clock beyond the tolerance


@dataclass(frozen=True)
class Rejection:
    """A skipped planning attempt: a stable reason key plus a human-readable detail."""

    reason: RejectReason
    detail: str

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}"
