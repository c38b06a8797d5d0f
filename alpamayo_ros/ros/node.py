"""alpamayo_drive: cameras + odometry in; trajectories, reasoning and diagnostics out.

The node only wires ROS to two ROS-free parts:
- the DriveLoop (alpamayo_ros/drive/loop.py) takes the messages, turned into plain ones, and
  decides each planning attempt (decoding, frame selection, ego history, route check, triggers,
  t0 bookkeeping, overruns, the output gate, counters), as the bag evaluator does with it;
- the InferenceWorker (alpamayo_ros/drive/worker.py) loads the planner, warms it up and runs
  one of the loop's requests at a time in its own thread, with an explicit state machine.
One executor thread runs every callback (decode and buffer, the planning tick, diagnostics);
no callback waits for inference. A tick that finds the worker busy is an overrun (latest-only,
no backlog). Every refused input, failure and state is reported in diagnostics, and no callback
exception can kill the node.

Shutdown (SIGINT/SIGTERM): the worker is cancelled (a plan in flight stops at its next decode
or flow step) and, when ready, joined briefly, since only its jobs publish and ROS goes down
next. A model load or warm-up step, which cannot be interrupted, is left behind, and so is a
model the exit frees anyway (closing an in-process vLLM engine takes seconds); the process then
exits without running its interpreter teardown (process.py: the console script around the node).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from nav_msgs.msg import Odometry
from rcl_interfaces.msg import SetParametersResult
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.subscription import Subscription
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import Header, String

from alpamayo_ros.drive import messages
from alpamayo_ros.drive.loop import MODEL_ERROR, DriveLoop, Skipped, skipped
from alpamayo_ros.drive.planner import Planner, import_model_stack, make_planner, warmup_input
from alpamayo_ros.drive.scheduler import Dropped, Problem, TickOutcome
from alpamayo_ros.drive.worker import InferenceWorker, WorkerState
from alpamayo_ros.ros import convert, qos
from alpamayo_ros.ros.diagnostics import Outcomes, planner_status
from alpamayo_ros.ros.outputs import PlanJob, PlanPublisher
from alpamayo_ros.ros.params import (
    as_declared,
    declare_parameters,
    given_parameter_names,
    unknown_parameter_warnings,
)
from alpamayo_ros.settings import (
    SPECS,
    CameraInput,
    DriveSettings,
    ParameterError,
    check_value,
    parse_settings,
    sampling_settings,
)

NODE_NAME = "alpamayo_drive"
LOG_THROTTLE_S = 5.0
NS_PER_MS = 1_000_000
STOP_WAIT_S = 1.0  # a plan stops within one decode/flow step (a prefill can take longer)
EXIT_LOAD_FAILED = 1
# reasons that may mean nothing reaches a subscription: their log line names the matched publishers
SILENT_INPUT_REASONS = ("no_frames", "camera_stale", "no_odometry", "odometry_stale")


class DriveNode(Node):
    """Plans with Alpamayo from time-synced cameras and odometry; see the module docstring."""

    def __init__(self, *, ros_args: list[str] | None = None, **node_kwargs: Any) -> None:
        super().__init__(NODE_NAME, **node_kwargs)
        given = given_parameter_names(ros_args or [], self.get_fully_qualified_name())
        for warning in unknown_parameter_warnings(given):
            self.get_logger().warning(warning)
        self._values = declare_parameters(self)
        self.settings = settings = parse_settings(self._values)  # ParameterError names the parameter at fault
        self.exit_code: int | None = None  # set when the node must end on its own (failed load)
        self._loop = DriveLoop(settings)
        self._lock = self._loop.lock  # one lock for the loop and the node's outcomes
        self._outcomes = Outcomes()
        self._sampling = settings.sampling
        self._selection = settings.selection
        self._max_lateral_accel = settings.max_lateral_accel_mps2

        profiles = {
            "cameras": qos.camera_profile(settings.qos), "odometry": qos.odometry_profile(settings.qos),
            "navigation": qos.navigation_profile(settings.qos), "outputs": qos.output_profile(settings.qos),
        }  # fmt: skip
        for name, chosen in profiles.items():
            self.get_logger().info(f"QoS {qos.describe(name, chosen)}")
        self._inputs: dict[str, Subscription] = {}  # "camera 1 (/topic)" | "odometry (/topic)" -> subscription
        for camera in settings.cameras:
            message_type = Image if camera.transport == "raw" else CompressedImage
            callback = partial(self._guarded, self._on_image, camera)
            name = f"camera {camera.index} ({camera.topic})"
            self._inputs[name] = self.create_subscription(message_type, camera.topic, callback, profiles["cameras"])
            self.get_logger().info(f"camera {camera.index} <- {camera.topic} ({camera.transport})")
        self._inputs[f"odometry ({settings.odometry_topic})"] = self.create_subscription(
            Odometry, settings.odometry_topic, partial(self._guarded, self._on_odometry), profiles["odometry"]
        )
        self.create_subscription(
            String, settings.navigation_topic, partial(self._guarded, self._on_navigation), profiles["navigation"]
        )
        self._outputs = PlanPublisher(self, settings, profiles["outputs"])
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, "/diagnostics", profiles["outputs"])
        on_tick = self._on_planning_tick if settings.planning_trigger == "timer" else self._on_watchdog_tick
        self.create_timer(settings.planning_period_s, partial(self._guarded, on_tick))
        self.create_timer(settings.diagnostics_period_s, partial(self._guarded, self._publish_diagnostics))
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self.add_post_set_parameters_callback(self._after_set_parameters)
        self._worker: InferenceWorker | None = None  # start() makes it

    def start(self) -> None:
        """Import the model stack and start the inference worker (it loads and warms up the model).

        Apart from construction so that a SIGINT during the import, which takes seconds, finds a
        node that main() can still destroy. The import runs here, in the main thread: it holds
        Python's interpreter lock for seconds, and inside the worker's load it would keep this
        thread from handling a shutdown meanwhile (loading weights mostly releases the lock).
        """
        settings = self.settings
        self.get_logger().info(f"importing the {settings.backend} model stack")
        import_model_stack(settings)
        self._worker = InferenceWorker(
            partial(make_planner, settings), (warmup_input(settings), self._sampling),
            run_job=self._run_job, on_job_error=self._on_job_error, on_idle=self._on_idle,
            on_state=self._on_worker_state,
        )  # fmt: skip
        self._worker.start()

    # ---- callbacks (the executor thread; never wait for inference) ----

    def _guarded(self, callback: Callable[..., None], *args: Any) -> None:
        """Run a callback; an exception is counted and logged (throttled), never propagated."""
        try:
            callback(*args)
        except Exception as exc:  # noqa: BLE001 - the node must survive any bad message
            with self._lock:
                self._outcomes.errors += 1
                self._outcomes.last_error = f"{callback.__name__}: {type(exc).__name__}: {exc}"
            self.get_logger().error(f"{callback.__name__} failed: {exc!r}", throttle_duration_sec=LOG_THROTTLE_S)

    def _on_image(self, camera: CameraInput, msg: Image | CompressedImage) -> None:
        outcome = self._loop.on_camera(messages.camera_frame(camera.index, msg), self._now_ns())
        if isinstance(outcome, Dropped):
            self.get_logger().warning(f"dropped frame: {outcome}", throttle_duration_sec=LOG_THROTTLE_S)
        elif outcome is not None:  # planning.trigger frames: a complete set started a plan, or could not
            with self._lock:
                received = dict(self._loop.received)
            self._dispatch(outcome, received)

    def _on_odometry(self, msg: Odometry) -> None:
        odometry = messages.odometry(msg)
        problem = self._loop.on_odometry(odometry, self._now_ns())
        if problem is not None:
            self.get_logger().warning(f"odometry: {problem}", throttle_duration_sec=LOG_THROTTLE_S)
        if not (np.isfinite(odometry.xyz).all() and np.isfinite(odometry.quat_xyzw).all()):
            self.get_logger().warning("non-finite odometry received", throttle_duration_sec=LOG_THROTTLE_S)

    def _on_navigation(self, msg: String) -> None:
        refused = self._loop.on_route(messages.Route(msg.data), self._now_ns())
        if refused is not None:
            self.get_logger().warning(
                f"route refused, planning without it: {refused}", throttle_duration_sec=LOG_THROTTLE_S
            )
            self._publish_diagnostics()

    def _on_planning_tick(self) -> None:
        now_ns = self._now_ns()
        with self._lock:
            result = self._loop.tick(now_ns)
            received = dict(self._loop.received)
        if result.request is None:
            self._outputs.publish_tick(skipped(now_ns, result), received)
        if result.outcome is TickOutcome.STARTED or result.problem is not None:
            self._dispatch(result.request or result.problem, received)

    def _on_watchdog_tick(self) -> None:
        """planning.trigger = frames: the frames start the plans; ticks report bad input."""
        self._dispatch(self._loop.watchdog(self._now_ns()))

    def _dispatch(self, started: Any, received: dict[str, int] | None = None) -> None:
        """A started request goes to the worker; a problem to diagnostics."""
        if started is None:
            return
        if isinstance(started, Problem):
            with self._lock:
                changed = self._record_rejection(started)
            if changed:
                self._publish_diagnostics()  # every new reason reaches diagnostics, not just the sampled ones
            return
        with self._lock:
            job = PlanJob(started, self._sampling, self._selection, self._max_lateral_accel, received or {})
        self._worker.submit(job)

    def _record_rejection(self, problem: Problem) -> bool:
        """Note a skipped plan (caller holds the lock); True when the reason is new."""
        outcomes = self._outcomes
        changed = outcomes.outcome != "rejected" or not outcomes.last_rejection.startswith(f"{problem.reason}:")
        outcomes.outcome, outcomes.last_rejection = "rejected", str(problem)
        hint = f" (matched publishers: {self._publisher_counts()})" if problem.reason in SILENT_INPUT_REASONS else ""
        self.get_logger().warning(f"no plan: {problem}{hint}", throttle_duration_sec=LOG_THROTTLE_S)
        return changed

    def _publisher_counts(self) -> str:
        """How many publishers each input subscription is matched with: 0 means a wrong topic name,
        or a publisher whose QoS or Fast DDS transports (FASTDDS_BUILTIN_TRANSPORTS) do not match."""
        return ", ".join(f"{name} {sub.get_publisher_count()}" for name, sub in self._inputs.items())

    def _on_set_parameters(self, parameters: list[Parameter]) -> SetParametersResult:
        """Validate runtime changes (only sampling.* and gates.* are writable)."""
        merged = dict(self._values)
        try:
            for parameter in parameters:
                if parameter.name in SPECS:
                    value = as_declared(parameter.name, parameter.value)
                    check_value(parameter.name, value)
                    merged[parameter.name] = value
            sampling_settings(merged)
        except (ParameterError, ValueError) as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        return SetParametersResult(successful=True)

    def _after_set_parameters(self, parameters: list[Parameter]) -> None:
        with self._lock:
            for parameter in parameters:
                if parameter.name in SPECS:
                    self._values[parameter.name] = as_declared(parameter.name, parameter.value)
            self._sampling = sampling_settings(self._values)
            self._selection = self._values["sampling.selection"]
            self._max_lateral_accel = float(self._values["gates.max_lateral_accel_mps2"])

    # ---- worker callbacks (the worker thread) ----

    def _on_worker_state(self, state: WorkerState, detail: str) -> None:
        now_ns = self._now_ns()
        if state is WorkerState.FAILED:
            self.get_logger().error(detail)
        else:
            self.get_logger().info(f"{state.value}: {detail}" if detail else state.value)
        if state is WorkerState.READY:
            with self._lock:
                self._loop.ready(now_ns)
                self._outcomes.last_plan_ns = now_ns
        self._publish_diagnostics()
        if state is WorkerState.FAILED and not self.settings.stay_up_on_failure:
            self.get_logger().fatal("exiting with code 1 (set model.stay_up_on_failure to keep the node up)")
            self.exit_code = EXIT_LOAD_FAILED

    def _run_job(self, planner: Planner, job: PlanJob) -> None:
        driving_input = job.request.assembly.driving_input
        started_ns = self._now_ns()
        outcome = self._loop.run(job.request, planner=planner, sampling=job.sampling,
                                 max_lateral_accel_mps2=job.max_lateral_accel_mps2)  # fmt: skip
        if isinstance(outcome, Skipped):
            with self._lock:
                self._record_rejection(Problem(outcome.reason, outcome.detail))
            self._publish_diagnostics()
            self._outputs.publish_tick(outcome, job.received)
            return
        plan = outcome.plan
        timings_ms = {
            **plan.timings_ms,
            "node.assemble": job.request.assemble_ms,
            # newest frame's callback -> inference started (its decode, the tick wait, assembly):
            # input_age - input_wait is capture -> the frame reached the node
            "node.input_wait": (started_ns - job.request.last_arrival_ns) / NS_PER_MS,
        }
        published_ns = self._now_ns()
        with self._lock:
            outcomes = self._outcomes
            outcomes.plans += 1
            outcomes.outcome = "planned"
            outcomes.timings_ms = timings_ms
            outcomes.input_age_ms = (started_ns - driving_input.t0_ns) / NS_PER_MS
            outcomes.latency_ms = (published_ns - driving_input.t0_ns) / NS_PER_MS
            outcomes.skew_ms = job.request.assembly.frames.skew_ns / NS_PER_MS
            outcomes.last_plan_ns = published_ns
            overruns = self._loop.counters.tick_outcomes[TickOutcome.OVERRUN]
        self._outputs.publish(job, plan, timings_ms, started_ns, published_ns, overruns)
        self._publish_diagnostics()
        self._outputs.publish_tick(outcome, job.received)

    def _on_job_error(self, job: PlanJob, exc: Exception) -> None:
        with self._lock:
            self._outcomes.errors += 1
            self._loop.count_error()
            self._outcomes.outcome = "error"
            self._outcomes.last_error = f"model_error: {type(exc).__name__}: {exc}"
        self.get_logger().error(f"model_error: {exc!r}", throttle_duration_sec=LOG_THROTTLE_S)
        self._publish_diagnostics()
        request = job.request
        failed = Skipped(request.tick_ns, request.assembly.driving_input.t0_ns, MODEL_ERROR, f"{type(exc).__name__}: {exc}")
        self._outputs.publish_tick(failed, job.received)

    def _on_idle(self) -> None:
        self._loop.idle(self._now_ns())

    # ---- diagnostics ----

    def _publish_diagnostics(self) -> None:
        now_ns = self._now_ns()
        status = self._diagnostic_status(now_ns)
        header = Header(stamp=convert.ns_to_stamp(now_ns))
        self._diagnostics_pub.publish(DiagnosticArray(header=header, status=[status]))

    def _diagnostic_status(self, now_ns: int) -> DiagnosticStatus:
        """One status for the whole node."""
        worker = self._worker
        state, error = worker.state, worker.error
        with self._lock:
            return planner_status(
                f"{self.get_fully_qualified_name()}: planner", self.settings, now_ns, state=state,
                worker_error=error, load_ms=worker.load_ms, warmup_ms=worker.warmup_ms,
                outcomes=self._outcomes, scheduler=self._loop.scheduler, publishers=self._publisher_counts(),
            )  # fmt: skip

    # ---- lifecycle ----

    def _now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    def close(self) -> None:
        """Stop the worker before ROS goes down (see the module docstring); the process ends next."""
        if self._worker is None:
            self.get_logger().info("shutting down (before the model stack was imported)")
            return
        state = self._worker.state
        self.get_logger().info(f"shutting down ({state.value})")
        release = not _exit_frees_planner(self.settings)
        # before ready the worker never reaches ROS (it stops calling back once stopping)
        wait_s = STOP_WAIT_S if release or state is WorkerState.READY else 0.0
        if not self._worker.stop(timeout_s=wait_s, release=release):
            self.get_logger().info(f"inference worker still busy ({state.value}); exiting without it")


def _exit_frees_planner(settings: DriveSettings) -> bool:
    """Whether ending the process frees all the planner holds, so closing it first only delays the
    exit: true unless vLLM runs tensor-parallel workers, which are processes of their own, or the
    planner is remote: its shared-memory segment outlives the process unless close() unlinks it
    (the exit skips interpreter teardown, so no finalizer would), and closing it is instant."""
    return settings.remote is None and settings.backend_options.get("tensor_parallel_size", 1) == 1
