"""FrameSync: t0 rule, nearest-frame choice and every rejection reason."""

from __future__ import annotations

import pytest

from alpamayo_ros.inputs import RejectReason, Rejection
from alpamayo_ros.inputs.frame_sync import FrameSet, FrameSync, FrameSyncConfig

MS = 1_000_000
CAMERAS = (0, 1, 2, 6)


def feed(sync: FrameSync[str], camera: int, start_ms: int, stop_ms: int, period_ms: int = 100) -> None:
    for t in range(start_ms, stop_ms + 1, period_ms):
        sync.add(camera, t * MS, f"{camera}@{t}")


def selected(result: FrameSet[str] | Rejection) -> FrameSet[str]:
    assert isinstance(result, FrameSet), f"unexpected rejection: {result}"
    return result


def rejected(result: FrameSet[str] | Rejection, reason: RejectReason) -> str:
    assert isinstance(result, Rejection), f"expected {reason}, got a frame set"
    assert result.reason is reason, str(result)
    return result.detail


def test_t0_is_oldest_newest_stamp_and_frames_nearest_targets() -> None:
    sync: FrameSync[str] = FrameSync(FrameSyncConfig(CAMERAS))
    offsets = {0: 0, 1: 7, 2: 13, 6: 21}  # unsynchronised shutters, within the 50 ms limits
    for camera, offset in offsets.items():
        feed(sync, camera, 1000 + offset, 2000 + offset)
    frames = selected(sync.select(now_ns=2050 * MS))
    assert frames.t0_ns == 2000 * MS  # camera 0's newest is the oldest newest stamp
    assert frames.camera_indices == CAMERAS
    assert frames.frames[0] == ["0@1700", "0@1800", "0@1900", "0@2000"]
    assert frames.frames[3] == ["6@1721", "6@1821", "6@1921", "6@2021"]
    assert frames.stamps_ns.shape == (4, 4)
    assert frames.stamps_ns[1].tolist() == [t * MS for t in (1707, 1807, 1907, 2007)]
    assert frames.skew_ns == 21 * MS
    assert frames.max_error_ns == 21 * MS


def test_nearest_frame_with_faster_camera_and_configurable_layout() -> None:
    config = FrameSyncConfig((1,), frames_per_camera=3, frame_spacing_ns=200 * MS, max_frame_error_ns=20 * MS)
    sync: FrameSync[str] = FrameSync(config)
    feed(sync, 1, 0, 1000, period_ms=30)  # 33 Hz camera: 0, 30, ..., 990
    frames = selected(sync.select())
    assert frames.t0_ns == 990 * MS
    assert frames.frames[0] == ["1@600", "1@780", "1@990"]  # nearest 590, 790, 990


def test_missing_camera_is_named() -> None:
    sync: FrameSync[str] = FrameSync(FrameSyncConfig(CAMERAS))
    for camera in (0, 1, 6):
        feed(sync, camera, 0, 500)
    assert "camera 2" in rejected(sync.select(), RejectReason.NO_FRAMES)


def test_stopped_camera_is_stale_against_clock() -> None:
    sync: FrameSync[str] = FrameSync(FrameSyncConfig(CAMERAS, max_age_ns=300 * MS))
    for camera in CAMERAS:
        feed(sync, camera, 0, 2000 if camera != 2 else 1500)
    detail = rejected(sync.select(now_ns=2010 * MS), RejectReason.CAMERA_STALE)
    assert "camera 2" in detail and "0.510 s" in detail
    # without a clock (offline) the same buffers fail on skew instead
    assert "camera 2 lags" in rejected(sync.select(), RejectReason.CAMERA_SKEW)


def test_skewed_camera_is_rejected_and_named() -> None:
    sync: FrameSync[str] = FrameSync(FrameSyncConfig(CAMERAS, max_skew_ns=50 * MS))
    for camera in CAMERAS:
        shift = -180 if camera == 6 else 0  # camera 6 stamps 180 ms behind the others
        feed(sync, camera, shift, 2000 + shift)
    detail = rejected(sync.select(now_ns=2000 * MS), RejectReason.CAMERA_SKEW)
    assert detail.startswith("camera 6 lags") and "0.080 s older than camera 0's previous" in detail


