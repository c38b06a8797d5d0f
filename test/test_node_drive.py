"""alpamayo_drive end to end (issue 5 acceptance 1 and 2): a real node process on a tiny
checkpoint, driven by a synthetic rig (2 raw + 2 JPEG cameras, odometry, route) from this
process. One node serves the whole module: first the outputs are checked, then every fault
is injected in turn; each must show up as a diagnostic reason, stop Paths, and leave the
node running.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from nav_msgs.msg import Path as PathMsg
from alpamayo_ros.testing.rig import (
    CameraFeed,
    RosSide,
    SensorRig,
    diag_values,
    log_excerpt,
    ros_env,
    start_console_script,
    stop_process,
    unique_domain_id,
    wait_until,
    write_params_file,
)
from std_msgs.msg import String
from visualization_msgs.msg import Marker, MarkerArray

from alpamayo_ros.inputs.messages import stamp_to_ns
from alpamayo_ros_msgs.msg import Reasoning, StageTimings, TrajectorySet

NODE = "/alpamayo_drive"
ROUTE = "Turn left onto De La Cruz Boulevard in 40m"
FAULT_TIMEOUT_S = 30.0  # a fault is seen at the first idle tick: up to one plan (slow on a busy CI box)


class Harness:
    """The node process plus the test side's rig and output collectors."""

    def __init__(self, tmp: Path, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        self.domain_id = unique_domain_id()
        self.side = RosSide(self.domain_id, "drive_test")
        self.cameras = [
            CameraFeed(0, "/rig/cam_cross_left/compressed", "compressed"),
            CameraFeed(1, "/rig/cam_front/image", "raw"),
            CameraFeed(2, "/rig/cam_cross_right/image", "raw"),
            CameraFeed(6, "/rig/cam_tele/compressed", "compressed"),
        ]
        params = {
            "model.checkpoint_path": str(checkpoint),
            "cameras.topics": [c.topic for c in self.cameras],
            "cameras.indices": [c.index for c in self.cameras],
            "cameras.transports": [c.transport for c in self.cameras],
            "odometry.topic": "/rig/odom",
            "navigation.topic": "/rig/route",
            "output.frame": "odom",
            "sampling.num_samples": 2,
            "sampling.selection": "medoid",
            "sampling.max_reasoning_tokens": 8,
            "sampling.flow_steps": 2,
            "diagnostics.rate_hz": 5.0,
            "cameras.max_age_s": 0.5,  # some slack for a busy CI box; the faults below exceed it
        }
        params_file = write_params_file(tmp / "drive.yaml", params)
        reliable = self.side.reliable(depth=50)
        self.paths = self.side.collect(PathMsg, f"{NODE}/output/path", reliable)
        self.sets = self.side.collect(TrajectorySet, f"{NODE}/output/trajectories", reliable)
        self.reasoning = self.side.collect(Reasoning, f"{NODE}/output/reasoning", reliable)
        self.coc = self.side.collect(String, f"{NODE}/output/coc", reliable)
        self.timings = self.side.collect(StageTimings, f"{NODE}/output/timings", reliable)
        self.markers = self.side.collect(MarkerArray, f"{NODE}/debug/markers", reliable)
        self.diagnostics = self.side.collect(DiagnosticArray, "/diagnostics", reliable)
        self.rig = SensorRig(
            self.side, self.cameras, odometry_topic="/rig/odom", route_topic="/rig/route", route_text=ROUTE
        )
        self.rig.start()
        self.fault_windows: list[tuple[str, int, int]] = []  # (fault, first, last t0 that must not be planned)
        self.log = tmp / "node.log"
        # one torch thread: the node shares 2 cores with this process and the rig
        self.process = start_console_script(
            "alpamayo_drive",
            env=ros_env(self.domain_id, OMP_NUM_THREADS="1"),
            log_path=self.log,
            params_file=params_file,
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return log_excerpt(self.log, self.rig)

    def counter(self, key: str) -> int:
        messages = self.diagnostics.messages
        return int(diag_values(messages[-1]).get(key, 0)) if messages else 0

    def close(self) -> int:
        self.rig.stop()
        code = stop_process(self.process, timeout_s=40)
        self.side.close()
        return code


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path):
    rig = Harness(tmp_path_factory.mktemp("drive"), tiny_checkpoint)
    yield rig
    code = rig.close()
    assert code == 0, f"node exit code {code} after SIGINT\n{rig.log_text()}"


def test_plans_are_published_with_t0_stamp_and_frame(harness: Harness) -> None:
    assert wait_until(lambda: len(harness.paths) >= 2, timeout_s=120), harness.log_text()
    path = harness.paths.messages[-1]
    t0 = stamp_to_ns(path.header.stamp)
    assert len(path.poses) == 64
    assert path.header.frame_id == "odom"  # output.frame odom -> the odometry message's frame
    # t0 is a capture stamp the rig published: the oldest of the cameras' newest stamps
    assert any(t0 in camera.stamps_ns for camera in harness.cameras)
    assert all(stamp_to_ns(pose.header.stamp) == t0 + (k + 1) * 100_000_000 for k, pose in enumerate(path.poses))
    # odom frame: the plan starts at the ego's ground-truth position at t0, ~0.5 m ahead at 5 m/s
    ego_x, ego_y = harness.rig.ego_xy(t0)
    first = path.poses[0].pose.position
    ahead = (first.x - ego_x) * math.cos(0.3) + (first.y - ego_y) * math.sin(0.3)
    assert math.hypot(first.x - ego_x, first.y - ego_y) < 2.0 and ahead > 0.0

    # companions of that Path (published before it) carry the same t0 and frame
    matching = [m for m in harness.sets.messages if stamp_to_ns(m.header.stamp) == t0]
    assert matching, "no TrajectorySet for the Path's t0"
    trajectory_set = matching[0]
    assert trajectory_set.header.frame_id == "odom" and len(trajectory_set.samples) == 2
    assert all(len(sample.poses) == 64 for sample in trajectory_set.samples)
    assert trajectory_set.selection_policy == "medoid" and trajectory_set.selected_index in (0, 1)
    assert len(trajectory_set.scores) == 2 and trajectory_set.horizon_s == pytest.approx(6.4)
    selected = trajectory_set.samples[trajectory_set.selected_index].poses
    assert [p.position.x for p in selected] == pytest.approx([p.pose.position.x for p in path.poses])
    reasoning = [m for m in harness.reasoning.messages if stamp_to_ns(m.header.stamp) == t0][0]
    assert reasoning.navigation_command == ROUTE and reasoning.backend == "hf"
    assert reasoning.model_id == harness.checkpoint.name and len(reasoning.sample_cocs) == 2
    assert 1 <= reasoning.generated_tokens <= 8
    markers = [m for m in harness.markers.messages if m.markers and stamp_to_ns(m.markers[-1].header.stamp) == t0][0]
    kinds = [marker.type for marker in markers.markers if marker.action == Marker.ADD]
    assert kinds.count(Marker.LINE_STRIP) == 2 and kinds.count(Marker.TEXT_VIEW_FACING) == 1
    assert markers.markers[0].action == Marker.DELETEALL
    timings = [m for m in harness.timings.messages if stamp_to_ns(m.header.stamp) == t0][0]
    assert {"preprocess", "backbone", "expert", "total"} <= set(timings.stage_names)
    assert timings.latency_ms >= timings.input_age_ms >= 0.0
    assert len(harness.coc) >= 1

    # diagnostics: not ready while loading / warming up, ready and OK once planning
    states = [diag_values(m) for m in harness.diagnostics.messages]
    first_ready = next(i for i, values in enumerate(states) if values["ready"] == "true")
    assert any(values["state"] in ("loading", "warming_up") for values in states[:first_ready]), states[:3]
    # a plan's diagnostics go out after its Path: the newest received may not count the last Path yet
    def ok_after_two_plans() -> bool:
        newest = harness.diagnostics.messages[-1]
        return newest.status[0].level == DiagnosticStatus.OK and int(diag_values(newest)["plans"]) >= 2

    assert wait_until(ok_after_two_plans, 20), states[-3:]
    latest = diag_values(harness.diagnostics.messages[-1])
    assert int(latest["plans"]) >= 2 and latest["backend"] == "hf"
    assert float(latest["camera_age_ms.0"]) >= 0.0 and float(latest["stage_ms.total"]) > 0.0


def _faults() -> list[tuple[str, str, str, Callable[[Harness], None], Callable[[Harness], None], float]]:
    """(name, counter key, text expected in the reason, inject, restore, t0 slack s)."""

    def camera(index: int) -> Callable[[Harness], CameraFeed]:
        return lambda h: next(c for c in h.cameras if c.index == index)

    def set_attr(getter, name: str, value: Any) -> Callable[[Harness], None]:
        return lambda h: setattr(getter(h), name, value)

    rig = lambda h: h.rig  # noqa: E731
    all_shapes = lambda shape: lambda h: [setattr(c, "shape", shape) for c in h.cameras]  # noqa: E731
    return [
        ("camera stops", "rejected.camera_stale", "camera 2: newest frame is", set_attr(camera(2), "stopped", True), set_attr(camera(2), "stopped", False), 0.05),
        ("camera skewed", "rejected.camera_skew", "camera 6 lags", set_attr(camera(6), "stamp_offset_ns", -200_000_000),
         set_attr(camera(6), "stamp_offset_ns", 0), 0.05),
        ("unsupported encoding", "rejected.unsupported_encoding", "camera 1 (/rig/cam_front/image): encoding 'yuv422'",
         set_attr(camera(1), "fault", "encoding"), set_attr(camera(1), "fault", None), 0.0),
        ("data length mismatch", "rejected.bad_data_length", "camera 2 (/rig/cam_cross_right/image)",
         set_attr(camera(2), "fault", "length"), set_attr(camera(2), "fault", None), 0.0),
        ("corrupt JPEG", "rejected.corrupt_image", "camera 0 (/rig/cam_cross_left/compressed): truncated JPEG",
         set_attr(camera(0), "fault", "truncated_jpeg"), set_attr(camera(0), "fault", None), 0.0),
        ("stale odometry", "rejected.odometry_stale", "older than t0", set_attr(rig, "odometry_stopped", True),
         set_attr(rig, "odometry_stopped", False), 0.15),
        ("model exception", "rejected.model_error", "aspect ratio", all_shapes((2, 402)), all_shapes((48, 64)), 0.0),
        ("NaN odometry", "rejected.odometry_nonfinite", "non-finite odometry", set_attr(rig, "odometry_nan", True),
         set_attr(rig, "odometry_nan", False), 0.0),
        ("time going backwards", "rejected.time_backwards", "went back", set_attr(rig, "stamp_offset_ns", -5_000_000_000),
         set_attr(rig, "stamp_offset_ns", 0), 0.0),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "counter", "expected", "inject", "restore", "slack_s"), _faults(), ids=[f[0] for f in _faults()]
)
def test_fault_is_reported_without_path_and_node_survives(
    harness: Harness, name: str, counter: str, expected: str, inject, restore, slack_s: float
) -> None:
    assert wait_until(lambda: len(harness.paths) >= 1, timeout_s=120), harness.log_text()
    before = harness.counter(counter)
    started_mono = time.monotonic()
    started_ns = harness.rig.now_ns()

    def reports() -> list[str]:
        return [
            f"{v['last_rejection']} | {v['last_error']}"
            for v in map(diag_values, harness.diagnostics.since(started_mono))
        ]

    inject(harness)
    try:
        # the fault's own reason must be reported (a busy machine can add unrelated ones)
        seen = wait_until(
            lambda: harness.counter(counter) > before and any(expected in text for text in reports()),
            timeout_s=FAULT_TIMEOUT_S,
        )
    finally:
        ended_ns = harness.rig.now_ns()
        restore(harness)
    assert (
        seen
    ), f"{name}: {counter} {before} -> {harness.counter(counter)}, reports {reports()[-3:]}\n{harness.log_text()}"
    if counter == "rejected.model_error":
        assert any(m.status[0].level == DiagnosticStatus.ERROR for m in harness.diagnostics.since(started_mono))
    window_start = started_ns + int(slack_s * 1e9)
    if counter == "rejected.odometry_nonfinite":
        ended_ns += 1_400_000_000  # a NaN sample poisons every history window that holds it
        assert wait_until(lambda: harness.rig.now_ns() > ended_ns + 500_000_000, timeout_s=5)
    harness.fault_windows.append((name, window_start, ended_ns))
    planned = [stamp_to_ns(p.header.stamp) for p in harness.paths.since(started_mono)]
    assert not [t0 for t0 in planned if window_start < t0 <= ended_ns], f"{name}: a Path was planned from faulty input"
    assert harness.alive(), harness.log_text()


def test_node_recovers_after_all_faults(harness: Harness) -> None:
    resumed_ns = harness.rig.now_ns()
    recovered = wait_until(
        lambda: any(stamp_to_ns(p.header.stamp) > resumed_ns for p in harness.paths.messages), timeout_s=60
    )
    assert recovered, harness.log_text()
    assert harness.alive()
    # plans run one at a time and the Path is published last, so every plan started during a
    # fault has been received by now: none may carry a t0 from inside a fault window
    planned = [stamp_to_ns(p.header.stamp) for p in harness.paths.messages]
    for name, first, last in harness.fault_windows:
        assert not [t0 for t0 in planned if first < t0 <= last], f"{name}: a Path was planned from faulty input"
    assert len(harness.fault_windows) == len(_faults())
