"""The plans a drive node published into a bag, as a planner: score what the node did online, or
re-plan at its t0s and measure how far the offline plans differ (the node/evaluator parity check)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from alpamayo_ros.core.types import DrivingInput, Plan, SamplingSettings
from alpamayo_ros.eval.bags import TRAJECTORY_SET, read_messages
from alpamayo_ros.inputs.ego_history import quaternion_to_matrix
from alpamayo_ros.inputs.messages import stamp_to_ns

if TYPE_CHECKING:
    from alpamayo_ros.eval.evaluate import BagResult


class RecordedPlans:
    """The plans a node published (TrajectorySet in its ego frame), looked up by t0.

    Scores what the node actually did online without running a model, and gives the t0s at
    which an offline re-plan must reproduce the node's plans.
    """

    def __init__(self, bag: str | Path, topic: str, ego_frame_id: str) -> None:
        self.plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # t0 -> (xyz (S, N, 3), quat xyzw (S, N, 4))
        for m in read_messages(bag, topics=[topic]):
            if m.msgtype != TRAJECTORY_SET:
                raise ValueError(f"plans topic {topic}: is {m.msgtype}, expected {TRAJECTORY_SET}")
            if m.msg.header.frame_id != ego_frame_id or not m.msg.samples:
                raise ValueError(f"plans topic {topic}: need plans in the ego frame {ego_frame_id!r} (output.frame: ego), "
                                 f"got frame {m.msg.header.frame_id!r} with {len(m.msg.samples)} samples")
            poses = [[(p.position, p.orientation) for p in s.poses] for s in m.msg.samples]
            self.plans[stamp_to_ns(m.msg.header.stamp)] = (
                np.array([[(p.x, p.y, p.z) for p, _ in row] for row in poses], dtype=np.float32),
                np.array([[(q.x, q.y, q.z, q.w) for _, q in row] for row in poses], dtype=np.float64))
        if not self.plans:
            raise ValueError(f"plans topic {topic}: no messages in {bag}")

    @property
    def t0s_ns(self) -> list[int]:
        return sorted(self.plans)

    def plan(self, driving_input: DrivingInput, settings: SamplingSettings) -> Plan:
        if driving_input.t0_ns not in self.plans:
            raise KeyError(f"no recorded plan for t0 {driving_input.t0_ns}")
        xyz, quat = self.plans[driving_input.t0_ns]
        return Plan(xyz=xyz, rot=quaternion_to_matrix(quat).astype(np.float32), coc=[""] * len(xyz),
                    generated_ids=[[] for _ in xyz], t0_ns=driving_input.t0_ns, backend="recorded")


def plan_differences(result: BagResult, recorded: RecordedPlans) -> dict[int, float]:
    """t0 -> largest waypoint distance (m) between a re-planned and the recorded plan."""
    out = {}
    for t in result.scored:
        if t.t0_ns in recorded.plans and recorded.plans[t.t0_ns][0].shape == t.plan.xyz.shape:
            out[t.t0_ns] = float(np.abs(t.plan.xyz - recorded.plans[t.t0_ns][0]).max())
    return out
