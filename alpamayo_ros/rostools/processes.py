"""ROS console scripts as child processes, started with their logs and stopped cleanly.

The demo, the benchmarks and the tests run the drive node (and friends) as separate processes;
SIGINT first, so rclpy shuts DDS down and leaves no shared-memory segments behind. The child's
side of that contract is here too: a ROS tool whose work is done ends itself, exit code 0, when
Fast DDS's teardown stalls, instead of outliving the parent's SIGINT wait.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterable, NoReturn

logger = logging.getLogger(__name__)


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


def exit_now(code: int) -> NoReturn:
    """Flush the logs and end the process, skipping the interpreter's own teardown.

    For a ROS tool whose ROS side is torn down (or stalled in teardown with its work done): the
    interpreter's finalization sets SIGINT back to the default first and then takes a while, in
    which a second Ctrl-C kills the process with -2 instead of the 0 the first one earned.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class TeardownGuard:
    """Ends the process with exit code 0 if the work after its last output outlives a budget.

    The output is complete by then (a bag played, the frames published): a Fast DDS teardown that
    stalls (a peer gone mid-handshake; seen in CI for over 15 s) must not keep a scripted run
    waiting, or fail it after all is in. The warning names the program and the step that stalled.
    """

    def __init__(self, program: str, step: str) -> None:
        self.program, self.step = program, step

    def start(self, budget_s: float) -> None:
        timer = threading.Timer(budget_s, self._expire, args=(budget_s,))
        timer.daemon = True
        timer.start()

    def _expire(self, budget_s: float) -> None:
        logger.warning("%s: %s still running %.0f s after the work was done; exiting anyway",
                       self.program, self.step, budget_s)  # fmt: skip
        exit_now(0)
