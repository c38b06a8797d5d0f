"""Plan -> ROS messages for the drive node: Path, TrajectorySet and MarkerArray in the configured
output frame. Decoding incoming images and odometry is ROS-free: alpamayo_ros/inputs/messages.py;
so is choosing the sample to drive: alpamayo_ros/drive/selection.py.
"""

from __future__ import annotations

import textwrap

import numpy as np
from builtin_interfaces.msg import Time
from geometry_msgs.msg import Point, Pose, PoseStamped, Quaternion, Vector3
from nav_msgs.msg import Path
from std_msgs.msg import ColorRGBA, Header
from visualization_msgs.msg import Marker, MarkerArray

from alpamayo_ros.inputs.messages import NS_PER_S, stamp_to_ns
from alpamayo_ros_msgs.msg import Trajectory, TrajectorySet


def ns_to_stamp(ns: int) -> Time:
    return Time(sec=ns // NS_PER_S, nanosec=ns % NS_PER_S)


def to_frame(
    xyz: np.ndarray, rot: np.ndarray, xyz_t0: np.ndarray | None, rot_t0: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Map t0-ego-frame poses into the odometry frame (identity when xyz_t0 is None)."""
    if xyz_t0 is None or rot_t0 is None:
        return xyz.astype(np.float64), rot.astype(np.float64)
    return xyz.astype(np.float64) @ rot_t0.T + xyz_t0, np.einsum("ij,...jk->...ik", rot_t0, rot.astype(np.float64))


def rotation_to_quaternion(rot: np.ndarray) -> np.ndarray:
    """(..., 4) xyzw unit quaternions of rotation matrices (..., 3, 3)."""
    m = rot.reshape(-1, 3, 3)
    trace = np.trace(m, axis1=1, axis2=2)
    # each row uses the best-conditioned of four formulas (largest diagonal term)
    candidates = np.stack([trace, m[:, 0, 0], m[:, 1, 1], m[:, 2, 2]], axis=1)
    best = np.argmax(candidates, axis=1)
    quat = np.empty((m.shape[0], 4))
    for row, case in enumerate(best):
        r = m[row]
        if case == 0:
            s = 2.0 * np.sqrt(1.0 + trace[row])
            quat[row] = [(r[2, 1] - r[1, 2]) / s, (r[0, 2] - r[2, 0]) / s, (r[1, 0] - r[0, 1]) / s, 0.25 * s]
        elif case == 1:
            s = 2.0 * np.sqrt(1.0 + r[0, 0] - r[1, 1] - r[2, 2])
            quat[row] = [0.25 * s, (r[0, 1] + r[1, 0]) / s, (r[0, 2] + r[2, 0]) / s, (r[2, 1] - r[1, 2]) / s]
        elif case == 2:
            s = 2.0 * np.sqrt(1.0 + r[1, 1] - r[0, 0] - r[2, 2])
            quat[row] = [(r[0, 1] + r[1, 0]) / s, 0.25 * s, (r[1, 2] + r[2, 1]) / s, (r[0, 2] - r[2, 0]) / s]
        else:
            s = 2.0 * np.sqrt(1.0 + r[2, 2] - r[0, 0] - r[1, 1])
            quat[row] = [(r[0, 2] + r[2, 0]) / s, (r[1, 2] + r[2, 1]) / s, 0.25 * s, (r[1, 0] - r[0, 1]) / s]
    quat /= np.linalg.norm(quat, axis=1, keepdims=True)
    return quat.reshape(*rot.shape[:-2], 4)


def _poses(xyz: np.ndarray, quat: np.ndarray) -> list[Pose]:
    return [
        Pose(
            position=Point(x=float(p[0]), y=float(p[1]), z=float(p[2])),
            orientation=Quaternion(x=float(q[0]), y=float(q[1]), z=float(q[2]), w=float(q[3])),
        )
        for p, q in zip(xyz, quat)
    ]


def path_message(header: Header, xyz: np.ndarray, rot: np.ndarray, dt_s: float) -> Path:
    """nav_msgs/Path of one sample; waypoint k is stamped t0 + (k+1)*dt."""
    t0_ns = stamp_to_ns(header.stamp)
    step_ns = int(round(dt_s * NS_PER_S))
    poses = _poses(xyz, rotation_to_quaternion(rot))
    return Path(
        header=header,
        poses=[
            PoseStamped(
                header=Header(stamp=ns_to_stamp(t0_ns + (k + 1) * step_ns), frame_id=header.frame_id), pose=pose
            )
            for k, pose in enumerate(poses)
        ],
    )


def trajectory_set_message(
    header: Header, xyz: np.ndarray, rot: np.ndarray, dt_s: float, scores: np.ndarray, selected: int, policy: str
) -> TrajectorySet:
    """Every sample of (S, N, 3)/(S, N, 3, 3) waypoints as an alpamayo_ros_msgs/TrajectorySet."""
    quat = rotation_to_quaternion(rot)
    return TrajectorySet(
        header=header,
        dt_s=float(dt_s),
        horizon_s=float(dt_s * xyz.shape[1]),
        samples=[Trajectory(poses=_poses(x, q)) for x, q in zip(xyz, quat)],
        scores=[float(s) for s in scores],
        selected_index=int(selected),
        selection_policy=policy,
    )


def marker_array_message(
    header: Header, xyz: np.ndarray, selected: int, coc: str, text_position: np.ndarray
) -> MarkerArray:
    """A line strip per sample (selected one wide and green) plus the reasoning as text."""
    markers = [Marker(header=header, action=Marker.DELETEALL)]  # drop lines of a previous, larger plan
    for index, sample in enumerate(xyz):
        chosen = index == selected
        markers.append(
            Marker(
                header=header,
                ns="samples",
                id=index,
                type=Marker.LINE_STRIP,
                action=Marker.ADD,
                pose=Pose(orientation=Quaternion(w=1.0)),
                scale=_scale(0.3 if chosen else 0.12),
                color=ColorRGBA(r=0.1, g=0.9, b=0.2, a=1.0) if chosen else ColorRGBA(r=0.3, g=0.5, b=1.0, a=0.6),
                points=[Point(x=float(p[0]), y=float(p[1]), z=float(p[2])) for p in sample],
            )
        )
    markers.append(
        Marker(
            header=header,
            ns="reasoning",
            id=0,
            type=Marker.TEXT_VIEW_FACING,
            action=Marker.ADD,
            pose=Pose(
                position=Point(x=float(text_position[0]), y=float(text_position[1]), z=float(text_position[2]) + 3.0),
                orientation=Quaternion(w=1.0),
            ),
            scale=_scale(0.5),
            color=ColorRGBA(r=1.0, g=1.0, b=1.0, a=1.0),
            text="\n".join(textwrap.wrap(coc, 60)) or "(no reasoning)",
            frame_locked=True,
        )
    )
    return MarkerArray(markers=markers)


def _scale(size: float) -> Vector3:
    return Vector3(x=size, y=size, z=size)
