"""ROS console scripts as child processes, started with their logs and stopped cleanly.

The demo, the benchmarks and the tests run the drive node (and friends) as separate processes;
SIGINT first, so rclpy shuts DDS down and leaves no shared-memory segments behind. The child's
side of that contract (an exit that a stalled Fast DDS teardown cannot hold up) is
ros/teardown.py.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterable


def start_console_script(
    name: str,
    *,
    log_path: Path,
    params_file: Path | None = None,
    ros_args: Iterable[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start an installed console script with ROS arguments; stdout+stderr go to log_path.

    The script next to this interpreter wins (a venv that is not activated), then PATH.
    """
    script = Path(sys.executable).with_name(name)
    command = [str(script) if script.exists() else shutil.which(name) or name, "--ros-args"]
    if params_file is not None:
        command += ["--params-file", str(params_file)]
    command += list(ros_args)
    log = open(log_path, "wb")  # noqa: SIM115 - closed by stop_process
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
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
