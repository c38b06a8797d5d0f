"""`alpamayo-replay BAG`: publish a rosbag2 on its topics with /clock, without `ros2 bag play`.

Messages go out as the bag's raw CDR bytes (no deserialization), paced by their log times
divided by --rate, and /clock carries the bag time so nodes with use_sim_time follow the
bag. Playback starts once every replayed topic has a subscriber (or --wait-timeout passes),
because DDS delivers nothing to readers that have not matched yet.

SIGINT and SIGTERM (Ctrl-C ends --loop) stop the playback between two publishes, and the node
and ROS go down after it, in order, with exit code 0. rclpy's own handlers are left out: they
shut the ROS context down from a thread of their own at once, under a publish that may be under
way (RCLError, exit 1), and raise KeyboardInterrupt in the middle of the teardown.
"""

from __future__ import annotations

import argparse
import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import rclpy
from rclpy.duration import Duration
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions
from rosbags.highlevel import AnyReader
from rosgraph_msgs.msg import Clock

from alpamayo_ros.eval.bags import kilted_typestore, message_class
from alpamayo_ros.ros.convert import ns_to_stamp
from alpamayo_ros.ros.teardown import TeardownGuard, exit_now

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0  # per topic
TEARDOWN_TIMEOUT_S = 10.0


def _offered_durability(connection: Any) -> DurabilityPolicy:
    """Latched topics (TRANSIENT_LOCAL in the bag's offered QoS) stay latched on replay."""
    profiles = getattr(connection.ext, "offered_qos_profiles", None) or []
    for qos in profiles:
        if "TRANSIENT_LOCAL" in str(getattr(qos, "durability", "")).upper():
            return DurabilityPolicy.TRANSIENT_LOCAL
    return DurabilityPolicy.VOLATILE


class BagPlayer:
    """Publishes one bag through a node. Reliable publishers match both reliable and
    best-effort subscribers. Once `stopped()` is true, waiting and playing end at the next message."""

    def __init__(self, node: Node, bag: Path, rate: float = 1.0, topics: Sequence[str] | None = None,
                 clock_hz: float = 100.0, stopped: Callable[[], bool] = lambda: False) -> None:
        if rate <= 0:
            raise ValueError(f"rate: must be > 0, got {rate}")
        if clock_hz <= 0:
            raise ValueError(f"clock_hz: must be > 0, got {clock_hz}")
        self.node, self.bag, self.rate, self.clock_period = node, Path(bag), rate, 1.0 / clock_hz
        self.stopped = stopped
        self._reader = AnyReader([self.bag], default_typestore=kilted_typestore())
        self._reader.open()
        conns = self._reader.connections
        if topics:
            missing = sorted(set(topics) - {c.topic for c in conns})
            if missing:
                raise ValueError(f"topics: {missing} not in bag {bag}")
            conns = [c for c in conns if c.topic in set(topics)]
        self._conns = conns
        self._pubs: dict[str, Any] = {}
        for c in conns:
            if c.topic not in self._pubs:
                qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100,
                                 reliability=ReliabilityPolicy.RELIABLE, durability=_offered_durability(c))
                self._pubs[c.topic] = node.create_publisher(message_class(c.msgtype), c.topic, qos)
        self._clock_pub = node.create_publisher(Clock, "/clock", QoSProfile(depth=10))

    def close(self) -> None:
        self._reader.close()

    @property
    def topics(self) -> list[str]:
        return sorted(self._pubs)

    def wait_for_subscribers(self, timeout_s: float) -> bool:
        """Block until every data topic has a subscriber; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stopped():
            waiting = [t for t, p in self._pubs.items() if p.get_subscription_count() == 0]
            if not waiting:
                time.sleep(0.3)  # let the matched readers finish their handshake
                return True
            time.sleep(0.05)
        if self.stopped():
            return False
        logger.warning("replay: no subscriber after %.1f s on %s; playing anyway", timeout_s, waiting)
        return False

    def _publish_clock(self, bag_ns: int) -> None:
        msg = Clock(clock=ns_to_stamp(int(bag_ns)))
        self._clock_pub.publish(msg)

    def play_once(self) -> int:
        """Publish every message once in log-time order (until stopped); returns the count published."""
        start_ns = self._reader.start_time
        wall0 = time.monotonic()
        count = 0
        for conn, log_ns, raw in self._reader.messages(connections=self._conns):
            due = wall0 + (log_ns - start_ns) / 1e9 / self.rate
            now = time.monotonic()
            while now < due and not self.stopped():  # keep /clock moving (never past the next message)
                self._publish_clock(min(log_ns, start_ns + int((now - wall0) * self.rate * 1e9)))
                time.sleep(min(self.clock_period, due - now))
                now = time.monotonic()
            if self.stopped():
                break
            self._publish_clock(log_ns)
            self._pubs[conn.topic].publish(bytes(raw))
            count += 1
        return count

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait until reliable readers acknowledged everything, so exiting loses nothing."""
        for topic, pub in self._pubs.items():
            if not pub.wait_for_all_acked(Duration(seconds=timeout_s)):
                logger.warning("replay: %s not fully acknowledged after %.1f s", topic, timeout_s)


def main(argv: Sequence[str] | None = None) -> None:
    """Console script: exit code 0 once played (or interrupted); never returns on success."""
    parser = argparse.ArgumentParser(prog="alpamayo-replay", description=__doc__.splitlines()[0])
    parser.add_argument("bag", type=Path, help="rosbag2 directory (sqlite3 or MCAP)")
    parser.add_argument("--rate", type=float, default=1.0, help="playback speed factor")
    parser.add_argument("--loop", action="store_true", help="replay until interrupted")
    parser.add_argument("--topics", nargs="+", help="replay only these topics")
    parser.add_argument("--wait-timeout", type=float, default=10.0,
                        help="seconds to wait for subscribers on every topic (0: do not wait)")
    parser.add_argument("--clock-hz", type=float, default=100.0, help="/clock rate between messages")
    args, ros_args = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    signals: list[int] = []  # the handler only appends: one that took a lock (Event.set) could
    for signum in (signal.SIGINT, signal.SIGTERM):  # deadlock against the code it interrupts
        signal.signal(signum, lambda received, _frame: signals.append(received))
    rclpy.init(args=["alpamayo_replay", *ros_args], signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node("alpamayo_replay")
    player = None
    guard = TeardownGuard("replay", step="flush")
    try:
        player = BagPlayer(node, args.bag, args.rate, args.topics, args.clock_hz, stopped=lambda: bool(signals))
        if args.wait_timeout > 0:
            player.wait_for_subscribers(args.wait_timeout)
        while not signals:
            n = player.play_once()
            logger.info("replay: published %d messages on %d topics", n, len(player.topics))
            if not args.loop:
                break
        if signals:
            logger.info("replay: interrupted")
        else:
            guard.start(FLUSH_TIMEOUT_S * len(player.topics) + TEARDOWN_TIMEOUT_S)
            player.flush()
    finally:
        guard.step = "ROS teardown"
        if player is not None:
            player.close()
        node.destroy_node()
        # the handlers are ours: rclpy's uninstall would set SIGINT back to the default, and a
        # second Ctrl-C during the exit would kill the process
        rclpy.try_shutdown(uninstall_handlers=False)
    # All is torn down; the interpreter's own finalization would take half a second (measured:
    # 0.5 s, against 10 ms for the teardown above) with SIGINT back at its default.
    exit_now(0)


if __name__ == "__main__":
    main()
