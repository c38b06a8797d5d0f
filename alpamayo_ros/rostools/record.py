"""`alpamayo-record --topics ... --out DIR`: record live topics to an MCAP rosbag2 without `ros2 bag`.

Topics are subscribed as soon as a publisher appears, with raw (CDR) callbacks written
straight to the bag, so any type works whose definition is known: the Kilted standard
messages plus installed custom interfaces such as alpamayo_ros_msgs. The subscription
QoS follows the publishers (best effort if any publisher is, transient-local if all are),
as `ros2 bag record` does, because a reliable reader never matches a best-effort writer.
"""

from __future__ import annotations

import argparse
import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import rclpy
from rclpy.executors import ExternalShutdownException
from rclpy.clock import Clock, ClockType
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions

from alpamayo_ros.eval.bags import BagWriter, message_class

logger = logging.getLogger(__name__)


def _matching_qos(endpoints: Sequence[Any]) -> QoSProfile:
    best_effort = any(e.qos_profile.reliability == ReliabilityPolicy.BEST_EFFORT for e in endpoints)
    latched = bool(endpoints) and all(e.qos_profile.durability == DurabilityPolicy.TRANSIENT_LOCAL for e in endpoints)
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST, depth=200,
        reliability=ReliabilityPolicy.BEST_EFFORT if best_effort else ReliabilityPolicy.RELIABLE,
        durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE)


class Recorder:
    """Subscribes to topics as they appear and writes every message to one bag."""

    def __init__(self, node: Node, writer: BagWriter, topics: Sequence[str], clock: Callable[[], int] | None = None) -> None:
        """clock: log time source in ns (default: the node's clock, /clock with use_sim_time)."""
        if not topics:
            raise ValueError("topics: at least one topic to record is required")
        self.node, self.writer = node, writer
        self.clock = clock or (lambda: node.get_clock().now().nanoseconds)
        self.pending = {node.resolve_topic_name(t) for t in topics}
        self.active = True  # False: subscribed, but messages are dropped (a caller's warm-up)
        self.counts: dict[str, int] = {}
        self._subs: list[Any] = []
        self._early: list[tuple[str, str, bytes]] = []  # received before the clock started (sim time 0)
        # Discovery runs on the steady clock: with use_sim_time a node timer waits for /clock, and the
        # first messages of a replay (often the only route message) would go by unrecorded.
        self._discovery = node.create_timer(0.1, self.discover, clock=Clock(clock_type=ClockType.STEADY_TIME))

    def discover(self) -> None:
        """Subscribe to every pending topic that now has a publisher with a known type."""
        if self._early and self.clock() > 0:
            self.flush_early()
        if not self.pending:
            return
        types = dict(self.node.get_topic_names_and_types())
        for topic in sorted(self.pending & types.keys()):
            msgtype = types[topic][0]
            endpoints = self.node.get_publishers_info_by_topic(topic)
            if not endpoints:
                continue
            self._subs.append(self.node.create_subscription(
                message_class(msgtype), topic, self._callback(topic, msgtype), _matching_qos(endpoints), raw=True))
            self.counts[topic] = 0
            self.pending.discard(topic)
            logger.info("record: %s [%s]", topic, msgtype)

    def _callback(self, topic: str, msgtype: str) -> Callable[[bytes], None]:
        def write(raw: bytes) -> None:
            if not self.active:
                return
            now = self.clock()
            if now <= 0:  # use_sim_time before the first /clock: keep it for the first clock time
                self._early.append((topic, msgtype, bytes(raw)))
                return
            if self._early:
                self.flush_early()
            self.writer.write_raw(topic, msgtype, now, raw)
            self.counts[topic] += 1
        return write

    def flush_early(self) -> None:
        """Write the messages that arrived before the clock started, at the clock's current time
        (0 only when it never started), in arrival order."""
        now = max(self.clock(), 0)
        for topic, msgtype, raw in self._early:
            self.writer.write_raw(topic, msgtype, now, raw)
            self.counts[topic] += 1
        self._early.clear()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="alpamayo-record", description=__doc__.splitlines()[0])
    parser.add_argument("--topics", nargs="+", required=True, help="topics to record")
    parser.add_argument("--out", type=Path, required=True, help="bag directory to create (must not exist)")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: until SIGINT/SIGTERM)")
    parser.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap")
    args, ros_args = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    # Own the signals so the bag is always closed (metadata.yaml is written on close).
    rclpy.init(args=["alpamayo_record", *ros_args], signal_handler_options=SignalHandlerOptions.NO)
    stop = {"flag": False}

    def request_stop(*_: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    node = rclpy.create_node("alpamayo_record")
    writer = BagWriter(args.out, storage=args.storage)
    deadline = time.monotonic() + args.duration if args.duration > 0 else float("inf")
    try:
        with writer:
            recorder = Recorder(node, writer, args.topics)
            while not stop["flag"] and time.monotonic() < deadline:
                rclpy.spin_once(node, timeout_sec=0.05)
            for _ in range(20):  # write what already arrived before closing
                rclpy.spin_once(node, timeout_sec=0.0)
            recorder.flush_early()
        logger.info("record: wrote %s: %s", args.out, recorder.counts)
        if recorder.pending:
            logger.warning("record: never saw publishers on %s", sorted(recorder.pending))
    except ExternalShutdownException:
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
