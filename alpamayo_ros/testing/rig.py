"""Process-level ROS tests and benchmarks: isolated domains, real processes, topic probes, a sensor rig.

Each test module gets its own ROS_DOMAIN_ID so parallel runs do not see each other. Nodes
under test run as separate processes started from their console scripts with
`--ros-args --params-file`, and are ended with SIGINT (clean DDS shutdown, exit code 0).
The test side runs an rclpy context with a background executor thread.

Over 400 lines: the shared harness of every process-level node test and of bench_node; split,
each test would import from several places what always goes together (domain, side, rig).
"""

from __future__ import annotations

import fcntl
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np
import rclpy
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy

from alpamayo_ros.ros.convert import ns_to_stamp
from alpamayo_ros.rostools.processes import start_console_script, stop_process  # noqa: F401 - the tests' child processes
from alpamayo_ros.settings import write_params_file  # noqa: F401 - the tests' params files

VENV_BIN = Path(sys.executable).parent
MAX_DOMAIN_ID = 101  # ids above may collide with ephemeral ports on Linux
#: How long RosSide.close waits for its spin thread to leave the executor (it may be starved of CPU).
SPIN_EXIT_S = 10.0
# Fast DDS transports must match on both sides: participants with different builtin transports
# may discover each other and still exchange no data. Everything here runs on one host: UDP for
# discovery, shared memory for data, its segment (2 x sockets_size) large enough for several
# full-HD raw frames. Not LARGE_DATA: its discovery runs over TCP, which on a loaded 2-core box
# took 4.6 s instead of 0.9 s to match and, in four CI runs, never matched a node at all.
TRANSPORTS = "DEFAULT?sockets_size=16777216"
_DOMAIN_LOCKS: list = []  # open lock files: a domain stays ours while this process lives


def unique_domain_id() -> int:
    """A ROS domain no other test process on this machine holds (flock'd until this one exits).

    Concurrent test runs must not share a domain: /clock or /diagnostics from another run's
    node would mix into this one's.
    """
    candidates = list(range(1, MAX_DOMAIN_ID + 1))
    random.Random(f"{os.getpid()}-{time.time_ns()}").shuffle(candidates)
    for domain_id in candidates:
        lock = open(Path(tempfile.gettempdir()) / f"alpamayo_ros_test_domain_{domain_id}.lock", "w")  # noqa: SIM115
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        _DOMAIN_LOCKS.append(lock)
        return domain_id
    raise RuntimeError(f"all ROS domains 1..{MAX_DOMAIN_ID} are held by other test processes")


def ros_env(domain_id: int, **extra: str) -> dict[str, str]:
    """Environment for a ROS child process: its domain, large-data transport, unbuffered logs."""
    env = dict(os.environ)
    env.update(
        ROS_DOMAIN_ID=str(domain_id),
        FASTDDS_BUILTIN_TRANSPORTS=TRANSPORTS,
        PYTHONUNBUFFERED="1",
        RCUTILS_LOGGING_BUFFERED_STREAM="0",
        RCUTILS_COLORIZED_OUTPUT="0",
    )
    env.pop("ROS_AUTOMATIC_DISCOVERY_RANGE", None)  # the same discovery on every machine, whatever the shell sets
    env.update(extra)
    return env


