"""Helpers for process-level ROS tests: isolated domains, real processes, topic probes.

Each test module gets its own ROS_DOMAIN_ID so parallel runs do not see each other. Nodes
under test run as separate processes started from their console scripts with
`--ros-args --params-file`, and are ended with SIGINT (clean DDS shutdown, exit code 0).
The test side runs an rclpy context with a background executor thread.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import rclpy
import yaml
from rclpy.context import Context
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy

VENV_BIN = Path(sys.executable).parent
MAX_DOMAIN_ID = 101  # ids above may collide with ephemeral ports on Linux
# Fast DDS transports must match on both sides: a LARGE_DATA participant and a default one
# discover each other but exchange no data. LARGE_DATA keeps big best-effort images intact.
TRANSPORTS = "LARGE_DATA"


def unique_domain_id() -> int:
    """A domain id unlikely to be used by another test process on this machine."""
    return random.Random(f"{os.getpid()}-{time.time_ns()}").randint(1, MAX_DOMAIN_ID)


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
    env.pop("ROS_AUTOMATIC_DISCOVERY_RANGE", None)  # drops large messages together with LARGE_DATA
    env.update(extra)
    return env


def write_params_file(path: Path, parameters: dict[str, Any]) -> Path:
    """Write flat dotted parameters as a `/**: ros__parameters:` YAML file."""
    nested: dict[str, Any] = {}
    for name, value in parameters.items():
        *groups, leaf = name.split(".")
        target = nested
        for group in groups:
            target = target.setdefault(group, {})
        target[leaf] = value
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": nested}}, sort_keys=False))
    return path


def start_console_script(
    name: str, *, env: dict[str, str], log_path: Path, params_file: Path | None = None, ros_args: Iterable[str] = ()
) -> subprocess.Popen:
    """Start a venv console script with ROS arguments; stdout+stderr go to log_path."""
    command = [str(VENV_BIN / name), "--ros-args"]
    if params_file is not None:
        command += ["--params-file", str(params_file)]
    command += list(ros_args)
    log = open(log_path, "wb")  # noqa: SIM115 - closed when the process is stopped
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    process.log_file = log  # type: ignore[attr-defined]
    return process


def start_python(code: str, *, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Run a Python snippet in the venv interpreter as a separate process."""
    log = open(log_path, "wb")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=subprocess.STDOUT)
    process.log_file = log  # type: ignore[attr-defined]
    return process


def stop_process(process: subprocess.Popen, timeout_s: float = 15.0) -> int:
    """SIGINT, wait, and return the exit code (escalating to SIGKILL only on a hang)."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    log = getattr(process, "log_file", None)
    if log is not None:
        log.close()
    return process.returncode


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll predicate until true or timeout; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


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

    def since(self, t_monotonic: float) -> list[Any]:
        """Messages received at or after a time.monotonic() value."""
        with self._lock:
            return [msg for received, msg in self._items if received >= t_monotonic]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class RosSide:
    """The test process's own ROS participant: a context, a node and a spinning executor."""

    def __init__(self, domain_id: int, name: str = "test_side") -> None:
        os.environ["FASTDDS_BUILTIN_TRANSPORTS"] = TRANSPORTS  # read when the participant is created
        self.context = Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        self.node = Node(name, context=self.context)
        self.executor = MultiThreadedExecutor(num_threads=2, context=self.context)
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

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)
        self._thread.join(timeout=2.0)
