"""alpamayo_drive ends cleanly on SIGINT in every state (issue 12 acceptance 1).

Real node processes on the tiny checkpoint: SIGINT while the model loads, while it warms up,
when ready, and in the middle of a long plan (4096 reasoning tokens) must each end the process
with code 0 within 3 s, with no traceback, no "terminate called" and no Fast DDS shared-memory
segment left behind. The launch shutdown sequence (SIGINT, wait sigterm_timeout, SIGTERM) is
reproduced with launch/drive.launch.py's own timeout: the node must be gone before SIGTERM.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import time
from pathlib import Path

import pytest
from nav_msgs.msg import Path as PathMsg

from alpamayo_ros.ros.testing import (
    CameraFeed,
    RosSide,
    SensorRig,
    ros_env,
    start_console_script,
    unique_domain_id,
    wait_until,
    write_params_file,
)
from test_process_hygiene import FASTDDS_SHM_PREFIXES, fastdds_segments

ROOT = Path(__file__).resolve().parents[1]
EXIT_DEADLINE_S = 3.0  # the acceptance bound, measured from SIGINT to the process's end
START_TIMEOUT_S = 180.0  # hang guard for reaching a state on a busy machine


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


def _mapped_segments(pid: int) -> set[str]:
    """The Fast DDS shared-memory segments a process maps (its own, on a machine shared with other runs)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    names = {line.rsplit("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line}
    return {name for name in names if name.startswith(FASTDDS_SHM_PREFIXES)}


def _orphaned(segments: set[str]) -> set[str]:
    """Those of segments still in /dev/shm that no live process maps: what an exit leaked.

    A port segment is shared by every participant that talks through it, so one that another
    live process (a test's own ROS side, a concurrent run) still maps is in use, not leaked.
    """
    left = segments & fastdds_segments()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        if not left:
            break
        try:
            text = maps.read_text()
        except OSError:  # the process ended meanwhile
            continue
        left = {name for name in left if f"/dev/shm/{name}" not in text}
    return left


def _interrupt(process: subprocess.Popen) -> tuple[int, float, set[str]]:
    """SIGINT; (exit code, seconds from the signal to the process's end, the segments it mapped).
    SIGKILL only on a hang."""
    segments = _mapped_segments(process.pid)
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
    elapsed = time.monotonic() - sent
    process.log_file.close()
    return process.returncode, elapsed, segments


def _assert_clean(code: int, elapsed_s: float, log: Path, segments: set[str]) -> None:
    text = log.read_text(errors="replace")
    assert code == 0, f"exit code {code}\n{text[-3000:]}"
    assert elapsed_s < EXIT_DEADLINE_S, f"took {elapsed_s:.1f} s to exit\n{text[-3000:]}"
    assert "Traceback" not in text and "terminate called" not in text, text[-3000:]
    assert segments, "the node mapped no Fast DDS segment: nothing was checked"
    assert wait_until(lambda: not _orphaned(segments), timeout_s=5), _orphaned(segments)


@pytest.mark.parametrize(
    ("marker", "tokens"),
    # 4096 reasoning tokens: the warm-up plan is long, so the SIGINT finds it running
    [("loading: loading model", 8), ("warming_up:", 4096), ("ready: ", 8)],
    ids=["loading", "warming_up", "ready"],
)
def test_sigint_in_each_state_exits_0_within_3_s(tmp_path: Path, tiny_checkpoint: Path, marker: str, tokens: int) -> None:
    params = _params(tmp_path, tiny_checkpoint, **{"sampling.max_reasoning_tokens": tokens, "sampling.temperature": 1.0})
    log = tmp_path / "node.log"
    process = start_console_script("alpamayo_drive", env=ros_env(unique_domain_id()), log_path=log, params_file=params)
    reached = wait_until(lambda: marker in log.read_text(errors="replace") or process.poll() is not None, START_TIMEOUT_S)
    assert reached and process.poll() is None, log.read_text(errors="replace")[-3000:]
    code, elapsed, segments = _interrupt(process)
    _assert_clean(code, elapsed, log, segments)


def test_sigint_during_a_long_plan_exits_0_within_3_s(tmp_path: Path, tiny_checkpoint: Path) -> None:
    domain_id = unique_domain_id()
    side = RosSide(domain_id, "shutdown_test")
    cameras = [CameraFeed(1, "/shutdown/front", "raw")]
    rig = SensorRig(side, cameras, odometry_topic="/shutdown/odom").start()
    # a short warm-up, then plans of up to 4096 tokens (the tiny model rarely samples the stop token)
    params = _params(tmp_path, tiny_checkpoint, **{"sampling.max_reasoning_tokens": 8})
    log = tmp_path / "node.log"
    process = start_console_script("alpamayo_drive", env=ros_env(domain_id), log_path=log, params_file=params)
    paths = side.collect(PathMsg, "/alpamayo_drive/output/path", side.reliable())
    try:
        assert wait_until(lambda: len(paths) >= 1 or process.poll() is not None, START_TIMEOUT_S), log.read_text()
        from rclpy.parameter import Parameter
        from rclpy.parameter_client import AsyncParameterClient

        client = AsyncParameterClient(side.node, "alpamayo_drive")
        assert client.wait_for_services(timeout_sec=20.0)
        future = client.set_parameters([Parameter("sampling.max_reasoning_tokens", Parameter.Type.INTEGER, 4096),
                                        Parameter("sampling.temperature", Parameter.Type.DOUBLE, 1.0)])  # fmt: skip
        assert wait_until(future.done, timeout_s=20) and all(r.successful for r in future.result().results)
        # once a plan has been running for 2 s it is a long one (8-token plans take a fraction of that)
        published = len(paths)
        time.sleep(2.0)
        count_before = len(paths)
        time.sleep(2.0)
        assert len(paths) <= count_before + 1, (published, count_before, len(paths))
        code, elapsed, segments = _interrupt(process)
    finally:
        rig.stop()
        side.close()
    _assert_clean(code, elapsed, log, segments)


def test_launch_shutdown_sequence_ends_the_node_before_sigterm(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """launch sends SIGINT, waits sigterm_timeout, then SIGTERM: the node must be gone by then."""
    sigterm_timeout_s = _launch_sigterm_timeout_s()
    assert sigterm_timeout_s > EXIT_DEADLINE_S  # the launch file leaves the node its shutdown time
    params = _params(tmp_path, tiny_checkpoint, **{"sampling.max_reasoning_tokens": 4096, "sampling.temperature": 1.0})
    log = tmp_path / "node.log"
    process = start_console_script("alpamayo_drive", env=ros_env(unique_domain_id()), log_path=log, params_file=params)
    assert wait_until(lambda: "warming_up:" in log.read_text(errors="replace"), START_TIMEOUT_S), log.read_text()
    segments = _mapped_segments(process.pid)
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=sigterm_timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {sigterm_timeout_s} s after SIGINT: launch would SIGTERM it\n{log.read_text()}")
    process.log_file.close()
    _assert_clean(process.returncode, time.monotonic() - started, log, segments)
