"""OdometryBuffer: interpolation, the t0 ego frame and every rejection reason."""

from __future__ import annotations

import math

import numpy as np
import pytest

from alpamayo_ros.inputs import RejectReason, Rejection
from alpamayo_ros.inputs.ego_history import EgoHistory, EgoHistoryConfig, OdometryBuffer, quaternion_to_matrix, slerp

MS = 1_000_000


def yaw_quat(yaw: float) -> np.ndarray:
    return np.array([0.0, 0.0, math.sin(yaw / 2), math.cos(yaw / 2)])


def circle_drive(
    buffer: OdometryBuffer, start_ms: int, stop_ms: int, period_ms: int, origin=(500.0, -20.0, 3.0)
) -> None:
    """Constant speed 10 m/s on a circle of radius 50 m (yaw rate 0.2 rad/s), z constant."""
    for t in range(start_ms, stop_ms + 1, period_ms):
        yaw = 0.2 * t / 1000
        xyz = np.array([origin[0] + 50 * math.sin(yaw), origin[1] + 50 * (1 - math.cos(yaw)), origin[2]])
        buffer.add(t * MS, xyz, yaw_quat(yaw))


def history(result: EgoHistory | Rejection) -> EgoHistory:
    assert isinstance(result, EgoHistory), f"unexpected rejection: {result}"
    return result


def rejected(result: EgoHistory | Rejection, reason: RejectReason) -> str:
    assert isinstance(result, Rejection), f"expected {reason}, got a history"
    assert result.reason is reason, str(result)
    return result.detail