def start_python(code: str, *, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Run a Python snippet in the venv interpreter as a separate process."""
    log = open(log_path, "wb")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=subprocess.STDOUT)
    process.log_file = log  # type: ignore[attr-defined]
    return process


def diag_values(msg: Any) -> dict[str, str]:
    """Key-values of the first status of a DiagnosticArray."""
    return {kv.key: kv.value for kv in msg.status[0].values}


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll predicate until true or timeout; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def log_excerpt(path: Path, rig: "SensorRig | None" = None, tail_chars: int = 4000) -> str:
    """A child's log for a failure message: its middleware errors (Fast DDS prints them once, near
    the start, where a tail would cut them off), its tail, and what the rig sent to it."""
    text = path.read_text(errors="replace")
    errors = [line for line in text.splitlines() if " Error]" in line or "RTPS_" in line][:20]
    parts = [*errors, "..."] if errors else []
    parts.append(text[-tail_chars:])
    if rig is not None:
        parts.append(f"rig: {rig.status()}")
    return "\n".join(parts)


class Collector:
    """Thread-safe store of (monotonic receive time, message) from one subscription."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[float, Any]] = []

    def __call__(self, msg: Any) -> None:
        with self._lock:
            self._items.append((time.monotonic(), msg))

    @property
    def messages(self) -> list[Any]:
        with self._lock:
            return [msg for _, msg in self._items]

    def timed(self) -> list[tuple[float, Any]]:
        """(time.monotonic() at receipt, message) pairs."""
        with self._lock:
            return list(self._items)

    def since(self, t_monotonic: float) -> list[Any]:
        """Messages received at or after a time.monotonic() value."""
        with self._lock:
            return [msg for received, msg in self._items if received >= t_monotonic]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class RosSide:
    """The test process's own ROS participant: a context, a node and a spinning executor."""

    def __init__(self, domain_id: int, name: str = "test_side", transports: str = TRANSPORTS) -> None:
        os.environ["FASTDDS_BUILTIN_TRANSPORTS"] = transports  # read when the participant is created
        self.context = Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        self.node = Node(name, context=self.context)
        # not MultiThreadedExecutor: its busy-wait holds the GIL and stalls the rig's thread
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()

    def collect(self, message_type: type, topic: str, qos: QoSProfile | int = 10) -> Collector:
        collector = Collector()
        self.node.create_subscription(message_type, topic, collector, qos)
        return collector

    def reliable(self, depth: int = 10) -> QoSProfile:
        return QoSProfile(depth=depth, reliability=ReliabilityPolicy.RELIABLE)

    def wait_for_publishers(self, topic: str, count: int = 1, timeout_s: float = 20.0) -> bool:
        return wait_until(lambda: self.node.count_publishers(topic) >= count, timeout_s)

    def wait_for_subscribers(self, topic: str, count: int = 1, timeout_s: float = 20.0) -> bool:
        return wait_until(lambda: self.node.count_subscribers(topic) >= count, timeout_s)

    def set_parameters(self, node_name: str, parameters: list[Any], timeout_s: float = 20.0) -> list[Any]:
        """Set parameters on a running node through its parameter service; its per-parameter results."""
        from rclpy.parameter_client import AsyncParameterClient

        client = AsyncParameterClient(self.node, node_name)
        assert client.wait_for_services(timeout_sec=timeout_s), f"{node_name}: no parameter services"
        future = client.set_parameters(parameters)
        assert wait_until(future.done, timeout_s), f"{node_name}: set_parameters unanswered"
        return future.result().results

    def close(self) -> None:
        """Stop spinning, then destroy. The spin thread must have left the executor's wait before
        its node and context go: on a loaded machine it woke more than 2 s after shutdown(), and
        destroying under it hung the process in rcl with the interpreter lock held."""
        self.executor.shutdown(timeout_sec=2.0)
        self._thread.join(timeout=SPIN_EXIT_S)
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


@dataclass
class CameraFeed:
    """One synthetic camera of a SensorRig and the faults it can be told to produce.

    fault: None | "encoding" (raw: unsupported yuv422) | "length" (raw: data shorter than
    step*height) | "truncated_jpeg" (compressed: second half cut off) | "garbage" (compressed).
    """

    index: int
    topic: str
    transport: str  # raw | compressed
    shape: tuple[int, int] = (48, 64)  # (height, width)
    stamp_offset_ns: int = 0
    stopped: bool = False
    fault: str | None = None
    stamps_ns: list[int] = field(default_factory=list)  # every stamp published


