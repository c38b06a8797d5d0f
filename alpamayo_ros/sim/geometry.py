"""AlpaSim poses <-> the drive loop's arrays, and a plan -> AlpaSim's answer trajectory.

AlpaSim's egomotion is the rig's pose in its "local" world frame (x forward, y left, z up at the
rig), the same convention as odometry, so a pose goes into the odometry buffer as it is. A plan's
waypoints are in the t0 ego frame; the answer carries them in the local frame, led by the ego
pose at t0, as AlpaSim's own driver answers (current pose first, then the plan at its times).
"""

from __future__ import annotations

import numpy as np
from carla_driver_interface.protocol import PoseAtTime, Trajectory
from scipy.spatial.transform import Rotation

from alpamayo_ros.core.types import WAYPOINT_DT_S

US_PER_S = 1_000_000


def pose_arrays(pose_at_time: PoseAtTime) -> tuple[int, np.ndarray, np.ndarray]:
    """(stamp us, xyz, quaternion xyzw) of one AlpaSim pose."""
    vec, quat = pose_at_time.pose.vec, pose_at_time.pose.quat
    return (int(pose_at_time.timestamp_us), np.array([vec.x, vec.y, vec.z], dtype=np.float64),
            np.array([quat.x, quat.y, quat.z, quat.w], dtype=np.float64))  # fmt: skip


def to_local(xyz: np.ndarray, rot: np.ndarray, xyz_t0: np.ndarray, rot_t0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """t0-ego-frame waypoints (N, 3) and rotations (N, 3, 3) -> the local frame."""
    xyz = np.asarray(xyz, dtype=np.float64)
    return xyz_t0 + xyz @ rot_t0.T, rot_t0 @ np.asarray(rot, dtype=np.float64)


def plan_trajectory(t0_ns: int, xyz: np.ndarray, rot: np.ndarray, xyz_t0: np.ndarray, rot_t0: np.ndarray) -> Trajectory:
    """AlpaSim's answer for one sample: the pose at t0, then waypoint i at t0 + (i+1) dt, local frame."""
    local_xyz, local_rot = to_local(xyz, rot, xyz_t0, rot_t0)
    positions = np.concatenate([xyz_t0[None], local_xyz])
    quats = Rotation.from_matrix(np.concatenate([rot_t0[None], local_rot])).as_quat()  # xyzw
    t0_us = t0_ns // 1000
    dt_us = round(WAYPOINT_DT_S * US_PER_S)
    trajectory = Trajectory()
    for i, (position, quat) in enumerate(zip(positions, quats)):
        pose = trajectory.poses.add(timestamp_us=t0_us + i * dt_us)
        pose.pose.vec.x, pose.pose.vec.y, pose.pose.vec.z = (float(v) for v in position)
        pose.pose.quat.x, pose.pose.quat.y, pose.pose.quat.z, pose.pose.quat.w = (float(v) for v in quat)
    return trajectory


def trajectory_arrays(trajectory: Trajectory) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stamps us (N,), xyz (N, 3), quaternions xyzw (N, 4)) of an AlpaSim trajectory."""
    rows = [pose_arrays(pose) for pose in trajectory.poses]
    if not rows:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 3)), np.zeros((0, 4))
    stamps, xyz, quat = zip(*rows)
    return np.array(stamps, dtype=np.int64), np.stack(xyz), np.stack(quat)
