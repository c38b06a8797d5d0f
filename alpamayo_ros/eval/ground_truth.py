"""The recorded ego future of a bag: odometry split into timelines where its stamps jump back.

A bag replayed in a loop, or a simulator reset, restarts the odometry stamps; sorting every
pose by stamp would interleave two drives and zigzag the ground truth. The stamps are therefore
read in receive (log) order and cut wherever a stamp goes back, as the node's odometry buffer
does (it clears itself there): a recorded future is taken from one timeline only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from alpamayo_ros.core.types import NUM_WAYPOINTS, WAYPOINT_DT_S
from alpamayo_ros.eval.bags import read_messages
from alpamayo_ros.inputs.builder import Assembly
from alpamayo_ros.inputs.messages import stamp_to_ns

NS_PER_S = 1_000_000_000
FUTURE_UNAVAILABLE = "future_unavailable"  # the bag's odometry does not cover t0 .. t0 + 6.4 s
FUTURE_GAP = "future_gap"  # odometry gap inside the future window
FUTURE_TIMELINE_JUMP = "future_timeline_jump"  # the odometry stamps jump back before t0 + 6.4 s
FUTURE_DETAILS = {
    FUTURE_UNAVAILABLE: "recorded odometry ends before t0 + 6.4 s",
    FUTURE_GAP: "recorded odometry has a gap inside t0 .. t0 + 6.4 s",
    FUTURE_TIMELINE_JUMP: "recorded odometry stamps jump back before t0 + 6.4 s (a loop or reset)",
}


@dataclass(frozen=True)
class Timeline:
    """Odometry poses between two backward jumps: stamps strictly increasing."""

    first_log_ns: int  # receive time of its first message
    stamps_ns: np.ndarray
    xyz: np.ndarray


@dataclass(frozen=True)
class OdometryTrack:
    """Every odometry pose of a bag (header stamps, odometry frame), cut into timelines."""

    timelines: tuple[Timeline, ...]

    @property
    def jumps(self) -> int:
        """How many times the stamps went back (timelines - 1)."""
        return max(len(self.timelines) - 1, 0)

    @classmethod
    def from_bag(cls, bag: Path, topic: str) -> OdometryTrack:
        timelines: list[Timeline] = []
        log0, stamps, xyz = 0, [], []

        def close() -> None:
            if stamps:
                timelines.append(Timeline(log0, np.asarray(stamps, np.int64), np.asarray(xyz, np.float64).reshape(-1, 3)))

        for m in read_messages(bag, topics=[topic]):
            stamp, p = stamp_to_ns(m.msg.header.stamp), m.msg.pose.pose.position
            if stamps and stamp < stamps[-1]:  # time went back: a new timeline starts here
                close()
                stamps, xyz = [], []
            if stamps and stamp == stamps[-1]:
                xyz[-1] = (p.x, p.y, p.z)  # a re-sent sample replaces its twin, as in the node
                continue
            if not stamps:
                log0 = m.log_time_ns
            stamps.append(stamp)
            xyz.append((p.x, p.y, p.z))
        close()
        return cls(tuple(timelines))

    def timeline_at(self, log_ns: int) -> Timeline | None:
        """The timeline being received at log time log_ns (the one the node's buffer holds)."""
        current = None
        for timeline in self.timelines:
            if timeline.first_log_ns <= log_ns:
                current = timeline
        return current

    def future(self, assembly: Assembly, log_ns: int, max_gap_ns: int) -> np.ndarray | str:
        """Recorded positions at t0 + 0.1 ... 6.4 s in the t0 ego frame, or a skip reason.

        log_ns: the tick's log time, which picks the timeline the input was built from.
        """
        timeline = self.timeline_at(log_ns)
        t0 = assembly.driving_input.t0_ns
        targets = t0 + np.arange(1, NUM_WAYPOINTS + 1, dtype=np.int64) * int(WAYPOINT_DT_S * NS_PER_S)
        if timeline is None or len(timeline.stamps_ns) < 2 or targets[-1] > timeline.stamps_ns[-1]:
            later = timeline is not None and timeline is not self.timelines[-1]
            return FUTURE_TIMELINE_JUMP if later else FUTURE_UNAVAILABLE
        stamps = timeline.stamps_ns
        if targets[0] < stamps[0]:
            return FUTURE_UNAVAILABLE
        right = np.searchsorted(stamps, targets, side="left")
        left = np.maximum(right - 1, 0)
        if (stamps[right] - stamps[left]).max() > max_gap_ns:
            return FUTURE_GAP
        span = np.maximum(stamps[right] - stamps[left], 1)
        w = ((targets - stamps[left]) / span)[:, None]
        xyz = timeline.xyz[left] + w * (timeline.xyz[right] - timeline.xyz[left])
        ego = assembly.ego
        return ((xyz - ego.xyz_t0) @ ego.rot_t0).astype(np.float32)  # R_t0^T (p - p_t0), as the history
