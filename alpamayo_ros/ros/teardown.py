"""The end of a ROS process: an exit that skips the interpreter's teardown, and a guard that
ends the process when the ROS teardown before it stalls.

Fast DDS's teardown can stall (a peer gone mid-handshake; seen in CI for over 15 s). A process
whose work is done must still end within its parent's SIGINT wait (launch escalates to SIGKILL
after about 10 s), with its own exit code, and say where it was stuck.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
from typing import NoReturn

logger = logging.getLogger(__name__)


def exit_now(code: int) -> NoReturn:
    """Flush the logs and end the process, skipping the interpreter's own teardown.

    For a ROS process whose ROS side is torn down (or stalled in teardown with its work done): the
    interpreter's finalization sets SIGINT back to the default first and then takes a while (torch
    and OpenMP state: seconds on a loaded machine), in which a second Ctrl-C kills the process with
    -2 instead of the code the first one earned.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class TeardownGuard:
    """Ends the process with `code` if the teardown after its work outlives a budget.

    The warning names the program and the step that stalled (`step` is updated as the teardown
    goes), and every thread's stack follows it, so a stall seen once in CI can be placed.
    """

    def __init__(self, program: str, step: str, code: int = 0) -> None:
        self.program, self.step, self.code = program, step, code

    def start(self, budget_s: float) -> None:
        timer = threading.Timer(budget_s, self._expire, args=(budget_s,))
        timer.daemon = True
        timer.start()

    def _expire(self, budget_s: float) -> None:
        logger.warning("%s: %s still running %.0f s after the work was done; exiting anyway (stacks follow)",
                       self.program, self.step, budget_s)  # fmt: skip
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        exit_now(self.code)