def test_camera_trailing_by_less_than_a_frame_is_normal() -> None:
    """Free-running cameras: one may still be waiting for the frame the others already sent."""
    sync: FrameSync[str] = FrameSync(FrameSyncConfig(CAMERAS, max_skew_ns=50 * MS))
    for camera in CAMERAS:
        shift = -95 if camera == 6 else 0
        feed(sync, camera, shift, 2000 + shift)
    frames = selected(sync.select(now_ns=2000 * MS))
    assert frames.t0_ns == 1905 * MS and frames.skew_ns == 95 * MS
    assert frames.frames[0] == ["0@1600", "0@1700", "0@1800", "0@1900"]


def test_gap_in_a_camera_is_a_frame_mismatch() -> None:
    sync: FrameSync[str] = FrameSync(FrameSyncConfig(CAMERAS))
    for camera in CAMERAS:
        for t in range(0, 2001, 100):
            if not (camera == 1 and t in (1700, 1800)):
                sync.add(camera, t * MS, "x")
    detail = rejected(sync.select(now_ns=2000 * MS), RejectReason.FRAME_MISMATCH)
    assert "camera 1" in detail and "t0-0.300 s" in detail


def test_too_short_buffer_is_a_frame_mismatch() -> None:
    sync: FrameSync[str] = FrameSync(FrameSyncConfig(CAMERAS))
    for camera in CAMERAS:
        feed(sync, camera, 1800, 2000)  # 0.2 s of frames; the window needs 0.3 s
    rejected(sync.select(now_ns=2000 * MS), RejectReason.FRAME_MISMATCH)


def test_time_going_backwards_clears_buffers_and_is_reported_once() -> None:
    sync: FrameSync[str] = FrameSync(FrameSyncConfig(CAMERAS))
    for camera in CAMERAS:
        feed(sync, camera, 5000, 6000)
    selected(sync.select(now_ns=6000 * MS))
    sync.add(1, 1000 * MS, "loop")  # a bag loop restarts at 1 s
    assert set(sync.newest_stamps().values()) == {None, 1000 * MS}
    assert "camera 1 stamp went back 5.000 s" in rejected(sync.select(), RejectReason.TIME_BACKWARDS)
    assert "camera 0" in rejected(sync.select(), RejectReason.NO_FRAMES)  # reported once only
    for camera in CAMERAS:
        feed(sync, camera, 1100, 1500)
    assert selected(sync.select(now_ns=1500 * MS)).t0_ns == 1500 * MS


def test_explicit_t0_for_offline_use_skips_skew() -> None:
    sync: FrameSync[str] = FrameSync(FrameSyncConfig(CAMERAS))
    for camera in CAMERAS:
        feed(sync, camera, 0, 2200 if camera else 2000)
    rejected(sync.select(), RejectReason.CAMERA_SKEW)
    frames = selected(sync.select(t0_ns=2000 * MS))
    assert frames.frames[2] == ["2@1700", "2@1800", "2@1900", "2@2000"]


def test_buffers_are_bounded_and_duplicates_replaced() -> None:
    sync: FrameSync[str] = FrameSync(FrameSyncConfig((0,)))
    feed(sync, 0, 0, 60_000)  # 10 minutes at 10 Hz
    sync.add(0, 60_000 * MS, "resent")
    assert selected(sync.select()).frames[0][-1] == "resent"
    # frames older than the retention window are gone, so an old t0 can no longer be served
    rejected(sync.select(t0_ns=59_000 * MS), RejectReason.FRAME_MISMATCH)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"camera_indices": (1, 1)}, "camera_indices"),
        ({"camera_indices": (1,), "frames_per_camera": 0}, "frames_per_camera"),
        ({"camera_indices": (1,), "frame_spacing_ns": 0}, "frame_spacing_ns"),
        ({"camera_indices": (1,), "max_skew_ns": -1}, "max_skew_ns"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FrameSyncConfig(**kwargs)


def test_unknown_camera_is_refused() -> None:
    sync: FrameSync[str] = FrameSync(FrameSyncConfig((0,)))
    with pytest.raises(ValueError, match="camera_index"):
        sync.add(3, 0, "x")
