"""One simulator session: AlpaSim's messages checked and handed to its drive loop by time.

Every observation is checked in full when it arrives, and a bad one is refused with a FieldError
naming the field, changing nothing. Accepted observations wait for the next drive() and
reach the loop then, in arrival order, with the drive's time as the clock: AlpaSim submits a
step's observations (concurrently) and then asks for the plan at the step's start, so
that time is when the node would have seen them. What waits is bounded as the loop's own
buffers are (PendingObservations), however long a runtime submits without asking for a plan.
"""

from __future__ import annotations

import heapq
import itertools
import math
import pickle
import threading
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Callable

import grpc
import numpy as np
from carla_driver_interface.protocol import (DriveResponse, RolloutCameraImage, RolloutEgoTrajectory, Route,
                                             Trajectory)  # fmt: skip

from alpamayo_ros.drive.loop import Planned, Skipped, decode_image
from alpamayo_ros.drive.messages import CompressedImage, Odometry
from alpamayo_ros.drive.selection import select_sample
from alpamayo_ros.inputs.ego_history import MAX_SAMPLES_BUFFERED
from alpamayo_ros.inputs.frame_sync import MAX_FRAMES_BUFFERED
from alpamayo_ros.inputs.messages import ImageRejected
from alpamayo_ros.sim.geometry import plan_trajectory, pose_arrays
from alpamayo_ros.sim.loop import SessionLoop, Step

ODOMETRY_FRAME = "local"  # AlpaSim's world frame
POLICY_NAME = "alpamayo_ros"
NS_PER_US = 1000
ODOMETRY = "odometry"  # the pending source of poses (cameras are keyed by their index)

Deliver = Callable[[int], object]  # hands one observation to the drive loop, given the drive's clock


class FieldError(ValueError):
    """A request field the service cannot take; the gRPC status details start with its name."""

    def __init__(self, field: str, detail: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.code = code


@dataclass(frozen=True)
class Drive:
    """One drive() answered: the wire response and the loop's outcome behind it."""

    response: DriveResponse
    step: Step
    now_us: int


class PendingObservations:
    """Accepted observations waiting for the next drive(), bounded by what the drive loop keeps.

    A runtime may submit for long without asking for a plan (or stop asking and leave the session
    open); decoded frames are megabytes each. A camera keeps the frames within the loop's frame
    retention behind its newest one (at most MAX_FRAMES_BUFFERED), odometry its newest
    MAX_SAMPLES_BUFFERED poses: with stamps in time order, the loop's buffers after the next drive()
    are what every observation delivered would have left, and the session's memory stays flat.
    """

    def __init__(self, frame_retention_ns: int) -> None:
        self.frame_retention_ns = frame_retention_ns
        self.superseded = 0  # observations dropped before the loop saw them
        self._sources: dict[int | str, deque[tuple[int, int, Deliver]]] = {}  # (arrival, stamp ns, deliver)
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._sources.values())

    def add_frame(self, camera: int, stamp_ns: int, deliver: Deliver) -> None:
        queue = self._append(camera, stamp_ns, deliver)
        while len(queue) > MAX_FRAMES_BUFFERED or queue[0][1] < stamp_ns - self.frame_retention_ns:
            queue.popleft()
            self.superseded += 1

    def add_pose(self, stamp_ns: int, deliver: Deliver) -> None:
        queue = self._append(ODOMETRY, stamp_ns, deliver)
        while len(queue) > MAX_SAMPLES_BUFFERED:
            queue.popleft()
            self.superseded += 1

    def take(self) -> list[Deliver]:
        """Every kept observation, in arrival order; none is left pending."""
        sources, self._sources = self._sources, {}
        return [deliver for _, _, deliver in heapq.merge(*sources.values(), key=lambda entry: entry[0])]

    def _append(self, source: int | str, stamp_ns: int, deliver: Deliver) -> deque[tuple[int, int, Deliver]]:
        queue = self._sources.setdefault(source, deque())
        queue.append((next(self._arrivals), stamp_ns, deliver))
        return queue


