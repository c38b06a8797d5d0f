"""Message conversion of the drive node: image decoding and its rejections, plan -> messages,
sample selection and frames (the output gate: test_node_gate.py)."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
from builtin_interfaces.msg import Time
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import Header
from visualization_msgs.msg import Marker

from alpamayo_ros.inputs import messages
from alpamayo_ros.inputs.ego_history import quaternion_to_matrix
from alpamayo_ros.ros import convert

RNG = np.random.default_rng(7)
RGB = RNG.integers(0, 256, (6, 10, 3), dtype=np.uint8)


def raw(encoding: str, pixels: np.ndarray, *, pad: int = 0, cut: int = 0) -> Image:
    height, width = pixels.shape[:2]
    rows = pixels.reshape(height, -1)
    rows = np.concatenate([rows, np.zeros((height, pad), np.uint8)], axis=1)
    data = rows.tobytes()[: len(rows.tobytes()) - cut]
    return Image(height=height, width=width, encoding=encoding, step=rows.shape[1], data=data)


@pytest.mark.parametrize(
    ("encoding", "pixels"),
    [
        ("rgb8", RGB),
        ("bgr8", RGB[..., ::-1]),
        ("rgba8", np.dstack([RGB, np.full(RGB.shape[:2], 9, np.uint8)])),
        ("bgra8", np.dstack([RGB[..., ::-1], np.full(RGB.shape[:2], 9, np.uint8)])),
    ],
)
def test_raw_color_encodings_become_rgb(encoding: str, pixels: np.ndarray) -> None:
    for pad in (0, 3):  # rows may be padded beyond width * channels
        out = messages.raw_image_to_rgb(raw(encoding, np.ascontiguousarray(pixels), pad=pad))
        assert out.dtype == np.uint8 and out.flags.c_contiguous
        np.testing.assert_array_equal(out, RGB)


def test_mono8_is_replicated_to_rgb() -> None:
    gray = RGB[..., 0].copy()
    out = messages.raw_image_to_rgb(raw("mono8", gray))
    assert out.shape == (6, 10, 3)
    np.testing.assert_array_equal(out[..., 2], gray)


def test_raw_image_is_copied_out_of_the_message() -> None:
    msg = raw("rgb8", RGB)
    out = messages.raw_image_to_rgb(msg)
    msg.data = bytes(len(msg.data))
    np.testing.assert_array_equal(out, RGB)


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        (raw("yuv422", RGB[..., :2].copy()), "unsupported_encoding"),
        (raw("16UC1", RGB[..., :2].copy()), "unsupported_encoding"),
        (raw("rgb8", RGB, cut=5), "bad_data_length"),
        (Image(height=6, width=10, encoding="rgb8", step=20, data=bytes(120)), "bad_data_length"),
        (Image(height=0, width=10, encoding="rgb8", step=30, data=b""), "empty_image"),
    ],
)
def test_bad_raw_images_are_rejected_with_a_reason(msg: Image, reason: str) -> None:
    with pytest.raises(messages.ImageRejected) as caught:
        messages.raw_image_to_rgb(msg)
    assert caught.value.reason == reason


def encoded(extension: str, pixels: np.ndarray) -> bytes:
    ok, data = cv2.imencode(extension, cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR))
    assert ok
    return data.tobytes()


def test_png_is_lossless_and_jpeg_close() -> None:
    png = messages.compressed_image_to_rgb(CompressedImage(format="png", data=encoded(".png", RGB)))
    np.testing.assert_array_equal(png, RGB)
    smooth = np.full((32, 48, 3), (200, 120, 40), np.uint8)
    jpeg = messages.compressed_image_to_rgb(CompressedImage(format="jpeg", data=encoded(".jpg", smooth)))
    assert jpeg.shape == smooth.shape
    assert np.abs(jpeg.astype(int) - smooth).max() <= 4  # channel order kept (RGB, not BGR)


@pytest.mark.parametrize(
    ("data", "detail"),
    [
        (encoded(".jpg", RGB)[:-40], "truncated JPEG"),
        (bytes(range(256)) * 3, "cannot decode"),
        (b"\xff\xd8\xff\xe0" + bytes(300) + b"\xff\xd9", "cannot decode"),
        (b"", "no compressed bytes"),
    ],
)
def test_corrupt_compressed_images_are_rejected(data: bytes, detail: str) -> None:
    with pytest.raises(messages.ImageRejected, match=detail) as caught:
        messages.compressed_image_to_rgb(CompressedImage(format="jpeg", data=data))
    assert caught.value.reason in ("corrupt_image", "empty_image")


def test_fit_image() -> None:
    assert messages.fit_image(RGB, None) is RGB
    assert messages.fit_image(RGB, (10, 6)) is RGB
    assert messages.fit_image(RGB, (5, 3)).shape == (3, 5, 3)


def test_stamps_round_trip() -> None:
    for ns in (0, 1, 999_999_999, 1_712_345_678_901_234_567):
        stamp = convert.ns_to_stamp(ns)
        assert isinstance(stamp, Time) and messages.stamp_to_ns(stamp) == ns


def straight(speed: float, lateral: float = 0.0, n: int = 64) -> np.ndarray:
    steps = np.arange(1, n + 1, dtype=np.float64) * 0.1
    return np.stack([speed * steps, np.full(n, lateral), np.zeros(n)], axis=-1)


def random_rotations(count: int) -> np.ndarray:
    quat = RNG.normal(size=(count, 4))
    quat /= np.linalg.norm(quat, axis=1, keepdims=True)
    return quaternion_to_matrix(quat)


def test_rotation_quaternion_round_trip_including_half_turns() -> None:
    rotations = np.concatenate([random_rotations(50), np.diag([1.0, -1, -1])[None], np.diag([-1.0, 1, -1])[None],
                                np.diag([-1.0, -1, 1])[None], np.eye(3)[None]])  # fmt: skip
    quat = convert.rotation_to_quaternion(rotations)
    np.testing.assert_allclose(np.linalg.norm(quat, axis=-1), 1.0)
    np.testing.assert_allclose(quaternion_to_matrix(quat), rotations, atol=1e-9)


def test_to_frame_applies_the_t0_pose() -> None:
    yaw = 0.5
    rot_t0 = quaternion_to_matrix(np.array([0, 0, math.sin(yaw / 2), math.cos(yaw / 2)]))
    xyz_t0 = np.array([10.0, -2.0, 1.0])
    xyz, rot = convert.to_frame(np.array([[[1.0, 0.0, 0.0]]]), np.eye(3)[None, None], xyz_t0, rot_t0)
    np.testing.assert_allclose(xyz[0, 0], xyz_t0 + [math.cos(yaw), math.sin(yaw), 0.0])
    np.testing.assert_allclose(rot[0, 0], rot_t0)
    same_xyz, _ = convert.to_frame(np.ones((1, 2, 3), np.float32), np.tile(np.eye(3), (1, 2, 1, 1)), None, None)
    assert same_xyz.dtype == np.float64 and (same_xyz == 1.0).all()


def test_path_and_trajectory_set_messages() -> None:
    header = Header(stamp=convert.ns_to_stamp(5_000_000_000), frame_id="base_link")
    xyz = np.stack([straight(4.0), straight(4.0, 1.0)])
    yaw = np.linspace(0.0, 0.6, 64)
    rot = quaternion_to_matrix(np.stack([np.zeros(64), np.zeros(64), np.sin(yaw / 2), np.cos(yaw / 2)], axis=-1))
    rot = np.stack([rot, rot])
    path = convert.path_message(header, xyz[1], rot[1], 0.1)
    assert path.header.frame_id == "base_link" and len(path.poses) == 64
    assert messages.stamp_to_ns(path.poses[0].header.stamp) == 5_100_000_000
    assert messages.stamp_to_ns(path.poses[63].header.stamp) == 11_400_000_000
    last = path.poses[63].pose
    assert (last.position.x, last.position.y) == pytest.approx((25.6, 1.0))
    assert 2 * math.atan2(last.orientation.z, last.orientation.w) == pytest.approx(0.6)
    message = convert.trajectory_set_message(header, xyz, rot, 0.1, np.array([1.0, 2.0]), 0, "first")
    assert len(message.samples) == 2 and message.horizon_s == pytest.approx(6.4)
    assert message.samples[1].poses[0].position.y == pytest.approx(1.0)


def test_marker_array_has_all_samples_and_the_reasoning() -> None:
    header = Header(stamp=convert.ns_to_stamp(1), frame_id="odom")
    coc = "Keep lane because the road ahead is clear " * 4
    markers = convert.marker_array_message(
        header, np.stack([straight(3.0)] * 3), 2, coc, np.array([5.0, 6.0, 0.0])
    ).markers
    assert markers[0].action == Marker.DELETEALL
    lines = [m for m in markers if m.type == Marker.LINE_STRIP]
    assert [m.id for m in lines] == [0, 1, 2] and all(len(m.points) == 64 for m in lines)
    assert lines[2].scale.x > lines[0].scale.x  # the selected sample stands out
    (text,) = [m for m in markers if m.type == Marker.TEXT_VIEW_FACING]
    assert text.frame_locked and text.pose.position.x == 5.0 and text.pose.position.z == 3.0
    assert text.text.replace("\n", " ") == coc.strip()
