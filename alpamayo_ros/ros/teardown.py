"""The end of a ROS process: an exit that skips the interpreter's teardown, and a guard that
ends the process when the ROS teardown before it stalls.

Fast DDS's teardown can stall (a peer gone mid-handshake; seen in CI for over 15 s). A process
whose work is done must still end within its parent's SIGINT wait (launch escalates to SIGKILL
after about 10 s), with its own exit code, and say where it was stuck.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import sys
import threading
import time
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

    Two ways, because a stall may hold the interpreter lock (rclpy's C calls into Fast DDS keep
    it), and then no Python thread runs again: at the budget a Python timer logs the program and
    the step that stalled (`step` is updated as the teardown goes), prints every thread's stack
    and exits through exit_now; HELD_LOCK_GRACE_S later, faulthandler's own thread prints the
    stacks and a C timer calls _exit(code), neither needing the lock. `code` may change until then.
    """

    def __init__(self, program: str, step: str, code: int = 0) -> None:
        self.program, self.step = program, step
        self._code = code
        self._deadline: float | None = None  # time.monotonic() of the C timer's _exit
        self._timer: ctypes.c_void_p | None = None

    @property
    def code(self) -> int:
        return self._code

    @code.setter
    def code(self, code: int) -> None:
        self._code = code
        if self._deadline is not None:  # the C timer's code was fixed when it was made
            _delete_timer(self._timer)
            self._timer = _exit_at(self._deadline, code)

    def start(self, budget_s: float) -> None:
        timer = threading.Timer(budget_s, self._expire, args=(budget_s,))
        timer.daemon = True
        timer.start()
        faulthandler.dump_traceback_later(budget_s + HELD_LOCK_GRACE_S, exit=False)
        self._deadline = time.monotonic() + budget_s + HELD_LOCK_GRACE_S + _DUMP_S
        self._timer = _exit_at(self._deadline, self._code)

    def _expire(self, budget_s: float) -> None:
        logger.warning("%s: %s still running %.0f s after the work was done; exiting anyway (stacks follow)",
                       self.program, self.step, budget_s)  # fmt: skip
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        exit_now(self._code)


#: How long after its budget TeardownGuard stops waiting for the interpreter lock.
HELD_LOCK_GRACE_S = 1.0
_DUMP_S = 0.5  # faulthandler's stacks are out before the C timer ends the process

# glibc's POSIX timer whose expiry runs a C function in a thread of its own (SIGEV_THREAD): the
# function is _exit and its argument the exit code, so no Python runs.
_CLOCK_MONOTONIC, _SIGEV_THREAD, _TIMER_ABSTIME = 1, 2, 1


class _SigEvent(ctypes.Structure):
    """struct sigevent (64 bytes on 64-bit Linux), its SIGEV_THREAD fields named."""

    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attributes", ctypes.c_void_p), ("_pad", ctypes.c_byte * 32)]  # fmt: skip


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


_LIBC = ctypes.CDLL(None, use_errno=True)


def _exit_at(deadline: float, code: int) -> ctypes.c_void_p:
    """A timer that calls _exit(code) at deadline (time.monotonic(), i.e. CLOCK_MONOTONIC)."""
    event = _SigEvent(value=code, notify=_SIGEV_THREAD, function=ctypes.cast(_LIBC._exit, ctypes.c_void_p).value)
    timer = ctypes.c_void_p()
    if _LIBC.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
        raise OSError(ctypes.get_errno(), "timer_create")
    seconds = int(deadline)
    spec = _ITimerSpec(value=_Timespec(seconds, int((deadline - seconds) * 1e9)))
    if _LIBC.timer_settime(timer, _TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
        raise OSError(ctypes.get_errno(), "timer_settime")
    return timer


def _delete_timer(timer: ctypes.c_void_p) -> None:
    _LIBC.timer_delete(timer)
