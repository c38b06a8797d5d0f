"""alpamayo_drive: cameras + odometry in; trajectories, reasoning and diagnostics out.

Threads: one executor thread runs every callback (decode and buffer, the planning tick, the
diagnostics), and one worker thread loads the model, warms it up and runs one plan at a
time. The planning tick only assembles an input and hands it to the worker, so no callback
ever waits for inference.
A tick that finds the worker busy is skipped and counted as an overrun: latest-only, so no
backlog can build up. With planning.trigger = frames, the image callback that completes a newer
frame set starts the plan itself when the worker is idle (no wait for a tick, so the input is
as fresh as the cameras allow), and the ticks only report missing or stale input. Every skipped tick, dropped message and failure is counted by reason
and reported in diagnostics; no callback exception can kill the node.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from nav_msgs.msg import Odometry, Path
from rcl_interfaces.msg import SetParametersResult
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import Header, String
from visualization_msgs.msg import MarkerArray

from alpamayo_ros.core.types import WAYPOINT_DT_S, DrivingInput, Plan, SamplingSettings
from alpamayo_ros.inputs import RejectReason, Rejection, messages
from alpamayo_ros.inputs.builder import Assembly, build_driving_input
from alpamayo_ros.inputs.ego_history import OdometryBuffer
from alpamayo_ros.inputs.frame_sync import FrameSync
from alpamayo_ros.ros import convert, qos
from alpamayo_ros.ros.params import declare_parameters
from alpamayo_ros.settings import SPECS, CameraInput, ParameterError, check_value, parse_settings, sampling_settings
from alpamayo_ros_msgs.msg import Reasoning, StageTimings, TrajectorySet

NODE_NAME = "alpamayo_drive"
LOG_THROTTLE_S = 5.0
WARMUP_SIZE = (576, 320)  # (width, height) of warm-up frames when images.* keep native size
NS_PER_MS = 1_000_000
CLOSE_TIMEOUT_S = 30.0


@dataclass
class PlanJob:
    """One accepted planning request; settings are snapshotted so updates never tear a plan."""

    assembly: Assembly
    sampling: SamplingSettings
    selection: str
    max_first_waypoint_error_m: float
    route_text: str
    assemble_ms: float  # building the DrivingInput (frame selection, ego history, image stacking)
    last_arrival_ns: int  # node clock when the newest frame of the cameras' newest had been converted


@dataclass
class Stats:
    """Counters and last values reported in diagnostics (guarded by DriveNode._lock)."""

    state: str = "loading"  # loading | warming_up | ready | failed
    ticks: int = 0
    plans: int = 0
    overruns: int = 0
    repeated_t0: int = 0  # ticks that found no newer frames than the last plan
    frames: int = 0
    errors: int = 0
    rejected: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    outcome: str = "none"  # none | planned | rejected | error
    last_rejection: str = ""
    last_error: str = ""
    timings_ms: dict[str, float] = field(default_factory=dict)
    input_age_ms: float = math.nan
    latency_ms: float = math.nan
    skew_ms: float = math.nan
    load_ms: float = math.nan
    warmup_ms: float = math.nan


def gate_plan(
    plan: Plan, history_xyz: np.ndarray, history_dt_s: float, max_first_waypoint_error_m: float
) -> tuple[str, str] | None:
    """(reason, detail) when a plan must not be published, else None.

    The first waypoint (t0 + one step) must lie where the history's last speed puts the ego,
    within the tolerance: a plan starting metres away cannot be followed.
    """
    if not (np.isfinite(plan.xyz).all() and np.isfinite(plan.rot).all()):
        return "plan_nonfinite", "the model returned non-finite waypoints"
    speed = float(np.linalg.norm(history_xyz[-1] - history_xyz[-2])) / history_dt_s
    expected = speed * WAYPOINT_DT_S
    errors = np.abs(np.linalg.norm(plan.xyz[:, 0, :2], axis=-1) - expected)
    worst = int(np.argmax(errors))
    if errors[worst] > max_first_waypoint_error_m:
        distance = float(np.linalg.norm(plan.xyz[worst, 0, :2]))
        return (
            "plan_far_from_ego",
            f"sample {worst}: first waypoint {distance:.2f} m from ego, expected {expected:.2f} m "
            f"(max error {max_first_waypoint_error_m:.2f} m)",
        )
    return None


class DriveNode(Node):
    """Plans with Alpamayo from time-synced cameras and odometry; see the module docstring."""

    def __init__(self, **node_kwargs: Any) -> None:
        super().__init__(NODE_NAME, **node_kwargs)
        self._values = declare_parameters(self)
        settings = parse_settings(self._values)  # ParameterError names the parameter at fault
        self.settings = settings
        self._lock = threading.Lock()
        self._stats = Stats()
        self._frame_sync: FrameSync[np.ndarray] = FrameSync(settings.frame_sync)
        self._odometry = OdometryBuffer(settings.ego_history)
        self._odometry_frame_id = ""
        self._route: tuple[str, int] | None = None  # (text, node clock ns at arrival)
        self._camera_errors: dict[int, messages.ImageRejected] = {}
        self._last_tick_ns: int | None = None
        self._last_planned_t0_ns = -1
        self._last_tried_t0_ns = -1  # frames trigger: each complete frame set gets one attempt
        self._arrived_ns: dict[int, int] = {}  # frames trigger: node clock at each camera's newest frame
        self._idle_since_ns = 0  # frames trigger: node clock when the worker last became free
        self._sampling = settings.sampling
        self._selection = settings.selection
        self._max_first_waypoint_error_m = settings.max_first_waypoint_error_m
        self._pipeline: Any = None

        camera_qos, odometry_qos = qos.camera_profile(settings.qos), qos.odometry_profile(settings.qos)
        navigation_qos, output_qos = qos.navigation_profile(settings.qos), qos.output_profile(settings.qos)
        for name, chosen in (
            ("cameras", camera_qos),
            ("odometry", odometry_qos),
            ("navigation", navigation_qos),
            ("outputs", output_qos),
        ):
            self.get_logger().info(f"QoS {qos.describe(name, chosen)}")
        for camera in settings.cameras:
            message_type = Image if camera.transport == "raw" else CompressedImage
            self.create_subscription(
                message_type, camera.topic, partial(self._guarded, self._on_image, camera), camera_qos
            )
            self.get_logger().info(f"camera {camera.index} <- {camera.topic} ({camera.transport})")
        self.create_subscription(
            Odometry, settings.odometry_topic, partial(self._guarded, self._on_odometry), odometry_qos
        )
        self.create_subscription(
            String, settings.navigation_topic, partial(self._guarded, self._on_navigation), navigation_qos
        )

        self._path_pub = self.create_publisher(Path, "~/output/path", output_qos)
        self._trajectories_pub = self.create_publisher(TrajectorySet, "~/output/trajectories", output_qos)
        self._reasoning_pub = self.create_publisher(Reasoning, "~/output/reasoning", output_qos)
        self._coc_pub = self.create_publisher(String, "~/output/coc", output_qos)
        self._timings_pub = self.create_publisher(StageTimings, "~/output/timings", output_qos)
        self._markers_pub = self.create_publisher(MarkerArray, "~/debug/markers", output_qos)
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, "/diagnostics", output_qos)

        on_tick = self._on_planning_tick if settings.planning_trigger == "timer" else self._on_watchdog_tick
        self.create_timer(settings.planning_period_s, partial(self._guarded, on_tick))
        self.create_timer(settings.diagnostics_period_s, partial(self._guarded, self._publish_diagnostics))
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self.add_post_set_parameters_callback(self._after_set_parameters)

        self._job: PlanJob | None = None
        self._busy = False
        self._stopping = False
        self._wakeup = threading.Condition()
        self._worker = threading.Thread(target=self._worker_main, name="alpamayo_inference", daemon=True)
        self._worker.start()

    # ---- callbacks (the executor thread; never wait for inference) ----

    def _guarded(self, callback: Callable[..., None], *args: Any) -> None:
        """Run a callback; an exception is counted and logged (throttled), never propagated."""
        try:
            callback(*args)
        except Exception as exc:  # noqa: BLE001 - the node must survive any bad message
            with self._lock:
                self._stats.errors += 1
                self._stats.last_error = f"{callback.__name__}: {type(exc).__name__}: {exc}"
            self.get_logger().error(f"{callback.__name__} failed: {exc!r}", throttle_duration_sec=LOG_THROTTLE_S)

    def _on_image(self, camera: CameraInput, msg: Image | CompressedImage) -> None:
        try:
            rgb = messages.raw_image_to_rgb(msg) if camera.transport == "raw" else messages.compressed_image_to_rgb(msg)
            rgb = messages.fit_image(rgb, self.settings.image_size)
        except messages.ImageRejected as exc:
            with self._lock:
                self._camera_errors[camera.index] = exc
                self._stats.dropped[exc.reason] += 1
            self.get_logger().warning(
                f"camera {camera.index} ({camera.topic}): dropped frame: {exc}", throttle_duration_sec=LOG_THROTTLE_S
            )
            return
        stamp_ns = messages.stamp_to_ns(msg.header.stamp)
        with self._lock:
            self._camera_errors.pop(camera.index, None)
            self._frame_sync.add(camera.index, stamp_ns, rgb)
            self._stats.frames += 1
            self._arrived_ns[camera.index] = self._now_ns()
            fresh_t0_ns = self._fresh_set_t0() if self.settings.planning_trigger == "frames" else None
            if fresh_t0_ns is not None:
                self._last_tried_t0_ns = fresh_t0_ns
        if fresh_t0_ns is not None:
            self._on_planning_tick()

    def _fresh_set_t0(self) -> int | None:
        """The t0 of a frame set to plan now: every camera's newest frame arrived after the
        worker became free (so a set that completed during the last plan waits for its
        successor instead of going out stale), and that t0 was not tried yet.

        t0 is the lagging camera's newest stamp, as FrameSync.select picks it. Arrival times
        are on the node's clock, so camera stamps need not be. The caller holds the lock.
        """
        if self._busy or self._stats.state != "ready":
            return None
        if any(self._arrived_ns.get(c.index, -1) < self._idle_since_ns for c in self.settings.cameras):
            return None
        newest = self._frame_sync.newest_stamps().values()
        if None in newest:
            return None
        t0_ns = min(newest)  # every plan of this mode was tried first: no need to check planned t0s
        return t0_ns if t0_ns > self._last_tried_t0_ns else None

    def _on_odometry(self, msg: Odometry) -> None:
        stamp_ns, xyz, quat = messages.odometry_pose(msg)
        with self._lock:
            self._odometry.add(stamp_ns, xyz, quat)
            self._odometry_frame_id = msg.header.frame_id
        if not (np.isfinite(xyz).all() and np.isfinite(quat).all()):
            self.get_logger().warning("non-finite odometry received", throttle_duration_sec=LOG_THROTTLE_S)

    def _on_navigation(self, msg: String) -> None:
        text = msg.data.strip()
        with self._lock:
            self._route = (text, self._now_ns()) if text else None

    def _on_planning_tick(self) -> None:
        now_ns = self._now_ns()
        with self._lock:
            outcome = self._take_tick(now_ns)
            reason_changed = isinstance(outcome, tuple) and self._record_rejection(*outcome)
        if isinstance(outcome, PlanJob):
            with self._wakeup:
                self._job = outcome
                self._wakeup.notify()
        elif reason_changed:
            self._publish_diagnostics()  # every new reason reaches diagnostics, not just the 1 Hz sample

    def _on_watchdog_tick(self) -> None:
        """planning.trigger = frames: report missing, stale or unsynced cameras (the frames start
        the plans). Frame selection only: no images are stacked."""
        now_ns = self._now_ns()
        with self._lock:
            self._check_clock(now_ns)
            if self._stats.state != "ready" or self._busy:
                return
            problem = self._camera_error()
            if problem is None:
                frames = self._frame_sync.select(now_ns=now_ns)
                if isinstance(frames, Rejection):
                    if frames.reason is RejectReason.TIME_BACKWARDS:
                        self._forget_t0s()
                    problem = frames.reason.value, frames.detail
            reason_changed = problem is not None and self._record_rejection(*problem)
        if reason_changed:
            self._publish_diagnostics()

    def _check_clock(self, now_ns: int) -> None:
        """A node clock that went back (a looping bag under use_sim_time) clears all input."""
        if self._last_tick_ns is not None and now_ns < self._last_tick_ns:
            detail = f"node clock went back {(self._last_tick_ns - now_ns) / 1e9:.3f} s"
            self._frame_sync.reset(detail)
            self._odometry.reset(detail)
            self._forget_t0s()
        self._last_tick_ns = now_ns

    def _forget_t0s(self) -> None:
        """After time went back: the new timeline's times are all smaller than the ones seen."""
        self._last_planned_t0_ns = self._last_tried_t0_ns = -1
        self._idle_since_ns = 0
        self._arrived_ns.clear()

    def _take_tick(self, now_ns: int) -> PlanJob | tuple[str, str] | None:
        """Decide one tick under the lock: a job for the worker, a rejection, or nothing to do."""
        self._stats.ticks += 1
        self._check_clock(now_ns)
        if self._stats.state != "ready":
            return None
        if self._busy:
            self._stats.overruns += 1
            return None
        assemble_start = time.perf_counter()
        assembled = self._assemble(now_ns)
        assemble_ms = (time.perf_counter() - assemble_start) * 1e3
        if isinstance(assembled, Rejection):
            if assembled.reason is RejectReason.TIME_BACKWARDS:
                self._forget_t0s()  # the new timeline's t0s are all smaller
            return assembled.reason.value, assembled.detail
        if isinstance(assembled, tuple):
            return assembled
        if assembled.driving_input.t0_ns <= self._last_planned_t0_ns:
            self._stats.repeated_t0 += 1
            return None
        self._last_planned_t0_ns = assembled.driving_input.t0_ns
        self._busy = True
        return PlanJob(
            assembly=assembled,
            sampling=self._sampling,
            selection=self._selection,
            max_first_waypoint_error_m=self._max_first_waypoint_error_m,
            route_text=assembled.driving_input.route_text or "",
            assemble_ms=assemble_ms,
            last_arrival_ns=max(self._arrived_ns.values(), default=now_ns),
        )

    def _assemble(self, now_ns: int) -> Assembly | Rejection | tuple[str, str]:
        """Build the input under the lock; a camera whose newest message was bad blocks planning."""
        camera_error = self._camera_error()
        if camera_error is not None:
            return camera_error
        route_text = None
        if self._route is not None:
            text, arrived_ns = self._route
            max_age_ns = self.settings.navigation_max_age_ns
            route_text = text if max_age_ns == 0 or now_ns - arrived_ns <= max_age_ns else None
        return build_driving_input(self._frame_sync, self._odometry, now_ns=now_ns, route_text=route_text)

    def _camera_error(self) -> tuple[str, str] | None:
        """(reason, detail) of the first camera whose newest message was bad (caller holds the lock)."""
        for camera in self.settings.cameras:
            error = self._camera_errors.get(camera.index)
            if error is not None:
                return error.reason, f"camera {camera.index} ({camera.topic}): {error.detail}"
        return None

    def _record_rejection(self, reason: str, detail: str) -> bool:
        """Count a skipped plan (caller holds the lock); True when the reason is new."""
        changed = self._stats.outcome != "rejected" or not self._stats.last_rejection.startswith(f"{reason}:")
        self._stats.rejected[reason] += 1
        self._stats.outcome = "rejected"
        self._stats.last_rejection = f"{reason}: {detail}"
        self.get_logger().warning(f"no plan: {reason}: {detail}", throttle_duration_sec=LOG_THROTTLE_S)
        return changed

    def _on_set_parameters(self, parameters: list[Parameter]) -> SetParametersResult:
        """Validate runtime changes (only sampling.* and gates.* are writable)."""
        merged = dict(self._values)
        try:
            for parameter in parameters:
                if parameter.name in SPECS:
                    check_value(parameter.name, parameter.value)
                    merged[parameter.name] = parameter.value
            sampling_settings(merged)
        except (ParameterError, ValueError) as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        return SetParametersResult(successful=True)

    def _after_set_parameters(self, parameters: list[Parameter]) -> None:
        with self._lock:
            for parameter in parameters:
                if parameter.name in SPECS:
                    self._values[parameter.name] = parameter.value
            self._sampling = sampling_settings(self._values)
            self._selection = self._values["sampling.selection"]
            self._max_first_waypoint_error_m = float(self._values["gates.max_first_waypoint_error_m"])

    # ---- worker thread ----

    def _worker_main(self) -> None:
        """Load and warm up the model, then run jobs until close()."""
        try:
            if not self._load_model():
                return
            while True:
                with self._wakeup:
                    while self._job is None and not self._stopping:
                        self._wakeup.wait()
                    if self._stopping:
                        return
                    job, self._job = self._job, None
                try:
                    self._run(job)
                except Exception as exc:  # noqa: BLE001 - reported, and the worker keeps serving
                    if not self._stopping:
                        self._record_error("internal_error", exc)
                finally:
                    with self._lock:
                        self._busy = False
                        self._idle_since_ns = self._now_ns()
        except Exception as exc:  # noqa: BLE001 - only publishing after shutdown gets here
            if not self._stopping:
                self.get_logger().error(f"inference worker stopped: {exc!r}")
        finally:
            if self._pipeline is not None:
                self._pipeline.close()  # the thread that used the engine releases it (vLLM: GPU memory)

    def _load_model(self) -> bool:
        settings = self.settings
        try:
            from alpamayo_ros.core.pipeline import Pipeline  # torch is imported here, not by the ROS layer

            started = time.perf_counter()
            self._pipeline = Pipeline.from_checkpoint(
                settings.checkpoint_path, backend=settings.backend, device=settings.device,
                dtype=settings.dtype, backend_options=settings.backend_options,
            )  # fmt: skip
            load_ms = (time.perf_counter() - started) * 1e3
            with self._lock:
                self._stats.load_ms, self._stats.state = load_ms, "warming_up"
            self.get_logger().info(
                f"model {settings.model_id} loaded ({settings.backend}, {settings.device}) in {load_ms:.0f} ms"
            )
            started = time.perf_counter()
            self._pipeline.plan(self._warmup_input(), self._sampling)
            warmup_ms = (time.perf_counter() - started) * 1e3
        except Exception as exc:  # noqa: BLE001 - reported in diagnostics; the node stays up
            with self._lock:
                self._stats.state = "failed"
                self._stats.last_error = (
                    f"model load failed: {type(exc).__name__}: {exc} "
                    "(check model.checkpoint_path, model.backend, model.device, model.dtype)"
                )
            self.get_logger().error(self._stats.last_error)
            self._publish_diagnostics()
            return False
        with self._lock:
            self._stats.warmup_ms, self._stats.state = warmup_ms, "ready"
            self._idle_since_ns = self._now_ns()
        self.get_logger().info(f"warm-up plan took {warmup_ms:.0f} ms; ready")
        self._publish_diagnostics()
        return True

    def _warmup_input(self) -> DrivingInput:
        """A plausible synthetic input (straight drive at 5 m/s) in the configured layout."""
        sync, history = self.settings.frame_sync, self.settings.ego_history
        width, height = self.settings.image_size or WARMUP_SIZE
        cameras = len(sync.camera_indices)
        poses = history.num_poses
        xyz = np.zeros((poses, 3), dtype=np.float32)
        xyz[:, 0] = -5.0 * history.dt_ns / 1e9 * np.arange(poses - 1, -1, -1)
        stamps = np.arange(sync.frames_per_camera, dtype=np.int64) * sync.frame_spacing_ns
        return DrivingInput(
            images=np.full((cameras, sync.frames_per_camera, height, width, 3), 128, dtype=np.uint8),
            camera_indices=sync.camera_indices,
            frame_stamps_ns=np.tile(stamps, (cameras, 1)),
            t0_ns=int(stamps[-1]),
            ego_history_xyz=xyz,
            ego_history_rot=np.tile(np.eye(3, dtype=np.float32), (poses, 1, 1)),
        )

    def _run(self, job: PlanJob) -> None:
        driving_input = job.assembly.driving_input
        started_ns = self._now_ns()
        try:
            plan = self._pipeline.plan(driving_input, job.sampling)
        except Exception as exc:  # noqa: BLE001 - a model failure skips this plan only
            self._record_error("model_error", exc)
            return
        gate = gate_plan(
            plan, driving_input.ego_history_xyz, self.settings.ego_history.dt_ns / 1e9, job.max_first_waypoint_error_m
        )
        if gate is not None:
            with self._lock:
                self._record_rejection(*gate)
            self._publish_diagnostics()
            return
        self._publish_plan(job, plan, started_ns)

    def _record_error(self, reason: str, exc: Exception) -> None:
        with self._lock:
            self._stats.errors += 1
            self._stats.rejected[reason] += 1
            self._stats.outcome = "error"
            self._stats.last_error = f"{reason}: {type(exc).__name__}: {exc}"
        self.get_logger().error(f"{reason}: {exc!r}", throttle_duration_sec=LOG_THROTTLE_S)
        self._publish_diagnostics()

    def _publish_plan(self, job: PlanJob, plan: Plan, started_ns: int) -> None:
        """Publish every output stamped with t0; the Path goes last, after its companions."""
        settings = self.settings
        ego = job.assembly.ego
        t0_ns = job.assembly.driving_input.t0_ns
        with self._lock:
            odometry_frame_id = self._odometry_frame_id
        if settings.output_frame == "odom":
            xyz, rot = convert.to_frame(plan.xyz, plan.rot, ego.xyz_t0, ego.rot_t0)
            header = Header(stamp=convert.ns_to_stamp(t0_ns), frame_id=odometry_frame_id or "odom")
            text_position = ego.xyz_t0
        else:
            xyz, rot = convert.to_frame(plan.xyz, plan.rot, None, None)
            header = Header(stamp=convert.ns_to_stamp(t0_ns), frame_id=settings.ego_frame_id)
            text_position = np.zeros(3)
        selected, scores = convert.select_sample(plan.xyz, job.selection)
        shown = max(selected, 0)
        coc = plan.coc[shown] if plan.coc else ""
        self._trajectories_pub.publish(
            convert.trajectory_set_message(header, xyz, rot, WAYPOINT_DT_S, scores, selected, job.selection)
        )
        self._reasoning_pub.publish(
            Reasoning(
                header=header, coc=coc, sample_cocs=list(plan.coc), navigation_command=job.route_text,
                backend=plan.backend, model_id=settings.model_id,
                generated_tokens=len(plan.generated_ids[shown]) if plan.generated_ids else 0,
            )
        )  # fmt: skip
        self._coc_pub.publish(String(data=coc))
        self._markers_pub.publish(convert.marker_array_message(header, xyz, selected, coc, text_position))
        published_ns = self._now_ns()
        # The node's input side, next to the pipeline's stages: input_wait is how long the last
        # frame needed had been converted and buffered before inference started (tick wait and
        # assembly), so input_age - input_wait is capture -> frame ready in the node.
        timings_ms = {
            **plan.timings_ms,
            "node.assemble": job.assemble_ms,
            "node.input_wait": (started_ns - job.last_arrival_ns) / NS_PER_MS,
        }
        with self._lock:
            self._stats.plans += 1
            self._stats.outcome = "planned"
            self._stats.timings_ms = timings_ms
            self._stats.input_age_ms = (started_ns - t0_ns) / NS_PER_MS
            self._stats.latency_ms = (published_ns - t0_ns) / NS_PER_MS
            self._stats.skew_ms = job.assembly.frames.skew_ns / NS_PER_MS
            overruns = self._stats.overruns
        self._timings_pub.publish(
            StageTimings(
                header=header, stage_names=list(timings_ms), stage_ms=[float(v) for v in timings_ms.values()],
                input_age_ms=float((started_ns - t0_ns) / NS_PER_MS), latency_ms=float((published_ns - t0_ns) / NS_PER_MS),
                overruns=overruns,
            )
        )  # fmt: skip
        if selected >= 0:
            self._path_pub.publish(convert.path_message(header, xyz[selected], rot[selected], WAYPOINT_DT_S))
        self._publish_diagnostics()

    # ---- diagnostics ----

    def _publish_diagnostics(self) -> None:
        now_ns = self._now_ns()
        with self._lock:
            status = self._diagnostic_status(now_ns)
        self._diagnostics_pub.publish(
            DiagnosticArray(header=Header(stamp=convert.ns_to_stamp(now_ns)), status=[status])
        )

    def _diagnostic_status(self, now_ns: int) -> DiagnosticStatus:
        """One status for the whole node (caller holds the lock)."""
        stats = self._stats
        if stats.state == "failed":
            level, message = DiagnosticStatus.ERROR, stats.last_error
        elif stats.state != "ready":
            level, message = DiagnosticStatus.WARN, f"{stats.state.replace('_', ' ')}: not ready"
        elif stats.outcome == "error":
            level, message = DiagnosticStatus.ERROR, stats.last_error
        elif stats.outcome == "rejected":
            level, message = DiagnosticStatus.WARN, f"no plan: {stats.last_rejection}"
        elif stats.outcome == "planned":
            level, message = DiagnosticStatus.OK, "planning"
        else:
            level, message = DiagnosticStatus.OK, "ready, waiting for inputs"
        values: dict[str, Any] = {
            "state": stats.state,
            "ready": stats.state == "ready",
            "backend": self.settings.backend,
            "model_id": self.settings.model_id,
            "load_ms": stats.load_ms,
            "warmup_ms": stats.warmup_ms,
            "ticks": stats.ticks,
            "plans": stats.plans,
            "overruns": stats.overruns,
            "repeated_t0": stats.repeated_t0,
            "frames": stats.frames,
            "errors": stats.errors,
            "drop_ratio": sum(stats.dropped.values()) / max(stats.frames + sum(stats.dropped.values()), 1),
            "input_age_ms": stats.input_age_ms,
            "latency_ms": stats.latency_ms,
            "camera_skew_ms": stats.skew_ms,
            "last_rejection": stats.last_rejection,
            "last_error": stats.last_error,
        }
        for camera, newest in self._frame_sync.newest_stamps().items():
            values[f"camera_age_ms.{camera}"] = math.nan if newest is None else (now_ns - newest) / NS_PER_MS
        odometry_newest = self._odometry.newest_ns
        values["odometry_age_ms"] = math.nan if odometry_newest is None else (now_ns - odometry_newest) / NS_PER_MS
        values.update({f"rejected.{reason}": count for reason, count in sorted(stats.rejected.items())})
        values.update({f"dropped.{reason}": count for reason, count in sorted(stats.dropped.items())})
        values.update({f"stage_ms.{stage}": ms for stage, ms in stats.timings_ms.items()})
        return DiagnosticStatus(
            level=level,
            name=f"{self.get_fully_qualified_name()}: planner",
            message=message,
            hardware_id=self.settings.model_id,
            values=[KeyValue(key=key, value=_format(value)) for key, value in values.items()],
        )

    # ---- lifecycle ----

    def _now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    def close(self) -> None:
        """Stop the worker, letting a plan in flight finish (plans are bounded by the token cap).

        Exiting while the worker is inside torch aborts the interpreter at shutdown.
        """
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._worker.join(timeout=CLOSE_TIMEOUT_S)
        if self._worker.is_alive():
            self.get_logger().warning(f"inference still running after {CLOSE_TIMEOUT_S:.0f} s; exiting anyway")


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.1f}"
    return str(value)


def main(args: list[str] | None = None) -> int:
    """Console script: run the node until SIGINT; a bad parameter exits 2 naming it."""
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] [%(name)s]: %(message)s")
    try:
        with rclpy.init(args=args):
            try:
                node = DriveNode()
            except (ParameterError, ParameterException) as exc:
                rclpy.logging.get_logger(NODE_NAME).fatal(f"bad parameter, not starting: {exc}")
                return 2
            # Single-threaded on purpose: callbacks are short (inference has its own thread), and
            # rclpy's MultiThreadedExecutor busy-waits while a callback group is occupied, holding
            # the GIL, which made plans many times slower (0.4 s -> 6 s with the tiny model on CPU).
            executor = SingleThreadedExecutor()
            executor.add_node(node)
            try:
                executor.spin()
            finally:
                node.close()
                executor.shutdown(timeout_sec=1.0)
                node.destroy_node()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    return 0
