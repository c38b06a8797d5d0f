"""The demo's ROS side: a synthetic road rendered for a few cameras, published with odometry and
/clock, and the closed loop that moves the ego vehicle along the drive node's plans, in lockstep
(simulated time holds at every planning tick until that tick's plan arrives) or free-running.
Everything it publishes, and everything the node answers, is recorded to the bag it is given.
"""

from __future__ import annotations

import logging
import math
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import cv2
import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from nav_msgs.msg import Odometry
from rclpy.duration import Duration
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rclpy.serialization import deserialize_message, serialize_message
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import CompressedImage

from alpamayo_ros.core.types import CAMERAS, NUM_WAYPOINTS, WAYPOINT_DT_S
from alpamayo_ros.eval.bags import COMPRESSED_IMAGE, ODOMETRY, BagWriter
from alpamayo_ros.rostools.record import Recorder
from alpamayo_ros.eval.scene import PinholeCamera, Pose2D, Renderer, Road, Vehicle
from alpamayo_ros.inputs.messages import stamp_to_ns
from alpamayo_ros.ros.convert import ns_to_stamp
from alpamayo_ros_msgs.msg import TrajectorySet

logger = logging.getLogger(__name__)

NODE = "alpamayo_drive"
TRAJECTORIES = f"/{NODE}/output/trajectories"
NODE_OUTPUTS = [TRAJECTORIES, f"/{NODE}/output/path", f"/{NODE}/output/reasoning", f"/{NODE}/output/timings",
                f"/{NODE}/debug/markers", "/diagnostics"]
ODOM = "/odom"
NS = 1_000_000_000
MIN_SPEED_MPS = 2.0  # a random plan that stops would otherwise end the drive for good
STEP_NS = 20_000_000  # odometry at 50 Hz
FRAME_EVERY = 5  # camera frames at 10 Hz
# Simulated time starts here (0 would look like an unset clock); the 50 ms offset keeps camera
# frames between the node's planning ticks, which fall on whole periods of simulated time.
SIM_START_NS = 1_000 * NS + 50_000_000
# Lockstep waits at every tick from the first one that can plan: its newest frame (frames every
# 0.1 s from the drive's start, odometry every 20 ms) has 1.5 s of odometry before it. Earlier
# ticks are rejected (history_short); a plannable tick left unwaited would still be planning at
# the next tick, which the node then skips.
FIRST_PLANNABLE_FRAME_NS = 1_600_000_000
# Lockstep: the node takes every sensor message the scene sends (reliable; queues that hold
# 10 s of frames and 20 s of odometry), so what it plans from never depends on timing.
LOCKSTEP_QOS = {"qos.cameras.reliability": "reliable", "qos.cameras.depth": 100,
                "qos.odometry.reliability": "reliable", "qos.odometry.depth": 1000}
ACK_TIMEOUT_S = 60.0  # lockstep: hang guard for the node acknowledging the sensors of a tick


@dataclass
class DemoOptions:
    out: Path
    checkpoint: Path | None = None
    duration_s: float = 20.0  # simulated seconds of driving after the node is ready
    rate_hz: float = 1.0  # planning rate
    width: int = 256
    height: int = 144
    max_reasoning_tokens: int = 8
    cameras: int = 3  # front, front-left, front-right; fewer = faster CPU plans
    speed_mps: float = 8.0
    plan_timeout_s: float = 15.0  # free-running: wall seconds to wait for the node before moving on without a plan
    ready_timeout_s: float = 300.0
    lockstep: bool = True  # the world waits for the plan of every planning tick: same seed, same drive
    lockstep_timeout_s: float = 600.0  # lockstep: a plan slower than this is a hang (the demo fails)
    extra_params: dict[str, Any] = field(default_factory=dict)


def camera_topic(cam: PinholeCamera) -> str:
    return f"/demo/{cam.name}/image/compressed"


