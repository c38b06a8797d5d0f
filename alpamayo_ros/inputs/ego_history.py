"""Ego-motion history from odometry, resampled at fixed times before t0 and put in the t0 frame.

Odometry rates differ between vehicles and bags, so poses are interpolated at t0 - i*dt
(position linearly, rotation by slerp) instead of indexing a buffer at an assumed rate.
Result frame (upstream's): xyz_local = R_t0^-1 (xyz - xyz_t0), rot_local = R_t0^-1 R.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from alpamayo_ros.core.types import HISTORY_DT_S, NUM_HISTORY_POSES
from alpamayo_ros.inputs import RejectReason, Rejection

NS_PER_S = 1_000_000_000
MAX_SAMPLES_BUFFERED = 4096  # 20 s of 200 Hz odometry; bounds memory when stamps barely advance


def _s(ns: int) -> str:
    return f"{ns / NS_PER_S:.3f} s"


@dataclass(frozen=True)
class EgoHistoryConfig:
    """History layout and odometry quality limits.

    max_stale_ns: t0 may be at most this far after the newest odometry sample; the gap is
        bridged by extrapolating the last two samples.
    max_gap_ns: largest allowed time between the two samples a history pose is interpolated from.
    """

    num_poses: int = NUM_HISTORY_POSES
    dt_ns: int = int(HISTORY_DT_S * NS_PER_S)
    max_stale_ns: int = 100_000_000
    max_gap_ns: int = 250_000_000

    def __post_init__(self) -> None:
        if self.num_poses < 2:
            raise ValueError(f"num_poses: must be >= 2, got {self.num_poses}")
        for name in ("dt_ns", "max_gap_ns"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_stale_ns < 0:
            raise ValueError(f"max_stale_ns: must be >= 0, got {self.max_stale_ns}")

    @property
    def span_ns(self) -> int:
        """Time from the oldest history pose to t0."""
        return (self.num_poses - 1) * self.dt_ns


@dataclass(frozen=True)
class EgoHistory:
    """Poses at t0 - (N-1)*dt ... t0, oldest first.

    xyz: float32 (N, 3) positions in the t0 ego frame (m); the last row is the origin.
    rot: float32 (N, 3, 3) rotations in the t0 ego frame; the last is identity.
    xyz_t0: float64 (3,) ego position at t0 in the odometry frame.
    rot_t0: float64 (3, 3) ego rotation at t0 in the odometry frame.
    newest_ns: stamp of the newest odometry sample used (for input-age reporting).
    """

    t0_ns: int
    xyz: np.ndarray
    rot: np.ndarray
    xyz_t0: np.ndarray
    rot_t0: np.ndarray
    newest_ns: int


class OdometryBuffer:
    """Time-ordered odometry poses; a stamp going backwards clears it.

    Not thread-safe: the ROS node serialises access with its own lock.
    """

    def __init__(self, config: EgoHistoryConfig) -> None:
        self.config = config
        self._stamps: deque[int] = deque()
        self._xyz: deque[np.ndarray] = deque()
        self._quat: deque[np.ndarray] = deque()  # (x, y, z, w), unit norm, sign-continuous
        self._nonfinite_ns: deque[int] = deque()
        self._pending_reset: Rejection | None = None

    @property
    def newest_ns(self) -> int | None:
        return self._stamps[-1] if self._stamps else None

    def add(self, stamp_ns: int, xyz: np.ndarray, quat_xyzw: np.ndarray) -> None:
        """Buffer one pose (odometry frame); non-finite poses are remembered, not stored."""
        xyz = np.asarray(xyz, dtype=np.float64).reshape(3)
        quat = np.asarray(quat_xyzw, dtype=np.float64).reshape(4)
        if self._stamps and stamp_ns < self._stamps[-1]:
            self.reset(f"odometry stamp went back {_s(self._stamps[-1] - stamp_ns)}")
        norm = float(np.linalg.norm(quat))
        if not (np.isfinite(xyz).all() and np.isfinite(quat).all()) or norm < 1e-6:
            self._nonfinite_ns.append(stamp_ns)
            self._prune(stamp_ns)
            return
        quat = quat / norm
        if self._quat and float(np.dot(self._quat[-1], quat)) < 0.0:
            quat = -quat  # same rotation; keeps slerp on the short arc
        if self._stamps and stamp_ns == self._stamps[-1]:
            self._xyz[-1], self._quat[-1] = xyz, quat  # a re-sent sample replaces its twin
            return
        self._stamps.append(stamp_ns)
        self._xyz.append(xyz)
        self._quat.append(quat)
        self._prune(stamp_ns)

    def reset(self, detail: str, reason: RejectReason = RejectReason.TIME_BACKWARDS) -> None:
        """Clear the buffer (a time jump, a frame change); the next history() reports it once."""
        self._stamps.clear()
        self._xyz.clear()
        self._quat.clear()
        self._nonfinite_ns.clear()
        self._pending_reset = Rejection(reason, f"{detail}; odometry buffer cleared")

    def _prune(self, newest_ns: int) -> None:
        cfg = self.config
        horizon = newest_ns - cfg.span_ns - cfg.max_gap_ns - cfg.max_stale_ns
        while len(self._stamps) > MAX_SAMPLES_BUFFERED or (len(self._stamps) > 2 and self._stamps[1] < horizon):
            self._stamps.popleft()
            self._xyz.popleft()
            self._quat.popleft()
        while self._nonfinite_ns and (
            len(self._nonfinite_ns) > MAX_SAMPLES_BUFFERED or self._nonfinite_ns[0] < horizon
        ):
            self._nonfinite_ns.popleft()

    def history(self, t0_ns: int) -> EgoHistory | Rejection:
        """Interpolate the N history poses ending at t0 and express them in the t0 ego frame."""
        if self._pending_reset is not None:
            rejection, self._pending_reset = self._pending_reset, None
            return rejection
        cfg = self.config
        oldest_target = t0_ns - cfg.span_ns
        bad = [s for s in self._nonfinite_ns if oldest_target - cfg.max_gap_ns <= s <= t0_ns + cfg.max_gap_ns]
        if bad:
            return Rejection(
                RejectReason.ODOMETRY_NONFINITE,
                f"non-finite odometry at t0{(bad[-1] - t0_ns) / NS_PER_S:+.3f} s inside the history window",
            )
        if len(self._stamps) < 2:
            return Rejection(RejectReason.NO_ODOMETRY, f"{len(self._stamps)} odometry samples buffered (need 2)")
        stamps = np.fromiter(self._stamps, dtype=np.int64, count=len(self._stamps))
        if t0_ns - stamps[-1] > cfg.max_stale_ns:
            return Rejection(
                RejectReason.ODOMETRY_STALE,
                f"newest odometry is {_s(t0_ns - int(stamps[-1]))} older than t0 (max {_s(cfg.max_stale_ns)})",
            )
        if oldest_target < stamps[0]:
            return Rejection(
                RejectReason.HISTORY_SHORT,
                f"odometry reaches back to t0-{_s(t0_ns - int(stamps[0]))}, need t0-{_s(cfg.span_ns)}",
            )
        targets = oldest_target + cfg.dt_ns * np.arange(cfg.num_poses, dtype=np.int64)
        left = np.clip(np.searchsorted(stamps, targets, side="right") - 1, 0, len(stamps) - 2)
        gaps = stamps[left + 1] - stamps[left]
        worst = int(np.argmax(gaps))
        if gaps[worst] > cfg.max_gap_ns:
            return Rejection(
                RejectReason.HISTORY_GAP,
                f"odometry gap of {_s(int(gaps[worst]))} around t0-{_s(t0_ns - int(targets[worst]))} "
                f"(max {_s(cfg.max_gap_ns)})",
            )
        # fraction > 1 only for targets after the newest sample: linear/slerp extrapolation
        fraction = (targets - stamps[left]) / gaps.astype(np.float64)
        xyz_all = np.stack(self._xyz)
        quat_all = np.stack(self._quat)
        xyz = xyz_all[left] + fraction[:, None] * (xyz_all[left + 1] - xyz_all[left])
        rot = quaternion_to_matrix(slerp(quat_all[left], quat_all[left + 1], fraction))
        xyz_t0, rot_t0 = xyz[-1], rot[-1]
        xyz_local = (xyz - xyz_t0) @ rot_t0  # row-vector form of R_t0^T (xyz - xyz_t0)
        rot_local = np.einsum("ji,njk->nik", rot_t0, rot)  # R_t0^T R
        if not (np.isfinite(xyz_local).all() and np.isfinite(rot_local).all()):
            return Rejection(RejectReason.ODOMETRY_NONFINITE, "interpolated history is not finite")
        return EgoHistory(
            t0_ns=t0_ns,
            xyz=xyz_local.astype(np.float32),
            rot=rot_local.astype(np.float32),
            xyz_t0=xyz_t0,
            rot_t0=rot_t0,
            newest_ns=int(stamps[-1]),
        )


def slerp(q0: np.ndarray, q1: np.ndarray, fraction: np.ndarray) -> np.ndarray:
    """Spherical interpolation of unit quaternions (..., 4) xyzw; fraction may exceed 1."""
    dot = np.clip(np.sum(q0 * q1, axis=-1), -1.0, 1.0)
    angle = np.arccos(np.abs(dot))
    sign = np.where(dot < 0.0, -1.0, 1.0)
    small = angle < 1e-6
    sin_angle = np.where(small, 1.0, np.sin(angle))
    w0 = np.where(small, 1.0 - fraction, np.sin((1.0 - fraction) * angle) / sin_angle)
    w1 = np.where(small, fraction, np.sin(fraction * angle) / sin_angle) * sign
    out = w0[..., None] * q0 + w1[..., None] * q1
    return out / np.linalg.norm(out, axis=-1, keepdims=True)


def quaternion_to_matrix(quat_xyzw: np.ndarray) -> np.ndarray:
    """Rotation matrices (..., 3, 3) of unit quaternions (..., 4) in xyzw order."""
    x, y, z, w = np.moveaxis(quat_xyzw, -1, 0)
    return np.stack(
        [
            np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)], axis=-1),
            np.stack([2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)], axis=-1),
            np.stack([2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)], axis=-1),
        ],
        axis=-2,
    )
