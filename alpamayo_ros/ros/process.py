"""The alpamayo_drive process: start the node, spin it, and end cleanly on any signal.

Apart from the node (node.py) because what happens around it decides whether the process ends
within launch's SIGTERM deadline, with exit code 0 and nothing left in /dev/shm: where SIGINT may
raise, the order of teardown, and an exit that skips the interpreter's own teardown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from typing import Any, Iterator

import rclpy
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor

from alpamayo_ros.ros.node import NODE_NAME, DriveNode
from alpamayo_ros.ros.params import help_text
from alpamayo_ros.settings import ParameterError

SIGNAL_SHUTDOWN_WAIT_S = 1.0  # rclpy's signal thread shuts the context down within this


def _goes_down(context: Any, within_s: float) -> bool:
    """Whether the ROS context is shut down now or within within_s."""
    deadline = time.monotonic() + within_s
    while context.ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class _Sigint:
    """Where SIGINT raises KeyboardInterrupt in the main thread: until rclpy is up, then only
    inside `raising_during`.

    rclpy's own SIGINT handler shuts the context down (the spin loop then ends) and chains to
    Python's, which by default raises KeyboardInterrupt wherever the main thread happens to be:
    in rclpy's executor, or halfway through the teardown in main(), where it skips what is left
    of it (destroy_node() among them, so the DDS participant would not go before the exit). Once
    rclpy is up, SIGINT raises only around the model stack's import, which nothing else cuts short.
    """

    def __init__(self) -> None:
        self.raises = True
        signal.signal(signal.SIGINT, self._on_sigint)  # before rclpy.init, which chains to it

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.raises:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def raising_during(self, context: Any) -> Iterator[None]:
        self.raises = True
        try:
            if not context.ok():  # the SIGINT came just before
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
    sigint = _Sigint()
    try:
        ros = rclpy.init(args=argv)
    except RuntimeError as exc:  # rclpy's UnknownROSArgsError: a mistyped ROS argument
        rclpy.logging.get_logger(NODE_NAME).fatal(f"bad arguments, not starting: {exc} (see {NODE_NAME} --help)")
        return 2
    sigint.raises = False
    code, node = 0, None
    try:
        with ros:
            # Single-threaded on purpose: callbacks are short (inference has its own thread), and
            # rclpy's MultiThreadedExecutor busy-waits while a callback group is occupied, holding
            # the GIL, which made plans many times slower (0.4 s -> 6 s with the tiny model on CPU).
            executor = SingleThreadedExecutor(context=ros.context)
            try:
                node = DriveNode(ros_args=_ros_args(argv))
                with sigint.raising_during(ros.context):
                    node.start()
                executor.add_node(node)
                while ros.context.ok() and node.exit_code is None:
                    executor.spin_once(timeout_sec=0.25)
            except (ParameterError, ParameterException) as exc:
                rclpy.logging.get_logger(NODE_NAME).fatal(f"bad parameter, not starting: {exc}")
                code = 2
            except (KeyboardInterrupt, ExternalShutdownException):
                pass
            except RuntimeError:
                # A signal shut ROS down while it was in use: rclpy's take_message fails ("Unable
                # to convert call argument"), or so does building the node. Not an error then.
                # rclpy shuts the context down from its own signal thread, which can lag the
                # failure it causes here by a moment: wait for it before calling this an error.
                if not _goes_down(ros.context, SIGNAL_SHUTDOWN_WAIT_S):
                    raise
            finally:
                if node is not None:
                    node.close()
                    code = node.exit_code or code
                executor.shutdown(timeout_sec=1.0)
                if node is not None:
                    node.destroy_node()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        ros.context.destroy()  # the DDS participant and its shared-memory segments went with the node
    # ROS is shut down and nothing is left to clean up. The interpreter's own teardown would
    # free torch and OpenMP state for seconds on a loaded machine (the launch SIGTERM deadline),
    # and abort ("terminate called") under a worker still inside a model load that cannot be
    # interrupted. Flush the logs and end the process here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