class PlanFollower:
    """Maps the newest plan (t0 ego frame) into the world with the logged pose at t0."""

    def __init__(self) -> None:
        self.poses: dict[int, Pose2D] = {}
        self.plan_t0: int | None = None
        self.plan_world: np.ndarray | None = None  # (65, 2): pose at t0, then the 64 waypoints
        self.world_plans: list[np.ndarray] = []

    def log_pose(self, t_ns: int, pose: Pose2D) -> None:
        self.poses[t_ns] = Pose2D(pose.x, pose.y, pose.yaw)

    def accept(self, msg: TrajectorySet) -> None:
        t0 = stamp_to_ns(msg.header.stamp)
        if not msg.samples or not self.poses or (self.plan_t0 is not None and t0 <= self.plan_t0):
            return
        pose = self.poses.get(t0) or self.poses[min(self.poses, key=lambda t: abs(t - t0))]
        sample = msg.samples[max(msg.selected_index, 0)]
        local = np.array([[p.position.x, p.position.y] for p in sample.poses])
        self.plan_t0 = t0
        self.plan_world = np.vstack([pose.xy, pose.to_world(local)])
        self.world_plans.append(self.plan_world)

    def target(self, t_ns: int) -> np.ndarray | None:
        """Planned world position at time t_ns, or None when no plan covers it."""
        if self.plan_world is None or self.plan_t0 is None:
            return None
        tau = (t_ns - self.plan_t0) / NS
        times = np.arange(NUM_WAYPOINTS + 1) * WAYPOINT_DT_S
        if tau < 0 or tau > times[-1]:
            return None
        return np.array([np.interp(tau, times, self.plan_world[:, 0]), np.interp(tau, times, self.plan_world[:, 1])])


class DriveOutputs:
    """The bag writer for the node's outputs: diagnostics published before the drive started
    (the model load's, stamped at the held start time) stay out, judged by their stamp and not
    by when they arrive, so the recording holds the same messages on every run."""

    def __init__(self, writer: BagWriter, start_ns: int) -> None:
        self.writer, self.start_ns = writer, start_ns

    def write_raw(self, topic: str, msgtype: str, log_time_ns: int, raw: bytes) -> None:
        if topic == "/diagnostics" and stamp_to_ns(deserialize_message(raw, DiagnosticArray).header.stamp) <= self.start_ns:
            return
        self.writer.write_raw(topic, msgtype, log_time_ns, raw)