def expected_local(t0_s: float, times_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Closed form of the circle drive in the t0 ego frame."""
    dyaw = 0.2 * (times_s - t0_s)
    xyz = np.stack([50 * np.sin(dyaw), 50 * (1 - np.cos(dyaw)), np.zeros_like(dyaw)], axis=-1)
    return xyz, dyaw


@pytest.mark.parametrize("period_ms", [20, 33, 100])
def test_interpolated_history_matches_the_trajectory_in_t0_frame(period_ms: int) -> None:
    buffer = OdometryBuffer(EgoHistoryConfig())
    circle_drive(buffer, 0, 3000, period_ms)
    t0_ms = 2957  # between samples for every rate
    result = history(buffer.history(t0_ms * MS))
    times = (t0_ms - 100 * np.arange(15, -1, -1)) / 1000
    want_xyz, want_yaw = expected_local(t0_ms / 1000, times)
    assert result.xyz.shape == (16, 3) and result.xyz.dtype == np.float32
    assert result.rot.shape == (16, 3, 3) and result.rot.dtype == np.float32
    # linear position interpolation on a 50 m circle: chord error < 1 cm at <= 0.1 s spacing
    np.testing.assert_allclose(result.xyz, want_xyz, atol=0.015)
    np.testing.assert_allclose(np.arctan2(result.rot[:, 1, 0], result.rot[:, 0, 0]), want_yaw, atol=1e-5)
    np.testing.assert_allclose(result.xyz[-1], 0.0, atol=1e-6)
    np.testing.assert_allclose(result.rot[-1], np.eye(3), atol=1e-6)
    assert result.xyz[0, 0] < -14.0  # 1.5 s ago at 10 m/s: behind the car
    yaw_t0 = 0.2 * t0_ms / 1000
    np.testing.assert_allclose(result.rot_t0, quaternion_to_matrix(yaw_quat(yaw_t0)), atol=1e-5)
    np.testing.assert_allclose(
        result.xyz_t0, [500 + 50 * math.sin(yaw_t0), -20 + 50 * (1 - math.cos(yaw_t0)), 3.0], atol=0.015
    )


def test_t0_slightly_after_newest_sample_is_extrapolated() -> None:
    buffer = OdometryBuffer(EgoHistoryConfig(max_stale_ns=100 * MS))
    circle_drive(buffer, 0, 2000, 20)
    result = history(buffer.history(2060 * MS))
    want_xyz, _ = expected_local(2.06, np.array([1.96]))
    np.testing.assert_allclose(result.xyz[-2], want_xyz[0], atol=0.01)
    assert result.newest_ns == 2000 * MS


def test_full_3d_rotation_frame_convention() -> None:
    """xyz_local = R_t0^T (xyz - xyz_t0) and rot_local = R_t0^T R with a non-planar R_t0."""
    buffer = OdometryBuffer(EgoHistoryConfig(num_poses=2, dt_ns=100 * MS))
    q_t0 = np.array([0.1, -0.2, 0.3, 0.9])
    q_t0 /= np.linalg.norm(q_t0)
    rot_t0 = quaternion_to_matrix(q_t0)
    p_t0 = np.array([10.0, 20.0, 1.0])
    p_old = np.array([7.0, 21.0, 0.5])
    buffer.add(900 * MS, p_old, [0, 0, 0, 1])
    buffer.add(1000 * MS, p_t0, q_t0)
    result = history(buffer.history(1000 * MS))
    np.testing.assert_allclose(result.xyz[0], rot_t0.T @ (p_old - p_t0), atol=1e-5)
    np.testing.assert_allclose(result.rot[0], rot_t0.T, atol=1e-6)


def test_slerp_midpoint_and_extrapolation() -> None:
    q0, q1 = yaw_quat(0.0), yaw_quat(1.0)
    for fraction, yaw in ((0.5, 0.5), (1.2, 1.2), (0.0, 0.0)):
        rot = quaternion_to_matrix(slerp(q0, q1, np.array(fraction)))
        assert math.atan2(rot[1, 0], rot[0, 0]) == pytest.approx(yaw, abs=1e-9)
    # opposite-sign quaternion of the same rotation still takes the short arc
    rot = quaternion_to_matrix(slerp(q0, -q1, np.array(0.5)))
    assert math.atan2(rot[1, 0], rot[0, 0]) == pytest.approx(0.5, abs=1e-9)


def test_stale_odometry_is_rejected() -> None:
    buffer = OdometryBuffer(EgoHistoryConfig(max_stale_ns=100 * MS))
    circle_drive(buffer, 0, 2000, 20)
    assert "0.150 s older than t0" in rejected(buffer.history(2150 * MS), RejectReason.ODOMETRY_STALE)


def test_short_span_is_rejected() -> None:
    buffer = OdometryBuffer(EgoHistoryConfig())
    circle_drive(buffer, 0, 1000, 20)
    assert "need t0-1.500 s" in rejected(buffer.history(1000 * MS), RejectReason.HISTORY_SHORT)


def test_no_odometry() -> None:
    rejected(OdometryBuffer(EgoHistoryConfig()).history(0), RejectReason.NO_ODOMETRY)


def test_gap_is_rejected() -> None:
    buffer = OdometryBuffer(EgoHistoryConfig(max_gap_ns=250 * MS))
    circle_drive(buffer, 0, 1000, 20)
    circle_drive(buffer, 1400, 3000, 20)
    assert "0.400 s" in rejected(buffer.history(2500 * MS), RejectReason.HISTORY_GAP)


def test_nonfinite_odometry_rejects_while_inside_window() -> None:
    buffer = OdometryBuffer(EgoHistoryConfig())
    circle_drive(buffer, 0, 2000, 20)
    buffer.add(2020 * MS, [math.nan, 0, 0], [0, 0, 0, 1])
    buffer.add(2040 * MS, [0, 0, 0], [0, 0, 0, 0])  # zero quaternion: no rotation at all
    circle_drive(buffer, 2060, 3000, 20)
    rejected(buffer.history(3000 * MS), RejectReason.ODOMETRY_NONFINITE)
    circle_drive(buffer, 3020, 4000, 20)
    history(buffer.history(4000 * MS))  # NaN sample left the 1.5 s window


def test_time_going_backwards_clears_and_reports_once() -> None:
    buffer = OdometryBuffer(EgoHistoryConfig())
    circle_drive(buffer, 0, 3000, 20)
    history(buffer.history(3000 * MS))
    buffer.add(100 * MS, [0, 0, 0], [0, 0, 0, 1])
    assert "went back 2.900 s" in rejected(buffer.history(100 * MS), RejectReason.TIME_BACKWARDS)
    rejected(buffer.history(100 * MS), RejectReason.NO_ODOMETRY)
    assert buffer.newest_ns == 100 * MS


def test_buffer_is_bounded() -> None:
    buffer = OdometryBuffer(EgoHistoryConfig())
    circle_drive(buffer, 0, 120_000, 10)  # 2 minutes at 100 Hz
    assert "need t0-1.500 s" in rejected(buffer.history(110_000 * MS), RejectReason.HISTORY_SHORT)
    history(buffer.history(120_000 * MS))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_poses": 1}, "num_poses"),
        ({"dt_ns": 0}, "dt_ns"),
        ({"max_gap_ns": 0}, "max_gap_ns"),
        ({"max_stale_ns": -1}, "max_stale_ns"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EgoHistoryConfig(**kwargs)
