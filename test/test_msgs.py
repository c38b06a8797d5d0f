"""alpamayo_ros_msgs: every custom message crosses a process boundary with its fields intact."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from alpamayo_ros.testing.rig import RosSide, ros_env, start_python, stop_process, unique_domain_id, wait_until

from alpamayo_ros_msgs.msg import Reasoning, StageTimings, Trajectory, TrajectorySet

# The publisher process builds the same messages from this code, so both sides agree on values.
BUILD_MESSAGES = textwrap.dedent("""
    from builtin_interfaces.msg import Time
    from geometry_msgs.msg import Point, Pose, Quaternion
    from std_msgs.msg import Header
    from alpamayo_ros_msgs.msg import Reasoning, StageTimings, Trajectory, TrajectorySet

    def build():
        header = Header(stamp=Time(sec=1712, nanosec=345000000), frame_id="base_link")
        def pose(k, s):
            return Pose(position=Point(x=0.5 * k + s, y=-0.25 * k, z=0.01),
                        orientation=Quaternion(x=0.0, y=0.0, z=0.1 * s, w=1.0))
        samples = [Trajectory(poses=[pose(k, s) for k in range(64)]) for s in range(3)]
        return {
            "trajectory": samples[1],
            "trajectory_set": TrajectorySet(header=header, dt_s=0.125, horizon_s=8.0, samples=samples,
                                            scores=[3.5, 1.25, 2.0], selected_index=1, selection_policy="medoid"),
            "reasoning": Reasoning(header=header, coc="Slow down: a pedestrian is crossing ahead.",
                                   sample_cocs=["a", "Slow down: a pedestrian is crossing ahead.", "ü ✓"],
                                   closed=True, sample_closed=[False, True, True],
                                   navigation_command="Turn right in 30m", backend="vllm",
                                   model_id="Alpamayo-1.5-10B", generated_tokens=37),
            "timings": StageTimings(header=header, stage_names=["preprocess", "backbone", "expert"],
                                    stage_ms=[12.5, 230.0, 41.75], input_age_ms=35.5, latency_ms=310.25,
                                    overruns=4, drafted_tokens=57, accepted_tokens=41),
        }
    """)
TOPICS = {"trajectory": Trajectory, "trajectory_set": TrajectorySet, "reasoning": Reasoning, "timings": StageTimings}

PUBLISHER = BUILD_MESSAGES + textwrap.dedent("""
    import rclpy
    from rclpy.executors import ExternalShutdownException
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    try:
        with rclpy.init():
            node = rclpy.create_node("msgs_publisher")
            messages = build()
            qos = QoSProfile(depth=5, reliability=ReliabilityPolicy.RELIABLE)
            publishers = {name: node.create_publisher(type(msg), "/msgs_test/" + name, qos) for name, msg in messages.items()}
            def tick():
                for name, msg in messages.items():
                    publishers[name].publish(msg)
            node.create_timer(0.1, tick)
            rclpy.spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    """)


def expected_messages() -> dict:
    namespace: dict = {}
    exec(BUILD_MESSAGES, namespace)  # noqa: S102 - our own constant, shared with the publisher
    return namespace["build"]()


def test_import_without_sourcing() -> None:
    env = {key: value for key, value in ros_env(0).items() if not key.startswith(("AMENT_", "COLCON_"))}
    env.pop("LD_LIBRARY_PATH", None)
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", "import alpamayo_ros_msgs.msg as m; print(m.TrajectorySet.__name__)"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "TrajectorySet"


def test_every_message_crosses_processes_intact(tmp_path: Path) -> None:
    domain_id = unique_domain_id()
    side = RosSide(domain_id, "msgs_listener")
    collectors = {name: side.collect(cls, f"/msgs_test/{name}", side.reliable()) for name, cls in TOPICS.items()}
    publisher = start_python(PUBLISHER, env=ros_env(domain_id), log_path=tmp_path / "publisher.log")
    try:
        received = wait_until(lambda: all(len(c) > 0 for c in collectors.values()), timeout_s=30)
        assert publisher.poll() is None, (tmp_path / "publisher.log").read_text()
        assert received, {name: len(c) for name, c in collectors.items()}
    finally:
        rc = stop_process(publisher)
        side.close()
    assert rc == 0, (tmp_path / "publisher.log").read_text()
    expected = expected_messages()
    for name, collector in collectors.items():
        got = collector.messages[0]
        assert got == expected[name], name  # generated __eq__ compares every field

    # spot checks beyond __eq__ (float32 fields hold values exact in float32): stamps, nesting, float32 arrays, unicode
    trajectory_set = collectors["trajectory_set"].messages[0]
    assert trajectory_set.header.stamp.sec == 1712 and trajectory_set.header.stamp.nanosec == 345000000
    assert len(trajectory_set.samples) == 3 and all(len(s.poses) == 64 for s in trajectory_set.samples)
    assert trajectory_set.samples[2].poses[10].position.x == pytest.approx(7.0)
    assert list(trajectory_set.scores) == [3.5, 1.25, 2.0]
    reasoning = collectors["reasoning"].messages[0]
    assert reasoning.sample_cocs[2] == "ü ✓" and reasoning.generated_tokens == 37
    assert reasoning.closed and list(reasoning.sample_closed) == [False, True, True]
    timings = collectors["timings"].messages[0]
    assert list(timings.stage_ms) == [12.5, 230.0, 41.75]
    assert (timings.drafted_tokens, timings.accepted_tokens) == (57, 41)