class DemoScene:
    """The demo's ROS side: publishes the world, listens to the node, records everything."""

    def __init__(self, opts: DemoOptions, rig: Sequence[PinholeCamera], writer: BagWriter) -> None:
        self.opts, self.rig = opts, rig
        self.rig_by_index = {c.index: c for c in rig}
        self.road = Road.winding()
        self.renderer = Renderer(self.road, tuple(rig))
        self.vehicle = Vehicle.on_road(self.road, speed=opts.speed_mps)
        self.vehicle.min_speed = MIN_SPEED_MPS
        self.follower = PlanFollower()
        self.sim_ns = SIM_START_NS
        self.node = rclpy.create_node("alpamayo_demo_scene")
        # reliable: matches the node's best-effort subscriptions and the reliable recorder alike
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.camera_pubs = {c.index: self.node.create_publisher(CompressedImage, camera_topic(c), reliable) for c in rig}
        self.odom_pub = self.node.create_publisher(Odometry, ODOM, reliable)
        self.clock_pub = self.node.create_publisher(Clock, "/clock", 10)
        self.node.create_subscription(TrajectorySet, TRAJECTORIES, self.follower.accept, reliable)
        self.ready = False
        self.node_state = "not started"
        self.handled = 0
        self.node_plans = 0  # plans the node reports published
        self.refused = 0  # ticks the node refused so far: rejected inputs, gated or failed plans, repeated t0s
        # lockstep: (node clock, refused) of every diagnostics message since the drive started, in order
        self.refusals: list[tuple[int, int]] = []
        self.expected_refusals = 0  # lockstep: refusals the node reported before the tick awaited now
        self.newest_frame_ns: int | None = None
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, reliable)
        # The scene's own sensors go into the bag at their simulated time, exactly; the node's outputs
        # are recorded as they arrive. Both start with the drive, not during the model load.
        self.writer, self.recording = writer, False
        self.recorder = Recorder(self.node, DriveOutputs(writer, SIM_START_NS), NODE_OUTPUTS, clock=lambda: self.sim_ns)
        self.recorder.active = False
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self.plans_waited_out = 0  # waits that ended by timeout
        self.longest_plan_wait_s: float | None = None

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        for status in msg.status:
            values = {kv.key: kv.value for kv in status.values}
            if "state" in values:
                self.node_state = values["state"]
                self.ready = values["state"] == "ready"
                # ticks the node has finished with: planned, rejected (any reason) or repeated
                self.handled = sum(int(v) for k, v in values.items()
                                   if k in ("plans", "repeated_t0") or k.startswith("rejected."))
                self.node_plans = int(values.get("plans", 0))
                self.refused = self.handled - self.node_plans
                self.refusals.append((stamp_to_ns(msg.header.stamp), self.refused))

    def spin(self, seconds: float) -> None:
        """Process callbacks for about `seconds` of wall time."""
        deadline = time.monotonic() + seconds
        while True:
            self.executor.spin_once(timeout_sec=max(0.0, min(0.01, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                return

    def publish_clock(self) -> None:
        msg = Clock()
        msg.clock = ns_to_stamp(self.sim_ns)
        self.clock_pub.publish(msg)

    def publish_state(self, step: int, yaw_rate: float) -> None:
        pose, stamp = self.vehicle.pose, ns_to_stamp(self.sim_ns)
        odom = Odometry()
        odom.header.stamp, odom.header.frame_id, odom.child_frame_id = stamp, "odom", "base_link"
        odom.pose.pose.position.x, odom.pose.pose.position.y = pose.x, pose.y
        odom.pose.pose.orientation.z, odom.pose.pose.orientation.w = math.sin(pose.yaw / 2), math.cos(pose.yaw / 2)
        odom.twist.twist.linear.x, odom.twist.twist.angular.z = self.vehicle.speed, yaw_rate
        self.odom_pub.publish(odom)
        self._record(ODOM, ODOMETRY, odom)
        if step % FRAME_EVERY == 0:
            self.newest_frame_ns = self.sim_ns
            for index, image in self.renderer.render_rig(pose).items():
                msg = CompressedImage()
                msg.header.stamp, msg.header.frame_id, msg.format = stamp, CAMERAS[index][0], "jpeg"
                msg.data = _jpeg(image)
                self.camera_pubs[index].publish(msg)
                self._record(camera_topic(self.rig_by_index[index]), COMPRESSED_IMAGE, msg)

    def _record(self, topic: str, msgtype: str, msg: Any) -> None:
        if self.recording:
            self.writer.write_raw(topic, msgtype, self.sim_ns, serialize_message(msg))

    def start_recording(self) -> None:
        """Sensors from now on; node outputs from the next step on, so the bag starts with a sensor."""
        self.recording = True

    def wait_until_ready(self, node_process: subprocess.Popen) -> None:
        """Hold the clock at the start (no sensors) until the node reports ready: the drive then
        starts at the same simulated time whatever the model's load time."""
        deadline = time.monotonic() + self.opts.ready_timeout_s
        while not self.ready:
            if node_process.poll() is not None:
                raise RuntimeError(f"drive node exited with code {node_process.returncode} before it was ready")
            if time.monotonic() > deadline or self.node_state == "failed":
                raise RuntimeError(f"drive node not ready after {self.opts.ready_timeout_s:.0f} s (state: {self.node_state})")
            self.publish_clock()
            self.spin(0.1)

    def step_world(self, step: int) -> None:
        """Move the vehicle one step along the newest plan (or cruise) and publish its sensors."""
        dt = STEP_NS / NS
        yaw_before = self.vehicle.pose.yaw
        target = self.follower.target(self.sim_ns + STEP_NS)
        if target is None:
            self.vehicle.cruise(dt)
        else:
            self.vehicle.follow(target, dt)
        self.sim_ns += STEP_NS
        self.follower.log_pose(self.sim_ns, self.vehicle.pose)
        turned = (self.vehicle.pose.yaw - yaw_before + math.pi) % (2 * math.pi) - math.pi
        self.publish_state(step, turned / dt)

    def drive_lockstep(self, node_process: subprocess.Popen) -> None:
        """The closed loop in lockstep: simulated time stops at every planning tick that can plan
        until that tick's plan arrives, so the drive does not depend on how fast the node is.

        The drive starts at SIM_START_NS, 50 ms past a whole second, so camera frames fall between the
        node's ticks, which lie on whole periods of simulated time. Before the clock passes a
        tick, the node has acknowledged every sensor message sent so far (reliable QoS): they sit
        in its queues before the clock message does, and its executor takes them before the
        tick's timer, so every tick plans from the newest frame, which the wait then expects.
        """
        period_ns = int(NS / self.opts.rate_hz)
        start_ns = self.sim_ns  # SIM_START_NS: the clock was held there until the node was ready
        self.follower.log_pose(start_ns, self.vehicle.pose)
        self.start_recording()
        self.expected_refusals = self.refused  # the node's count when the drive starts
        first_plan_ns = start_ns + FIRST_PLANNABLE_FRAME_NS + 1  # ticks after that frame can plan
        next_tick = start_ns - start_ns % period_ns + period_ns
        wall0 = time.monotonic()
        step = 0
        while self.sim_ns - start_ns < self.opts.duration_s * NS:
            if node_process.poll() is not None:
                raise RuntimeError(f"drive node exited with code {node_process.returncode} while driving")
            step += 1
            self.step_world(step)
            self.recorder.active = True
            if self.sim_ns >= next_tick:
                self._await_sensor_acks()
            if self.sim_ns >= next_tick and next_tick >= first_plan_ns:
                self._await_plan(next_tick, node_process)
                wall0 = time.monotonic() - (self.sim_ns - start_ns) / NS
            else:
                if self.sim_ns >= next_tick:
                    self.expected_refusals += 1  # too early to plan: refused (history_short)
                self.publish_clock()
            if self.sim_ns >= next_tick:
                next_tick += period_ns
            self.spin(max(0.0, (self.sim_ns - start_ns) / NS - (time.monotonic() - wall0)))  # at most real time

    def _await_sensor_acks(self) -> None:
        """Block until the node has received every sensor message sent so far (lockstep)."""
        timeout = Duration(seconds=ACK_TIMEOUT_S)
        for topic, publisher in [(ODOM, self.odom_pub), *((camera_topic(self.rig_by_index[i]), p)
                                                          for i, p in self.camera_pubs.items())]:
            if not publisher.wait_for_all_acked(timeout):
                raise RuntimeError(f"lockstep: the drive node did not acknowledge {topic} within {ACK_TIMEOUT_S:.0f} s")

    def _refused_since(self, tick_ns: int) -> bool:
        """The node's diagnostics, stamped with its clock, count a refusal beyond those expected
        before the tick at tick_ns: the node refused that tick (its inputs, or its plan at the gate)."""
        return any(stamp >= tick_ns and refused > self.expected_refusals for stamp, refused in self.refusals)

    def _await_plan(self, tick_ns: int, node_process: subprocess.Popen) -> None:
        """Pass the clock over the tick, then hold it until the node has planned from the newest
        frame (or refused the tick); a plan for any other t0 means the lockstep broke."""
        expected_t0 = self.newest_frame_ns
        started = last_clock = time.monotonic()
        self.publish_clock()
        while self.follower.plan_t0 != expected_t0 and not self._refused_since(tick_ns):
            if not rclpy.ok():
                raise ExternalShutdownException()
            if node_process.poll() is not None:
                raise RuntimeError(f"drive node exited with code {node_process.returncode} while planning")
            if self.follower.plan_t0 is not None and expected_t0 is not None and self.follower.plan_t0 > expected_t0:
                raise RuntimeError(f"lockstep: the node planned for t0 {self.follower.plan_t0 / NS:.2f} s at the tick "
                                   f"at {tick_ns / NS:.2f} s; expected its newest frame, {expected_t0 / NS:.2f} s")
            if time.monotonic() - started > self.opts.lockstep_timeout_s:
                raise RuntimeError(f"lockstep: no plan for the tick at {tick_ns / NS:.2f} s within "
                                   f"{self.opts.lockstep_timeout_s:.0f} s (node state: {self.node_state})")
            if time.monotonic() - last_clock > 1.0:  # a held clock, as a simulator keeps publishing it
                self.publish_clock()
                last_clock = time.monotonic()
            self.spin(0.02)
        self.longest_plan_wait_s = max(self.longest_plan_wait_s or 0.0, time.monotonic() - started)
        if self.follower.plan_t0 != expected_t0:
            self.expected_refusals += 1
            logger.warning("lockstep: the node refused the tick at %.2f s (see its diagnostics); driving on", tick_ns / NS)

    def await_companions(self) -> None:
        """Lockstep: every followed plan's other outputs, and the diagnostics counting it, are
        recorded before the recording closes."""
        plans = len(self.follower.world_plans)
        outputs = [t for t in NODE_OUTPUTS if t not in (TRAJECTORIES, "/diagnostics")]
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while self.node_plans < plans or any(self.recorder.counts.get(t, 0) < plans for t in outputs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"lockstep: the outputs of {plans} plans did not all arrive within {ACK_TIMEOUT_S:.0f} s "
                                   f"(recorded {dict(self.recorder.counts)})")
            self.spin(0.05)

    def drive(self, node_process: subprocess.Popen) -> None:
        """Free-running closed loop: step the world, publish, follow plans, wait (bounded) for a lagging node."""
        # Pause at most this far past the newest plan's t0, which is just after the next planning
        # tick: the node then plans with the world paused, so no sensor data piles up meanwhile.
        period_ns = int(NS / self.opts.rate_hz)
        lead_ns = period_ns + 150_000_000
        start_ns = self.sim_ns
        reference = start_ns + 2 * NS - lead_ns  # the first plan needs 1.5 s of history
        wall0 = time.monotonic()
        step = 0
        while self.sim_ns - start_ns < self.opts.duration_s * NS:
            if node_process.poll() is not None:
                raise RuntimeError(f"drive node exited with code {node_process.returncode} while driving")
            if self.sim_ns - max(self.follower.plan_t0 or 0, reference) > lead_ns:
                if not self._wait_for_node():
                    reference = self.sim_ns - (lead_ns - period_ns)  # no plan this tick: next pause one period on
                wall0 = time.monotonic() - (self.sim_ns - start_ns) / NS  # do not sprint to catch up
            step += 1
            self.step_world(step)
            self.publish_clock()  # after the sensors, so a tick at this time finds them sent
            ahead = (self.sim_ns - start_ns) / NS - (time.monotonic() - wall0)
            self.spin(max(0.0, ahead))  # at most real time

    def _wait_for_node(self) -> bool:
        """Block (simulated time paused) until the node publishes a plan (True) or reports a
        finished tick without one, or a timeout passes (False). The timeout is plan_timeout_s
        until the first plan, then twice the longest wait that a plan ended (at least 3 s)."""
        plan_before, handled_before = self.follower.plan_t0, self.handled
        started = time.monotonic()
        timeout = self.opts.plan_timeout_s if self.longest_plan_wait_s is None else max(3.0, 2 * self.longest_plan_wait_s)
        while self.follower.plan_t0 == plan_before and self.handled == handled_before:
            if time.monotonic() - started > timeout:
                self.plans_waited_out += 1
                return False
            self.spin(0.05)
        if self.follower.plan_t0 == plan_before:
            return False
        self.longest_plan_wait_s = max(self.longest_plan_wait_s or 0.0, time.monotonic() - started)
        return True

    def summary(self, started_monotonic: float) -> dict[str, Any]:
        return {"plans_followed": len(self.follower.world_plans), "clamped_steps": self.vehicle.clamped_steps,
                "plans_waited_out": self.plans_waited_out,
                "lockstep": self.opts.lockstep,
                "node_state": self.node_state, "drive_wall_s": time.monotonic() - started_monotonic}

    def driven_xy(self) -> np.ndarray:
        """(N, 2) world positions of the ego vehicle, in time order."""
        return np.array([[p.x, p.y] for _, p in sorted(self.follower.poses.items())])

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()


def _jpeg(rgb: np.ndarray) -> bytes:
    ok, data = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 90])
    if not ok:
        raise ValueError(f"rgb: JPEG encoding failed for shape {rgb.shape}")
    return data.tobytes()

