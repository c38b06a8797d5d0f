"""build_driving_input: frames + history + route -> DrivingInput, or the first rejection."""

from __future__ import annotations

import numpy as np

from alpamayo_ros.core.frame_key import KeyedFrame, frame_key, keyed_frame
from alpamayo_ros.core.types import DrivingInput
from alpamayo_ros.inputs import RejectReason, Rejection
from alpamayo_ros.inputs.builder import Assembly, build_driving_input
from alpamayo_ros.inputs.ego_history import EgoHistoryConfig, OdometryBuffer
from alpamayo_ros.inputs.frame_sync import FrameSync, FrameSyncConfig

MS = 1_000_000
CAMERAS = (0, 1, 2, 6)


def image(camera: int, t_ms: int, shape=(24, 40, 3)) -> KeyedFrame:
    """A frame whose pixels encode camera and time, so the stacking order can be checked."""
    return keyed_frame(camera, t_ms * MS, np.full(shape, (camera * 10 + t_ms // 100) % 256, dtype=np.uint8))


def filled(odometry_until_ms: int = 2000) -> tuple[FrameSync[KeyedFrame], OdometryBuffer]:
    sync: FrameSync[KeyedFrame] = FrameSync(FrameSyncConfig(CAMERAS))
    for t in range(0, 2001, 100):
        for camera in CAMERAS:
            sync.add(camera, t * MS, image(camera, t))
    odometry = OdometryBuffer(EgoHistoryConfig())
    for t in range(0, odometry_until_ms + 1, 10):
        odometry.add(t * MS, [5.0 * t / 1000, 0.0, 0.0], [0, 0, 0, 1])  # 5 m/s straight ahead
    return sync, odometry


def test_builds_a_valid_driving_input() -> None:
    sync, odometry = filled()
    result = build_driving_input(sync, odometry, now_ns=2030 * MS, route_text="Turn right in 30m")
    assert isinstance(result, Assembly), str(result)
    driving_input = result.driving_input
    assert isinstance(driving_input, DrivingInput)
    assert driving_input.t0_ns == 2000 * MS
    assert driving_input.images.shape == (4, 4, 24, 40, 3)
    assert driving_input.camera_indices == CAMERAS
    # camera-major, oldest first: pixel value = camera*10 + t/100
    assert [int(driving_input.images[c, f, 0, 0, 0]) for c in (0, 3) for f in (0, 3)] == [17, 20, 77, 80]
    assert driving_input.frame_stamps_ns[:, 0].tolist() == [1700 * MS] * 4
    np.testing.assert_allclose(driving_input.ego_history_xyz[:, 0], -0.5 * np.arange(15, -1, -1), atol=1e-5)
    assert driving_input.route_text == "Turn right in 30m"
    # the frames' keys, made where they arrived, travel with the input: right slots, exact pixels
    flat = driving_input.images.reshape(-1, *driving_input.images.shape[2:])
    stamps = driving_input.frame_stamps_ns.reshape(-1)
    assert list(driving_input.frame_keys) == [frame_key(CAMERAS[slot // 4], int(stamps[slot]), flat[slot])
                                              for slot in range(16)]
    np.testing.assert_allclose(result.ego.xyz_t0, [10.0, 0.0, 0.0])


def test_empty_route_text_means_none() -> None:
    sync, odometry = filled()
    result = build_driving_input(sync, odometry, route_text="")
    assert isinstance(result, Assembly) and result.driving_input.route_text is None


def test_camera_rejection_comes_first() -> None:
    sync, odometry = filled()
    result = build_driving_input(sync, odometry, now_ns=5000 * MS)
    assert isinstance(result, Rejection) and result.reason is RejectReason.CAMERA_STALE


def test_odometry_rejection_is_passed_through() -> None:
    sync, odometry = filled(odometry_until_ms=1500)
    result = build_driving_input(sync, odometry, now_ns=2000 * MS)
    assert isinstance(result, Rejection) and result.reason is RejectReason.ODOMETRY_STALE


def test_mixed_image_sizes_are_rejected_with_the_camera() -> None:
    sync, odometry = filled()
    sync.add(2, 2000 * MS, image(2, 2000, shape=(48, 80, 3)))
    result = build_driving_input(sync, odometry)
    assert isinstance(result, Rejection) and result.reason is RejectReason.IMAGE_SIZE
    assert "camera 2" in result.detail


def test_non_rgb_frame_is_rejected() -> None:
    sync, odometry = filled()
    sync.add(6, 2000 * MS, keyed_frame(6, 2000 * MS, np.zeros((24, 40), np.uint8)))
    result = build_driving_input(sync, odometry)
    assert isinstance(result, Rejection) and result.reason is RejectReason.IMAGE_SIZE
    assert "camera 6" in result.detail and "HxWx3" in result.detail
