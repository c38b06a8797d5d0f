"""Assemble one DrivingInput from synced camera frames, odometry history and route text.

The single entry point shared by the drive node and the bag evaluator, so live and offline
planning see inputs built by the same rules. Decoding and resizing happen before: frames
arrive as H x W x 3 uint8 RGB arrays, keyed (KeyedFrame), and the input carries their keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from alpamayo_ros.core.frame_key import KeyedFrame
from alpamayo_ros.core.types import DrivingInput
from alpamayo_ros.inputs import RejectReason, Rejection
from alpamayo_ros.inputs.ego_history import EgoHistory, OdometryBuffer
from alpamayo_ros.inputs.frame_sync import FrameSet, FrameSync


@dataclass(frozen=True)
class Assembly:
    """A DrivingInput plus what was learned while building it (ages, the t0 pose)."""

    driving_input: DrivingInput
    frames: FrameSet[KeyedFrame]
    ego: EgoHistory


def build_driving_input(
    frame_sync: FrameSync[KeyedFrame],
    odometry: OdometryBuffer,
    *,
    now_ns: int | None = None,
    t0_ns: int | None = None,
    route_text: str | None = None,
) -> Assembly | Rejection:
    """Select frames, interpolate the ego history at their t0 and stack the images.

    now_ns: clock for camera staleness (None: no check, e.g. offline).
    t0_ns: force the plan time (offline evaluation); default is the frame sync's t0 rule.
    route_text: navigation instruction; empty text counts as none.
    """
    frames = frame_sync.select(now_ns=now_ns, t0_ns=t0_ns)
    if isinstance(frames, Rejection):
        return frames
    ego = odometry.history(frames.t0_ns)
    if isinstance(ego, Rejection):
        return ego
    images = _stack_images(frames)
    if isinstance(images, Rejection):
        return images
    driving_input = DrivingInput(
        images=images,
        camera_indices=frames.camera_indices,
        frame_stamps_ns=frames.stamps_ns,
        t0_ns=frames.t0_ns,
        ego_history_xyz=ego.xyz,
        ego_history_rot=ego.rot,
        route_text=route_text or None,
    ).with_frame_keys([frame.key for row in frames.frames for frame in row])
    return Assembly(driving_input=driving_input, frames=frames, ego=ego)


def _stack_images(frames: FrameSet[KeyedFrame]) -> np.ndarray | Rejection:
    """(cameras, frames, H, W, 3) uint8, or a rejection naming the first odd frame."""
    expected = frames.frames[0][0].image.shape
    for camera, row, stamps in zip(frames.camera_indices, frames.frames, frames.stamps_ns):
        for stamp, frame in zip(stamps, row):
            image = frame.image
            if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
                return Rejection(
                    RejectReason.IMAGE_SIZE,
                    f"camera {camera}: frame at {int(stamp)} ns is {image.dtype} {image.shape}, expected uint8 HxWx3",
                )
            if image.shape != expected:
                return Rejection(
                    RejectReason.IMAGE_SIZE,
                    f"camera {camera}: frame at {int(stamp)} ns is {image.shape}, camera "
                    f"{frames.camera_indices[0]} is {expected} (configure a common image size)",
                )
    stacked = np.empty((len(frames.frames), len(frames.frames[0]), *expected), dtype=np.uint8)
    for camera_row, row in zip(stacked, frames.frames):  # one copy of each frame, into an array of its own
        for slot, frame in zip(camera_row, row):
            slot[...] = frame.image
    return stacked
