"""Image and odometry messages -> numpy, without ROS (no cv_bridge: cv2 + numpy only).

The functions read message fields by name, so rclpy messages and rosbags' deserialized
messages both work: the node, the evaluator and its Ray workers decode with the same code.
Image decoding raises ImageRejected with a stable reason key, so drops are counted per reason.
"""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np

NS_PER_S = 1_000_000_000

#: raw encoding -> (channels, cv2 conversion to RGB or None when already RGB)
RAW_ENCODINGS: dict[str, tuple[int, int | None]] = {
    "rgb8": (3, None),
    "bgr8": (3, cv2.COLOR_BGR2RGB),
    "rgba8": (4, cv2.COLOR_RGBA2RGB),
    "bgra8": (4, cv2.COLOR_BGRA2RGB),
    "mono8": (1, cv2.COLOR_GRAY2RGB),
}
JPEG_START = b"\xff\xd8"
JPEG_END = b"\xff\xd9"


class ImageRejected(ValueError):
    """An image message that cannot become an RGB frame; reason is a stable diagnostic key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def stamp_to_ns(stamp: Any) -> int:
    """Nanoseconds of a builtin_interfaces/Time (sec, nanosec)."""
    return stamp.sec * NS_PER_S + stamp.nanosec


def raw_image_to_rgb(msg: Any) -> np.ndarray:
    """H x W x 3 uint8 RGB copy of a raw Image (8-bit encodings only)."""
    if msg.encoding not in RAW_ENCODINGS:
        raise ImageRejected(
            "unsupported_encoding", f"encoding {msg.encoding!r} (supported: {', '.join(RAW_ENCODINGS)})"
        )
    channels, conversion = RAW_ENCODINGS[msg.encoding]
    height, width, step = msg.height, msg.width, msg.step
    if height == 0 or width == 0:
        raise ImageRejected("empty_image", f"{width}x{height} image")
    if step < width * channels:
        raise ImageRejected("bad_data_length", f"step {step} < width {width} x {channels} channels")
    if len(msg.data) != step * height:
        raise ImageRejected("bad_data_length", f"{len(msg.data)} bytes != step {step} x height {height}")
    rows = np.frombuffer(msg.data, dtype=np.uint8).reshape(height, step)
    pixels = rows[:, : width * channels].reshape(height, width, channels)
    if conversion is None:
        return pixels.copy()  # the message buffer is reused by rclpy; keep our own frame
    return cv2.cvtColor(pixels, conversion)


def compressed_image_to_rgb(msg: Any) -> np.ndarray:
    """H x W x 3 uint8 RGB of a JPEG or PNG CompressedImage."""
    data = bytes(msg.data)
    if not data:
        raise ImageRejected("empty_image", "no compressed bytes")
    if data.startswith(JPEG_START) and not data.rstrip(b"\x00").endswith(JPEG_END):
        # libjpeg decodes a truncated stream into a half-grey frame with only a warning
        raise ImageRejected("corrupt_image", f"truncated JPEG ({len(data)} bytes, no end marker)")
    bgr = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
    if bgr is None:
        raise ImageRejected("corrupt_image", f"cannot decode {len(data)} bytes of format {msg.format!r}")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def fit_image(image: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
    """Resize to (width, height) with area averaging; None keeps the image."""
    if size is None or (image.shape[1], image.shape[0]) == size:
        return image
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA)


def odometry_pose(msg: Any) -> tuple[int, np.ndarray, np.ndarray]:
    """(stamp ns, xyz, quaternion xyzw) of an Odometry message."""
    p, q = msg.pose.pose.position, msg.pose.pose.orientation
    return stamp_to_ns(msg.header.stamp), np.array([p.x, p.y, p.z]), np.array([q.x, q.y, q.z, q.w])