class Session:
    """A session's loop, its pending observations and its wire-level bookkeeping."""

    def __init__(self, uuid: str, loop: SessionLoop, camera_map: dict[str, int], model_id: str) -> None:
        self.uuid = uuid
        self.loop = loop
        self.camera_map = camera_map
        self.model_id = model_id
        self.lock = threading.Lock()
        self.pending = PendingObservations(loop.settings.frame_sync.retention_ns)
        self._last_pose_us = -1
        self._last_drive_us = -1
        self.route_waypoints = 0

    # -- observations --

    def add_image(self, request: RolloutCameraImage) -> None:
        image = request.camera_image
        if image.logical_id not in self.camera_map:
            raise FieldError("camera_image.logical_id", f"{image.logical_id!r} is not mapped to a model camera "
                             f"(mapped: {', '.join(sorted(self.camera_map))}; see --camera)")  # fmt: skip
        try:  # the drive loop's decoder, outside the session's lock (the loop fits the decoded frame)
            rgb = decode_image(CompressedImage("jpeg or png", bytes(image.image_bytes)), None)
        except ImageRejected as exc:
            raise FieldError("camera_image.image_bytes", f"camera {image.logical_id}: {exc}") from None
        camera, stamp_ns = self.camera_map[image.logical_id], int(image.frame_end_us) * NS_PER_US
        with self.lock:
            self.pending.add_frame(camera, stamp_ns, partial(self.loop.on_camera, camera, stamp_ns, rgb))

    def add_egomotion(self, request: RolloutEgoTrajectory) -> None:
        poses = [pose_arrays(pose) for pose in request.trajectory.poses]
        if not poses:
            raise FieldError("trajectory.poses", "empty; send at least one pose")
        if request.dynamic_states and len(request.dynamic_states) != len(poses):
            raise FieldError("dynamic_states", f"{len(request.dynamic_states)} states for {len(poses)} poses (1:1 or none)")
        for i, (_, xyz, quat) in enumerate(poses):
            if not (np.isfinite(xyz).all() and np.isfinite(quat).all()) or np.linalg.norm(quat) < 1e-6:
                raise FieldError(f"trajectory.poses[{i}].pose", f"not a pose: position {xyz.tolist()}, quaternion "
                                 f"xyzw {quat.tolist()}")  # fmt: skip
        with self.lock:
            previous = self._last_pose_us
            for i, (stamp_us, _, _) in enumerate(poses):
                if stamp_us <= previous:
                    raise FieldError(f"trajectory.poses[{i}].timestamp_us", f"{stamp_us} is not after the previous "
                                     f"pose's {previous}; poses must be submitted in time order")  # fmt: skip
                previous = stamp_us
            self._last_pose_us = previous
            for stamp_us, xyz, quat in poses:
                odometry = Odometry(stamp_us * NS_PER_US, ODOMETRY_FRAME, xyz, quat)
                self.pending.add_pose(odometry.stamp_ns, partial(self.loop.on_odometry, odometry))

    def add_route(self, route: Route) -> None:
        """Checked and counted. Alpamayo 1.5 takes its route as text; AlpaSim sends waypoints (its own
        Alpamayo driver does not use them either), so no route text is derived from them."""
        for i, point in enumerate(route.waypoints):
            if not all(math.isfinite(v) for v in (point.x, point.y, point.z)):
                raise FieldError(f"route.waypoints[{i}]", f"non-finite ({point.x}, {point.y}, {point.z})")
        with self.lock:
            self.route_waypoints = len(route.waypoints)

    # -- planning --

    def drive(self, time_now_us: int) -> Drive:
        with self.lock:
            if time_now_us < self._last_drive_us:
                raise FieldError("time_now_us", f"{time_now_us} is before the previous drive's {self._last_drive_us}")
            self._last_drive_us = time_now_us
            now_ns = time_now_us * NS_PER_US
            for deliver in self.pending.take():
                deliver(now_ns)
            step = self.loop.step(now_ns)
        return Drive(response=self.answer(step), step=step, now_us=time_now_us)

    def answer(self, step: Step) -> DriveResponse:
        """AlpaSim's answer: an empty trajectory (hold) with the reason while no plan comes out."""
        debug = {"policy_name": POLICY_NAME, "model_id": self.model_id}
        outcome = step.outcome
        if isinstance(outcome, Skipped):
            debug.update(skipped=outcome.reason, detail=outcome.detail)
            response = DriveResponse(trajectory=Trajectory())
            response.debug_info.unstructured_debug_info = pickle.dumps(debug)
            return response
        plan, ego = outcome.plan, outcome.request.assembly.ego
        samples = [plan_trajectory(outcome.t0_ns, plan.xyz[s], plan.rot[s], ego.xyz_t0, ego.rot_t0)
                   for s in range(len(plan.xyz))]  # fmt: skip
        selected, scores = select_sample(plan.xyz, self.loop.settings.selection)  # the node's Path is this one
        debug.update(
            backend=plan.backend, t0_us=outcome.t0_ns // NS_PER_US, seed=step.seed, selected_sample=selected,
            sample_scores=scores.tolist(), reasoning_text=plan.coc[selected], reasoning=list(plan.coc),
            reasoning_closed=list(plan.reasoning_closed),
            generated_tokens=[len(ids) for ids in plan.generated_ids], inference_seconds=step.step_ms / 1e3,
            scalars={"step_ms": step.step_ms, "assemble_ms": outcome.request.assemble_ms,
                     **{f"timings.{k}": float(v) for k, v in plan.timings_ms.items()}},
        )  # fmt: skip
        response = DriveResponse(trajectory=samples[selected])
        response.debug_info.sampled_trajectories.extend(samples)
        response.debug_info.unstructured_debug_info = pickle.dumps(debug)
        return response
