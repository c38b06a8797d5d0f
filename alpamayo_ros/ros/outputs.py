"""The drive node's plan outputs: Path, TrajectorySet, Reasoning, CoC text, timings (with the
plan's speculation counts), markers, and each planning tick's outcome.

Every output of one plan is stamped with its t0 and labelled with the frame of its own input
(the odometry frame_id stored with the request, never the latest one), and the Path goes last,
after its companions. ~/debug/ticks says, once per planning tick when its outcome is final,
what the drive loop decided (JSON: tick_ns, t0_ns, planned or skipped with the reason, and how
many messages of each input the loop had taken), so a run can be compared tick by tick with the
bag evaluator's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

import numpy as np
from nav_msgs.msg import Path
from rclpy.node import Node
from rclpy.qos import QoSProfile
from std_msgs.msg import Header, String
from visualization_msgs.msg import MarkerArray

from alpamayo_ros.core.types import WAYPOINT_DT_S, Plan, SamplingSettings
from alpamayo_ros.drive.loop import Outcome, Planned
from alpamayo_ros.drive.scheduler import PlanRequest
from alpamayo_ros.drive.selection import select_sample
from alpamayo_ros.ros import convert
from alpamayo_ros.settings import DriveSettings
from alpamayo_ros_msgs.msg import Reasoning, StageTimings, TrajectorySet

NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class PlanJob:
    """A request plus the settings it runs with, snapshotted so updates never tear a plan."""

    request: PlanRequest
    sampling: SamplingSettings
    selection: str
    max_lateral_accel_mps2: float
    received: Mapping[str, int]  # messages the loop had taken per input at the tick (for ~/debug/ticks)


class PlanPublisher:
    """The publishers of the node's outputs (~/output/*, ~/debug/markers)."""

    def __init__(self, node: Node, settings: DriveSettings, qos: QoSProfile) -> None:
        self._settings = settings
        self._path = node.create_publisher(Path, "~/output/path", qos)
        self._trajectories = node.create_publisher(TrajectorySet, "~/output/trajectories", qos)
        self._reasoning = node.create_publisher(Reasoning, "~/output/reasoning", qos)
        self._coc = node.create_publisher(String, "~/output/coc", qos)
        self._timings = node.create_publisher(StageTimings, "~/output/timings", qos)
        self._markers = node.create_publisher(MarkerArray, "~/debug/markers", qos)
        self._ticks = node.create_publisher(String, "~/debug/ticks", qos)

    def publish_tick(self, outcome: Outcome, received: Mapping[str, int]) -> None:
        """One planning tick's final outcome on ~/debug/ticks (see the module docstring)."""
        record = {"tick_ns": outcome.tick_ns, "t0_ns": outcome.t0_ns, "received": dict(received)}
        if isinstance(outcome, Planned):
            record.update(outcome="planned", reason="", detail="")
        else:
            record.update(outcome="skipped", reason=outcome.reason, detail=outcome.detail)
        self._ticks.publish(String(data=json.dumps(record)))

    def publish(self, job: PlanJob, plan: Plan, timings_ms: dict[str, float], started_ns: int,
                published_ns: int, overruns: int) -> None:  # fmt: skip
        """All outputs of one plan; timings_ms holds the pipeline's and the node's stages."""
        settings = self._settings
        request = job.request
        ego = request.assembly.ego
        t0_ns = request.assembly.driving_input.t0_ns
        stamp = convert.ns_to_stamp(t0_ns)
        if settings.output_frame == "odom":
            xyz, rot = convert.to_frame(plan.xyz, plan.rot, ego.xyz_t0, ego.rot_t0)
            header = Header(stamp=stamp, frame_id=request.frame_id or "odom")
            text_position = ego.xyz_t0
        else:
            xyz, rot = convert.to_frame(plan.xyz, plan.rot, None, None)
            header = Header(stamp=stamp, frame_id=settings.ego_frame_id)
            text_position = np.zeros(3)
        selected, scores = select_sample(plan.xyz, job.selection)
        shown = max(selected, 0)
        coc = plan.coc[shown] if plan.coc else ""
        # a text cut at the token budget is still published, marked unclosed
        closed = plan.reasoning_closed[shown] if plan.reasoning_closed else False
        self._trajectories.publish(
            convert.trajectory_set_message(header, xyz, rot, WAYPOINT_DT_S, scores, selected, job.selection)
        )
        self._reasoning.publish(
            Reasoning(
                header=header, coc=coc, sample_cocs=list(plan.coc), closed=closed,
                sample_closed=list(plan.reasoning_closed), navigation_command=request.route_text,
                backend=plan.backend, model_id=settings.model_id,
                generated_tokens=len(plan.generated_ids[shown]) if plan.generated_ids else 0,
            )
        )  # fmt: skip
        self._coc.publish(String(data=coc))
        self._markers.publish(convert.marker_array_message(header, xyz, selected, coc, text_position))
        ages = (started_ns - t0_ns, published_ns - t0_ns)
        self._timings.publish(timings_message(header, plan, timings_ms, *ages, overruns))
        if selected >= 0:
            self._path.publish(convert.path_message(header, xyz[selected], rot[selected], WAYPOINT_DT_S))


def timings_message(header: Header, plan: Plan, timings_ms: Mapping[str, float], input_age_ns: int,
                    latency_ns: int, overruns: int) -> StageTimings:
    """StageTimings of one plan: its stages, ages, overruns and its speculation counts."""
    return StageTimings(
        header=header, stage_names=list(timings_ms), stage_ms=[float(v) for v in timings_ms.values()],
        input_age_ms=float(input_age_ns / NS_PER_MS), latency_ms=float(latency_ns / NS_PER_MS), overruns=overruns,
        drafted_tokens=plan.drafted_tokens, accepted_tokens=plan.accepted_tokens,
    )  # fmt: skip