class SensorRig:
    """Publishes cameras (10 Hz), odometry (50 Hz) and a route (1 Hz) from a background thread.

    The ego drives straight at speed_mps along heading_rad from (x0, y0) in frame "odom".
    Stamps come from wall time, or from a simulated clock that the rig also publishes on
    /clock (sim_start_s given), for nodes running with use_sim_time.
    """

    CAMERA_PERIOD_NS = 100_000_000
    ODOMETRY_PERIOD_NS = 20_000_000
    CLOCK_PERIOD_NS = 10_000_000

    def __init__(
        self,
        side: RosSide,
        cameras: list[CameraFeed],
        *,
        odometry_topic: str,
        route_topic: str | None = None,
        route_text: str = "Turn right in 30m",
        sim_start_s: float | None = None,
        speed_mps: float = 5.0,
        heading_rad: float = 0.3,
        origin_xy: tuple[float, float] = (100.0, -3.0),
    ) -> None:
        from nav_msgs.msg import Odometry
        from rosgraph_msgs.msg import Clock
        from sensor_msgs.msg import CompressedImage, Image
        from std_msgs.msg import String

        self.cameras = cameras
        self.speed_mps, self.heading_rad, self.origin_xy = speed_mps, heading_rad, origin_xy
        self.route_text = route_text
        self.odometry_stopped = False
        self.odometry_nan = False  # publish NaN positions while set
        self.stamp_offset_ns = 0  # added to every stamp (time going backwards: negative)
        self.odometry_offset_ns = 0  # added to odometry stamps only
        self.odometry_frame_id = "odom"
        self._sim_start_ns = None if sim_start_s is None else int(sim_start_s * 1e9)
        self._sim_jump_ns = 0
        self._mono_start_ns = time.monotonic_ns()
        self._start_ns = self.now_ns()
        self._sensor_qos = QoSProfile(depth=5, reliability=ReliabilityPolicy.BEST_EFFORT)
        self._node = node = side.node
        self._image_types = {"raw": Image, "compressed": CompressedImage}
        self._camera_lock = threading.Lock()  # guards camera publishers (unplug() destroys one) and _sent
        self._camera_pubs = {c.index: self._camera_publisher(c) for c in cameras}
        self._sent: dict[str, tuple[int, float]] = {}  # topic -> (messages published, monotonic time of the last)
        self._odometry_topic = odometry_topic
        self._odometry_pub = node.create_publisher(
            Odometry, odometry_topic, QoSProfile(depth=20, reliability=ReliabilityPolicy.BEST_EFFORT)
        )
        self._route_pub = node.create_publisher(String, route_topic, 1) if route_topic else None
        self._clock_pub = node.create_publisher(Clock, "/clock", 10) if self._sim_start_ns is not None else None
        self._odometry_type, self._clock_type, self._string_type = Odometry, Clock, String
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    # -- time and ground truth --

    def now_ns(self) -> int:
        """The rig's clock: wall time, or the simulated time it publishes on /clock."""
        if self._sim_start_ns is None:
            return time.time_ns()
        return self._sim_start_ns + time.monotonic_ns() - self._mono_start_ns + self._sim_jump_ns

    def clock_at(self, t_monotonic: float) -> int:
        """The rig's clock at an earlier time.monotonic() value (e.g. a message's receipt)."""
        return self.now_ns() - (time.monotonic_ns() - int(t_monotonic * 1e9))

    def jump_clock(self, delta_ns: int) -> None:
        """Move the simulated clock (negative: a bag loop)."""
        self._sim_jump_ns += delta_ns

    def ego_xy(self, stamp_ns: int) -> tuple[float, float]:
        """Ground-truth ego position in the odom frame at a stamp."""
        distance = self.speed_mps * (stamp_ns - self._start_ns) / 1e9
        return (
            self.origin_xy[0] + distance * math.cos(self.heading_rad),
            self.origin_xy[1] + distance * math.sin(self.heading_rad),
        )

    # -- messages --

    def _image_message(self, camera: CameraFeed, stamp_ns: int):
        from std_msgs.msg import Header

        height, width = camera.shape
        pixels = np.full((height, width, 3), (camera.index * 40 + stamp_ns // 100_000_000) % 256, dtype=np.uint8)
        pixels[:, : width // 2, 1] = 200  # some structure, so JPEG has work to do
        header = Header(
            stamp=ns_to_stamp(stamp_ns),
            frame_id=f"camera_{camera.index}",
        )
        if camera.transport == "raw":
            data = pixels.tobytes()
            encoding = "yuv422" if camera.fault == "encoding" else "rgb8"
            if camera.fault == "length":
                data = data[:-7]
            return self._image_types["raw"](
                header=header, height=height, width=width, encoding=encoding, step=width * 3, data=data
            )
        ok, encoded = cv2.imencode(".jpg", cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR))
        data = encoded.tobytes()
        if camera.fault == "truncated_jpeg":
            data = data[: len(data) // 2]
        elif camera.fault == "garbage":
            data = bytes(range(256)) * 4
        return self._image_types["compressed"](header=header, format="jpeg", data=data)

    def _odometry_message(self, stamp_ns: int):
        from geometry_msgs.msg import Quaternion

        msg = self._odometry_type()
        msg.header.stamp = ns_to_stamp(stamp_ns)
        msg.header.frame_id, msg.child_frame_id = self.odometry_frame_id, "base_link"
        x, y = self.ego_xy(stamp_ns)
        if self.odometry_nan:
            x = math.nan
        msg.pose.pose.position.x, msg.pose.pose.position.y = x, y
        msg.pose.pose.orientation = Quaternion(z=math.sin(self.heading_rad / 2), w=math.cos(self.heading_rad / 2))
        msg.twist.twist.linear.x = self.speed_mps
        return msg

    # -- publishers --

    def _camera_publisher(self, camera: CameraFeed):
        return self._node.create_publisher(self._image_types[camera.transport], camera.topic, self._sensor_qos)

    def unplug(self, index: int) -> None:
        """Destroy a camera's publisher: the node's subscription is left with no publisher."""
        with self._camera_lock:
            self._node.destroy_publisher(self._camera_pubs.pop(index))

    def plug(self, index: int) -> None:
        """Create an unplugged camera's publisher again."""
        camera = next(c for c in self.cameras if c.index == index)
        with self._camera_lock:
            self._camera_pubs[index] = self._camera_publisher(camera)

    def matched(self) -> dict[str, int]:
        """Per published sensor topic (plugged cameras, odometry): subscriptions matched."""
        with self._camera_lock:
            pubs = {c.topic: self._camera_pubs[c.index] for c in self.cameras if c.index in self._camera_pubs}
        pubs[self._odometry_topic] = self._odometry_pub
        return {topic: pub.get_subscription_count() for topic, pub in pubs.items()}

    def status(self) -> dict[str, str]:
        """Per published topic: subscriptions matched, messages sent and the age of the last one;
        what a test reports when the node hears nothing (a blocked publish shows as a growing age)."""
        now = time.monotonic()
        matched = self.matched()
        with self._camera_lock:
            sent = dict(self._sent)
        report = {}
        for topic, count_matched in matched.items():
            count, last = sent.get(topic, (0, math.nan))
            report[topic] = f"{count_matched} matched, {count} sent, last {now - last:.1f} s ago"
        return report

    def _count_sent(self, topic: str) -> None:
        """Note a message sent (caller holds _camera_lock)."""
        count, _ = self._sent.get(topic, (0, 0.0))
        self._sent[topic] = (count + 1, time.monotonic())

    # -- thread --

    def start(self) -> "SensorRig":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        next_camera = next_odometry = next_clock = next_route = time.monotonic_ns()
        while not self._stop.is_set():
            mono = time.monotonic_ns()
            now = self.now_ns()
            if self._clock_pub is not None and mono >= next_clock:
                self._clock_pub.publish(
                    self._clock_type(clock=ns_to_stamp(now))
                )
                next_clock = mono + self.CLOCK_PERIOD_NS
            if mono >= next_odometry:
                if not self.odometry_stopped:
                    stamp = now + self.stamp_offset_ns + self.odometry_offset_ns
                    self._odometry_pub.publish(self._odometry_message(stamp))
                    with self._camera_lock:
                        self._count_sent(self._odometry_topic)
                next_odometry += self.ODOMETRY_PERIOD_NS
            if mono >= next_camera:
                for camera in self.cameras:
                    with self._camera_lock:
                        pub = self._camera_pubs.get(camera.index)
                        if camera.stopped or pub is None:
                            continue
                        stamp = now + self.stamp_offset_ns + camera.stamp_offset_ns + camera.index * 2_000_000
                        pub.publish(self._image_message(camera, stamp))
                        self._count_sent(camera.topic)
                    camera.stamps_ns.append(stamp)
                next_camera += self.CAMERA_PERIOD_NS
            if self._route_pub is not None and mono >= next_route:
                self._route_pub.publish(self._string_type(data=self.route_text))
                next_route = mono + 1_000_000_000
            time.sleep(0.002)
