"""The drive loop's plain input messages, and their making from ROS-shaped messages.

A front door hands the loop these instead of its own types, so the node (rclpy messages), the
evaluator (messages read from bags) and a simulator driver (arrays) reach the same decoding,
fitting and checks. Camera images stay encoded until the loop decodes them: a frame that cannot
be decoded is refused by the one rule every front door shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from alpamayo_ros.inputs.messages import odometry_pose, stamp_to_ns


@dataclass(frozen=True)
class RawImage:
    """An uncompressed image as sensor_msgs/Image carries it (8-bit encodings: rgb8, bgr8, ...)."""

    encoding: str
    height: int
    width: int
    step: int
    data: Any  # bytes-like; only read while the loop decodes it


@dataclass(frozen=True)
class CompressedImage:
    """A JPEG or PNG image as sensor_msgs/CompressedImage carries it."""

    format: str
    data: Any  # bytes-like


#: a camera image: still encoded, or already decoded H x W x 3 uint8 RGB (a simulator's render)
Image = Union[RawImage, CompressedImage, np.ndarray]


@dataclass(frozen=True)
class CameraFrame:
    camera: int  # camera index (cameras.indices)
    stamp_ns: int  # capture time
    image: Image


@dataclass(frozen=True)
class Odometry:
    stamp_ns: int
    frame_id: str  # the frame the pose is in; a change clears the ego history
    xyz: np.ndarray  # (3,) position
    quat_xyzw: np.ndarray  # (4,) orientation


@dataclass(frozen=True)
class Route:
    text: str  # navigation instruction; checked when it arrives


def camera_frame(camera: int, msg: Any) -> CameraFrame:
    """A sensor_msgs Image or CompressedImage (rclpy or a bag's, read by field name) as a CameraFrame."""
    if hasattr(msg, "encoding"):
        image: Image = RawImage(msg.encoding, msg.height, msg.width, msg.step, msg.data)
    else:
        image = CompressedImage(msg.format, msg.data)
    return CameraFrame(camera, stamp_to_ns(msg.header.stamp), image)


def odometry(msg: Any) -> Odometry:
    """A nav_msgs/Odometry (rclpy or a bag's) as an Odometry."""
    stamp_ns, xyz, quat = odometry_pose(msg)
    return Odometry(stamp_ns, msg.header.frame_id, xyz, quat)
