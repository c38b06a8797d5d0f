"""A synthetic drive with a closed-form ego motion, written as a rosbag: test and benchmark data.

A left circle at constant speed, so the evaluator's recorded future, frames and metrics can be
checked against exact numbers (test/test_evaluate.py), and the fleet benchmark has bags to score
without a dataset (bench/bench_fleet.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from alpamayo_ros.eval.bags import TRAJECTORY_SET, BagWriter, register_msgtype

S = 1_000_000_000
T_START = 1_000 * S
DURATION_S = 12.0
RADIUS, SPEED = 60.0, 10.0  # left circle
CAM_TOPICS = ["/test/front/compressed", "/test/left/compressed"]
CAM_INDICES = [1, 0]


def pose_at(t_ns: int) -> tuple[np.ndarray, float]:
    """Analytic ego pose (odometry frame) at absolute time t_ns: a left circle at constant speed."""
    phi = SPEED * (t_ns - T_START) / S / RADIUS
    return np.array([RADIUS * math.sin(phi) + 5.0, RADIUS * (1 - math.cos(phi)) - 2.0, 0.3]), phi


def future_in_t0_frame(t0_ns: int) -> np.ndarray:
    p0, yaw0 = pose_at(t0_ns)
    c, s = math.cos(yaw0), math.sin(yaw0)
    pts = np.stack([pose_at(t0_ns + k * S // 10)[0] for k in range(1, 65)]) - p0
    return np.stack([c * pts[:, 0] + s * pts[:, 1], -s * pts[:, 0] + c * pts[:, 1], pts[:, 2]], -1)


PLAN_T0S = [T_START + k * S for k in (2, 3, 4)]  # camera 0 frame stamps
ROUTE_TOPIC = "/navigation/instruction"  # navigation.topic's default


LAP_LOG_NS = int((DURATION_S + 1) * S)  # a second lap is logged after the first
LAP_STAMP_SHIFT_NS = 3_000_000  # ... with stamps that repeat the first lap's, 3 ms off
LAP_SHIFT_M = 50.0  # ... somewhere else


def write_circle_bag(path: Path, with_plans: bool = False, seed: int = 0, laps: int = 1,
                     routes: tuple[tuple[int, str], ...] = (), *, topics: Sequence[str] = tuple(CAM_TOPICS),
                     duration_s: float = DURATION_S, frames: Sequence[Sequence[np.ndarray]] | None = None) -> Path:
    """12 s on the circle: odometry 50 Hz, two cameras 10 Hz (random pixels of seed); optionally the
    node's plans (TrajectorySet in base_link) that equal the recorded future at PLAN_T0S, a route
    (std_msgs/String on the node's default navigation topic) at each (log time, text), and more
    laps whose stamps loop back (a bag recorded from a looping replay).

    Benchmarks ask for more: other camera topics, a longer drive and their own images (frames[c]
    is cycled on topics[c]; random 32x48 pixels take megabytes per frame as full-HD JPEG)."""
    rng = np.random.default_rng(seed)
    with BagWriter(path, storage="mcap") as w:
        for log_ns, text in routes:
            w.write(ROUTE_TOPIC, "std_msgs/msg/String", log_ns, w.typestore.types["std_msgs/msg/String"](data=text))
        for lap in range(laps):
            for i in range(int(duration_s * 50) + 1):  # odometry 50 Hz, logged 3 ms after capture
                t = T_START + i * S // 50 + lap * LAP_STAMP_SHIFT_NS
                log = t + lap * int((duration_s + 1) * S)  # LAP_LOG_NS at the default duration
                xyz, yaw = pose_at(t)
                xyz[0] += lap * LAP_SHIFT_M
                w.write("/odom", "nav_msgs/msg/Odometry", log + 3_000_000,
                        w.odometry(t, xyz, (0.0, 0.0, math.sin(yaw / 2), math.cos(yaw / 2)), (SPEED, 0, 0), (0, 0, SPEED / RADIUS)))
                if i % 5 == 0:  # cameras 10 Hz, 7 ms apart, logged 20 ms after capture
                    for c, topic in enumerate(topics):
                        if frames is None:
                            img = rng.integers(0, 255, (32, 48, 3), dtype=np.uint8)
                        else:
                            img = frames[c][i // 5 % len(frames[c])]
                        stamp = t + c * 7_000_000
                        w.write(topic, "sensor_msgs/msg/CompressedImage", log + c * 7_000_000 + 20_000_000,
                                w.compressed_image(img, stamp, topic))
        if with_plans:
            ts = w.typestore
            register_msgtype(ts, TRAJECTORY_SET)
            pose, point, quat = ts.types["geometry_msgs/msg/Pose"], ts.types["geometry_msgs/msg/Point"], ts.types["geometry_msgs/msg/Quaternion"]
            for t0 in PLAN_T0S:
                poses = [pose(position=point(x=float(p[0]), y=float(p[1]), z=float(p[2])), orientation=quat(x=0.0, y=0.0, z=0.0, w=1.0))
                         for p in future_in_t0_frame(t0)]
                msg = ts.types[TRAJECTORY_SET](
                    header=w.header(t0, "base_link"), dt_s=0.1, horizon_s=6.4,
                    samples=[ts.types["alpamayo_ros_msgs/msg/Trajectory"](poses=poses)],
                    scores=np.zeros(1, np.float32), selected_index=0, selection_policy="first")
                w.write("/alpamayo_drive/output/trajectories", TRAJECTORY_SET, t0 + 500_000_000, msg)
    return path
