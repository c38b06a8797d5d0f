"""The alpamayo_drive process: start the node, spin it, and end cleanly on any signal.

Apart from the node (node.py) because what happens around it decides whether the process ends
within launch's SIGTERM deadline, with exit code 0 and nothing left in /dev/shm: where SIGINT may
raise, the order of teardown, and an exit that skips the interpreter's own teardown.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from typing import Any, Iterator

import rclpy
from rclpy.exceptions import ParameterException
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions

from alpamayo_ros.ros.node import NODE_NAME, DriveNode
from alpamayo_ros.ros.params import help_text
from alpamayo_ros.ros.teardown import TeardownGuard, exit_now
from alpamayo_ros.settings import ParameterError

SPIN_TIMEOUT_S = 0.25  # how often the spin loop looks for a signal: the exit's added latency
EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and launch's escalation
# from the end of the spin loop to the exit: the worker's stop (1 s) and ROS's teardown (well under
# a second unless Fast DDS stalls), inside launch's SIGINT -> SIGTERM -> SIGKILL escalation (5 + 5 s)
TEARDOWN_BUDGET_S = 8.0


class _Signals:
    """SIGINT and SIGTERM end the spin loop; ROS stays up through the node's teardown.

    rclpy's own handlers (turned off at rclpy.init) shut the ROS context down at once from a
    thread of their own and chain to Python's, which raises KeyboardInterrupt wherever the main
    thread happens to be: the teardown that followed logged through a dead context (rcl printed
    "Failed to publish log message to rosout" for each line) or was cut short halfway, skipping
    destroy_node(). Here a signal only sets `received`, which the spin loop reads every
    SPIN_TIMEOUT_S. It raises KeyboardInterrupt only until rclpy is up and during the model
    stack's import, which nothing else cuts short.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.raises = True
        for signum in EXIT_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = signum
        if self.raises:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def raising_during(self) -> Iterator[None]:
        self.raises = True
        try:
            if self.received is not None:  # the signal came just before
                raise KeyboardInterrupt
            yield
        finally:
            self.raises = False


def _ros_args(args: list[str]) -> list[str]:
    """The arguments after --ros-args (up to a closing --)."""
    if "--ros-args" not in args:
        return []
    tail = args[args.index("--ros-args") + 1 :]
    return tail[: tail.index("--")] if "--" in tail else tail


def main(args: list[str] | None = None) -> int:
    """Console script: run the node until SIGINT/SIGTERM or a failed model load.

    Exit codes: 0 after a signal, 1 after a failed model load (unless model.stay_up_on_failure),
    2 for a bad parameter (named in the log).
    """
    argv = sys.argv if args is None else args
    if "--help" in argv or "-h" in argv:
        print(help_text(NODE_NAME))  # noqa: T201 - the console script's help text
        return 0
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] [%(name)s]: %(message)s")
    signals = _Signals()
    try:
        ros = rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    except RuntimeError as exc:  # rclpy's UnknownROSArgsError: a mistyped ROS argument
        rclpy.logging.get_logger(NODE_NAME).fatal(f"bad arguments, not starting: {exc} (see {NODE_NAME} --help)")
        return 2
    except KeyboardInterrupt:  # a signal before ROS was up: nothing to tear down
        return 0
    signals.raises = False
    node = None
    # the process's exit code lives in the guard, which exits with it should the teardown stall
    guard = TeardownGuard(NODE_NAME, step="stopping the inference worker")
    try:
        with ros:
            # Single-threaded on purpose: callbacks are short (inference has its own thread), and
            # rclpy's MultiThreadedExecutor busy-waits while a callback group is occupied, holding
            # the GIL, which made plans many times slower (0.4 s -> 6 s with the tiny model on CPU).
            executor = SingleThreadedExecutor(context=ros.context)
            try:
                node = DriveNode(ros_args=_ros_args(argv))
                with signals.raising_during():
                    node.start()
                executor.add_node(node)
                while signals.received is None and node.exit_code is None:
                    executor.spin_once(timeout_sec=SPIN_TIMEOUT_S)
            except (ParameterError, ParameterException) as exc:
                rclpy.logging.get_logger(NODE_NAME).fatal(f"bad parameter, not starting: {exc}")
                guard.code = 2
            except KeyboardInterrupt:  # a signal during the model stack's import
                pass
            finally:
                guard.start(TEARDOWN_BUDGET_S)
                if node is not None:
                    node.close()
                    guard.code = node.exit_code or guard.code
                guard.step = "ROS teardown"
                executor.shutdown(timeout_sec=1.0)
                if node is not None:
                    node.destroy_node()
    finally:
        ros.context.destroy()  # the DDS participant and its shared-memory segments went with the node
    # ROS is shut down and nothing is left to clean up. The interpreter's own teardown would
    # abort ("terminate called") under a worker still inside a model load that cannot be
    # interrupted.
    exit_now(guard.code)
