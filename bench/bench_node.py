"""Node-level latency: camera messages in -> nav_msgs/Path out, in separate processes.

Over 400 lines: one benchmark program (its three processes, the measures and their report) that
a user runs as a whole; its parts are used nowhere else.

bench_pipeline.py times `Pipeline.plan()` alone; this harness shows what the ROS node adds on top.
Three processes, all on wall-clock time (no sim time; one host, so one clock):
  * the drive node, started from its console script with a params file (as the tests and demo do);
  * a publisher: the tests' SensorRig (alpamayo_ros.testing.rig; 10 Hz cameras, 50 Hz odometry)
    sending one pre-built frame per camera per tick (rendered by the demo's scene code), all
    cameras with the same stamp;
  * this process, which listens to the node's Path and StageTimings (`~/output/timings`).

Per plan, t0 is the stamp of the newest camera messages the node planned from (the Path's stamp):
  e2e_ms                 Path received here - wall time at which publish() was called for the last t0
                         camera message ("published" below: the call, so a receipt can never precede it)
  latency_ms             StageTimings: node clock at publication (before the Path itself) - t0
  input_age_ms           StageTimings: node clock when inference started - t0
  total_ms               the pipeline's own `total` stage
  node_overhead_ms       latency_ms - input_age_ms - total_ms: the node's work per plan outside the
                         pipeline (output gates, conversion, publishing the companion outputs)
  publish_lag_ms         t0 stamp -> last t0 camera message published (the publisher's own cost)
  inbound_ms             input_age_ms - publish_lag_ms: t0 published -> inference started, split into
  receive_ms             inbound_ms - input_wait_ms: published -> the node's image callback starts
                         (the publish call itself, DDS transport, rclpy deserialisation, callback queueing)
  input_wait_ms          StageTimings `node.input_wait`: newest frame's callback -> inference started
                         (decode/copy, waiting for the planning tick, input assembly: `node.assemble`)
  transport_queueing_ms  e2e_ms - latency_ms + publish_lag_ms: the node publishing StageTimings and the
                         Path, DDS transport, and this process's executor
so e2e_ms = inbound_ms + total_ms + node_overhead_ms + transport_queueing_ms.

node_overhead_ms cannot see a node that slows `plan()` itself; `--reference-plans N` then times the
pipeline alone on the same workload (after the node has exited) for that comparison. Sampling is
greedy by default, as in bench_pipeline.py; --temperature 0.6 is the node's own default, which adds
top-p over the whole vocabulary to every reasoning token (~15 ms a token on this CPU).

    .venv/bin/python -m bench.bench_node --transport compressed --plans 20          # tiny model, CPU
    .venv/bin/python -m bench.bench_node --checkpoint /models/Alpamayo-1.5-10B --backend vllm \\
        --device cuda --transport raw --plans 200 --json out/bench_node_raw.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import cv2
import numpy as np

from diagnostic_msgs.msg import DiagnosticArray
from nav_msgs.msg import Path as PathMsg
from alpamayo_ros.testing.rig import (
    CameraFeed,
    Collector,
    RosSide,
    SensorRig,
    diag_values,
    log_excerpt,
    ros_env,
    start_console_script,
    start_python,
    stop_process,
    unique_domain_id,
    wait_until,
    write_params_file,
)
from sensor_msgs.msg import CompressedImage, Image

from alpamayo_ros.core.types import CAMERAS
from alpamayo_ros.eval.scene import PinholeCamera, Renderer, Road, Vehicle, default_rig
from alpamayo_ros.inputs.messages import stamp_to_ns
from alpamayo_ros.ros.convert import ns_to_stamp
from alpamayo_ros.ros.teardown import TeardownGuard
from alpamayo_ros.settings import parse_param_overrides
from alpamayo_ros_msgs.msg import Reasoning, StageTimings

logger = logging.getLogger("bench_node")

NODE = "alpamayo_drive"
PATH_TOPIC = f"/{NODE}/output/path"
TIMINGS_TOPIC = f"/{NODE}/output/timings"
REASONING_TOPIC = f"/{NODE}/output/reasoning"
ODOMETRY_TOPIC = "/bench/odom"
NS_PER_MS = 1_000_000
JPEG_QUALITY = 90
STOP_TIMEOUT_S = 60.0  # a node finishes its plan in flight before it exits
FIRST_FRAME_TIMEOUT_S = 30.0  # publisher's first tick sent -> the node must have decoded a camera frame
# Camera mounts for indices the demo's rig lacks: (yaw degrees, horizontal field of view degrees).
EXTRA_MOUNTS = {3: (150.0, 120.0), 4: (180.0, 30.0), 5: (-150.0, 120.0), 6: (0.0, 30.0)}
# (report key, table label) in table order; e2e = inbound + total + node overhead + transport/queueing
MEASURES = (
    ("e2e_ms", "end-to-end: t0 cameras published -> Path received"),
    ("latency_ms", "node latency_ms: t0 -> outputs published"),
    ("input_age_ms", "node input_age_ms: t0 -> inference started"),
    ("total_ms", "pipeline `total` stage"),
    ("node_overhead_ms", "**node overhead**: latency - input_age - total"),
    ("inbound_ms", "inbound: published -> inference started (transport, decode, tick wait)"),
    ("receive_ms", "· receive: published -> image callback in the node"),
    ("input_wait_ms", "· input wait: newest frame's callback -> inference started"),
    ("transport_queueing_ms", "transport+queueing: Path published -> received"),
    ("publish_lag_ms", "publisher: t0 stamp -> last t0 message published"),
)


# ---- publisher process ----


def camera_topic(index: int, transport: str) -> str:
    return f"/bench/{CAMERAS[index][0]}/image" + ("/compressed" if transport == "compressed" else "")


def render_frames(indices: list[int], width: int, height: int, noise_std: float) -> dict[int, np.ndarray]:
    """One RGB frame per camera from the demo's road scene, with sensor-like noise.

    Noise matters for compressed transport: a flat rendering compresses to ~60 KB at 1080p, a
    camera image to a few hundred, and JPEG decode time in the node grows with that.
    """
    mounts = {camera.index: camera for camera in default_rig(width, height)}
    for index, (yaw_deg, fov_deg) in EXTRA_MOUNTS.items():
        mounts[index] = PinholeCamera(index, width, height, fov_deg, x_m=1.8, yaw=math.radians(yaw_deg))
    road = Road.winding()
    renderer = Renderer(road, tuple(mounts[index] for index in indices))
    rng = np.random.default_rng(0)
    frames = {}
    for index, rgb in renderer.render_rig(Vehicle.on_road(road).pose).items():
        noisy = rgb.astype(np.float32) + rng.normal(0.0, noise_std, rgb.shape).astype(np.float32)
        frames[index] = np.clip(noisy, 0, 255).astype(np.uint8)
    return frames


def image_message(rgb: np.ndarray, transport: str, frame_id: str) -> Image | CompressedImage:
    """The message a camera driver would send for this frame (stamp set per tick)."""
    if transport == "raw":
        height, width = rgb.shape[:2]
        msg = Image(height=height, width=width, encoding="rgb8", step=width * 3, data=rgb.tobytes())
    else:
        bgr = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)
        ok, encoded = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
        if not ok:
            raise ValueError(f"JPEG encoding failed for a {rgb.shape} frame")
        msg = CompressedImage(format="jpeg", data=encoded.tobytes())
    msg.header.frame_id = frame_id
    return msg


class _TimedPublisher:
    """Wraps a publisher to report (stamp, wall ns just before publish()) per message.

    Why before, not after: the subscriber may run (and take the message) while publish() is still
    returning here, so a time read after the call can be later than the receipt it caused.
    """

    def __init__(self, publisher: Any, on_published: Callable[[int, int], None]) -> None:
        self._publisher, self._on_published = publisher, on_published

    def publish(self, msg: Any) -> None:
        self._on_published(stamp_to_ns(msg.header.stamp), time.time_ns())
        self._publisher.publish(msg)

    def get_subscription_count(self) -> int:
        return self._publisher.get_subscription_count()


class FramePublisher(SensorRig):
    """The suite's SensorRig (wall-clock stamps, 10 Hz cameras, 50 Hz odometry) sending pre-built frames.

    Why not SensorRig's own frames: it draws and JPEG-encodes every frame on every tick, which at
    1080x1920 takes longer than a tick on a small CPU; here each camera's message is built once and
    only restamped. Every camera gets the tick's stamp (SensorRig staggers them by 2 ms per index),
    and each tick's publish wall times are appended to a JSON-lines log that the bench reads.
    """

    CAMERA_STAGGER_NS = 2_000_000  # SensorRig adds index * this to each camera's stamp

    def __init__(
        self, side: RosSide, cameras: list[CameraFeed], messages: dict[int, Any], *, odometry_topic: str, log: TextIO
    ) -> None:
        for camera in cameras:
            camera.stamp_offset_ns = -camera.index * self.CAMERA_STAGGER_NS
        super().__init__(side, cameras, odometry_topic=odometry_topic)
        self._messages, self._log = messages, log
        self._pending: dict[int, list[int]] = {}  # stamp -> [first publish call, last publish call, messages]
        self._camera_pubs = {index: _TimedPublisher(pub, self._published) for index, pub in self._camera_pubs.items()}

    @property
    def publishing(self) -> bool:
        """Whether the publishing thread still runs (after stop(): stuck in a publish() call)."""
        return self._thread.is_alive()

    def _image_message(self, camera: CameraFeed, stamp_ns: int) -> Any:
        msg = self._messages[camera.index]
        msg.header.stamp = ns_to_stamp(stamp_ns)
        return msg

    def _published(self, stamp_ns: int, called_ns: int) -> None:
        tick = self._pending.setdefault(stamp_ns, [called_ns, called_ns, 0])
        tick[1], tick[2] = called_ns, tick[2] + 1
        if tick[2] == len(self.cameras):
            del self._pending[stamp_ns]
            self._log.write(json.dumps({"stamp_ns": stamp_ns, "first_ns": tick[0], "last_ns": tick[1]}) + "\n")
            self._log.flush()


TEARDOWN_GUARD_S = 30.0  # half the bench's SIGINT wait for the publisher (STOP_TIMEOUT_S), over RosSide.close's own waits


def run_publisher(config_path: Path) -> int:
    """The publisher process: publish until SIGINT, then close DDS and exit 0."""
    config = json.loads(config_path.read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    transport, width, height = config["transport"], config["width"], config["height"]
    frames = render_frames(config["cameras"], width, height, config["noise_std"])
    messages = {index: image_message(rgb, transport, CAMERAS[index][0]) for index, rgb in frames.items()}
    sizes = {index: len(msg.data) for index, msg in messages.items()}
    logger.info("%s %dx%d frames, bytes per message: %s", transport, width, height, sizes)
    cameras = [CameraFeed(i, camera_topic(i, transport), transport, shape=(height, width)) for i in config["cameras"]]
    # Blocked before any thread exists (DDS's and the rig's inherit the mask) and taken by sigwait
    # below: rclpy's own SIGINT handler would shut the context down under the publishing thread.
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    side = RosSide(int(os.environ["ROS_DOMAIN_ID"]), "bench_publisher")
    with open(config["stamps_log"], "w") as log:
        rig = FramePublisher(side, cameras, messages, odometry_topic=config["odometry_topic"], log=log).start()
        received = signal.sigwait(stop_signals)
        logger.info("%s: stopping after %d camera ticks", signal.Signals(received).name, len(cameras[0].stamps_ns))
        # The frames are all published by now: a stalled DDS teardown must not cost the run its figures.
        TeardownGuard("publisher", step="ROS teardown").start(TEARDOWN_GUARD_S)
        rig.stop()
        if rig.publishing:
            logger.warning("the publishing thread is still inside publish() after 5 s")
    side.close()
    logger.info("ROS closed; exiting")
    return 0


# ---- bench process ----


class WallCollector(Collector):
    """Collector that stamps receipts with wall time (time.time_ns()), comparable across processes."""

    def __call__(self, msg: Any) -> None:
        with self._lock:
            self._items.append((time.time_ns(), msg))


def node_parameters(args: argparse.Namespace, checkpoint: Path) -> dict[str, Any]:
    """The drive node's parameters for this bench (written to OUT/drive.yaml)."""
    params: dict[str, Any] = {
        "model.checkpoint_path": str(checkpoint),
        "model.backend": args.backend,
        "model.device": args.device,
        "cameras.topics": [camera_topic(index, args.transport) for index in args.cameras],
        "cameras.indices": list(args.cameras),
        "cameras.transports": [args.transport] * len(args.cameras),
        "odometry.topic": ODOMETRY_TOPIC,
        "sampling.max_reasoning_tokens": args.max_reasoning_tokens,
        "sampling.temperature": args.temperature,
    }
    if args.backend == "vllm" and args.device == "cpu":
        params.update({"vllm.enforce_eager": True, "vllm.kv_cache_gib": 1.0})  # as bench_pipeline on the CPU
    params.update(args.param)
    return params


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _last_diagnostics(diagnostics: Collector) -> dict[str, str]:
    messages = diagnostics.messages
    return diag_values(messages[-1]) if messages else {}


def wait_for_ready(node: Any, diagnostics: Collector, timeout_s: float, log_path: Path) -> None:
    """Block until the node reports ready (model loaded and warmed up); raise with its log if it cannot."""

    def ready() -> bool:
        state = _last_diagnostics(diagnostics).get("state")
        if node.poll() is not None or state == "failed":
            raise RuntimeError(f"drive node {'failed' if state == 'failed' else 'exited'}; log:\n{_log_tail(log_path)}")
        return state == "ready"

    if not wait_until(ready, timeout_s, interval_s=0.2):
        raise RuntimeError(f"drive node not ready after {timeout_s:.0f} s; log:\n{_log_tail(log_path)}")


def wait_for_publishing(publisher: Any, stamps_log: Path, timeout_s: float, log_path: Path) -> None:
    """Block until the publisher has sent its first full camera tick; raise with its log if it cannot.

    Why: the publisher's start (imports, rendering the frames, joining DDS) takes as long as the
    machine's load makes it, so the node's first-frame clock starts once it publishes, not before.
    """

    def publishing() -> bool:
        if publisher.poll() is not None:
            raise RuntimeError(f"publisher exited with code {publisher.returncode}; log:\n{_log_tail(log_path)}")
        return stamps_log.exists() and stamps_log.stat().st_size > 0

    if not wait_until(publishing, timeout_s, interval_s=0.1):
        raise RuntimeError(f"publisher sent no camera tick in {timeout_s:.0f} s; log:\n{_log_tail(log_path)}")


class NoFrames(RuntimeError):
    """The node got no camera frame at all: the publisher's DDS match never formed."""


def wait_for_plans(
    node: Any, paths: Collector, timings: Collector, diagnostics: Collector, wanted: int, plan_timeout_s: float,
    log_path: Path,
) -> None:
    """Block until `wanted` plans have both a Path and its StageTimings; fail if plans stop coming.

    A node that gets no camera frame at all fails after FIRST_FRAME_TIMEOUT_S rather than the plan
    timeout: that is a transport or callback problem, not a slow plan.
    """
    started = last_progress = time.monotonic()
    seen = -1
    while True:
        timed = {stamp_to_ns(msg.header.stamp) for msg in timings.messages}
        done = sum(stamp_to_ns(msg.header.stamp) in timed for msg in paths.messages)
        if done >= wanted:
            return
        if done != seen:
            seen, last_progress = done, time.monotonic()
            logger.info("plans: %d / %d", done, wanted)
        if node.poll() is not None:
            raise RuntimeError(f"drive node exited with code {node.returncode} after {done} plans")
        values = _last_diagnostics(diagnostics)
        no_frames = values.get("frames") == "0" and time.monotonic() - started > FIRST_FRAME_TIMEOUT_S
        if no_frames or time.monotonic() - last_progress > plan_timeout_s:
            counters = {
                k: v for k, v in values.items()
                if k in ("ticks", "frames", "errors") or k.startswith(("rejected.", "dropped."))
            }  # fmt: skip
            problem = "no camera frame reached the node" if no_frames else f"no plan for {plan_timeout_s:.0f} s"
            raise (NoFrames if no_frames else RuntimeError)(
                f"{problem} after {done} plans; last rejection: {values.get('last_rejection')!r}; last error: "
                f"{values.get('last_error')!r}; counters: {counters}; node log:\n{_log_tail(log_path, 15)}"
            )
        time.sleep(0.1)


def plan_records(
    paths: list[tuple[int, PathMsg]],
    timings: dict[int, StageTimings],
    published: dict[int, dict[str, int]],
    tokens: dict[int, int],
) -> tuple[list[dict[str, Any]], int]:
    """Per-plan measures (see the module docstring), in the order the Paths arrived; and how many
    Paths had no publish record or no StageTimings (should be 0)."""
    records, unmatched = [], 0
    for received_ns, msg in paths:
        t0_ns = stamp_to_ns(msg.header.stamp)
        timing, publish = timings.get(t0_ns), published.get(t0_ns)
        if timing is None or publish is None:
            unmatched += 1
            continue
        stages = dict(zip(timing.stage_names, (float(ms) for ms in timing.stage_ms)))
        e2e = (received_ns - publish["last_ns"]) / NS_PER_MS
        lag = (publish["last_ns"] - t0_ns) / NS_PER_MS
        latency, age, total = float(timing.latency_ms), float(timing.input_age_ms), stages["total"]
        records.append({
            "t0_ns": t0_ns,
            "e2e_ms": e2e,
            "latency_ms": latency,
            "input_age_ms": age,
            "total_ms": total,
            "node_overhead_ms": latency - age - total,
            "inbound_ms": age - lag,
            "receive_ms": age - lag - stages["node.input_wait"],
            "input_wait_ms": stages["node.input_wait"],
            "transport_queueing_ms": e2e - latency + lag,
            "publish_lag_ms": lag,
            "overruns": int(timing.overruns),
            "generated_tokens": tokens.get(t0_ns),
            "stages_ms": stages,
        })  # fmt: skip
    return records, unmatched


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p90/p99 of every measure and every pipeline stage."""
    from bench.bench_pipeline import percentiles  # the pipeline bench's percentiles (it imports torch: not in the publisher)

    summary = {key: percentiles([r[key] for r in records]) for key, _ in MEASURES}
    stage_names = dict.fromkeys(name for r in records for name in r["stages_ms"])
    stages = {
        name: percentiles([r["stages_ms"][name] for r in records if name in r["stages_ms"]]) for name in stage_names
    }
    return {"measures_ms": summary, "stages_ms": stages}


def reference_pipeline(params_file: Path, args: argparse.Namespace, t0s_ns: list[int]) -> dict[str, Any]:
    """`Pipeline.plan` alone on the same workload, in this process after the node has exited.

    Why: node_overhead_ms only sees the node's work outside `plan()`; a node that slows the
    pipeline itself (its executor thread competing for cores or the GIL) shows up as a larger
    `total` than this. Loads the pipeline as the evaluator does from the node's params and times
    it with bench_pipeline's loop (reasoning forced to exactly max_reasoning_tokens, greedy).
    The frame cache makes the input stream matter: when the node's consecutive plans shared less
    than half of their frames, the reference plans fresh windows; otherwise windows moved on by
    one frame (bench_pipeline's stream).
    """
    from bench.bench_pipeline import Workload, run_backend

    from alpamayo_ros.core.pipeline import Pipeline
    from alpamayo_ros.eval.evaluate import drive_settings

    settings = drive_settings(params_file, {})
    sync = settings.frame_sync
    plan_interval_ns = float(np.median(np.diff(t0s_ns))) if len(t0s_ns) > 1 else 0.0
    new_frames = min(sync.frames_per_camera, max(1, round(plan_interval_ns / sync.frame_spacing_ns)))
    stream = new_frames <= sync.frames_per_camera // 2
    workload = Workload(cameras=tuple(args.cameras), frames=sync.frames_per_camera, height=args.height,
                        width=args.width, reasoning_tokens=args.max_reasoning_tokens, stream=stream)  # fmt: skip
    logger.info(
        "timing the pipeline alone: %d plans after %d warm-up, %s windows (the node planned every %.0f ms)",
        args.reference_plans, args.warmup, "streamed" if stream else "fresh", plan_interval_ns / NS_PER_MS,
    )  # fmt: skip
    pipeline = Pipeline.from_checkpoint(settings.checkpoint_path, backend=settings.backend, device=settings.device,
                                        dtype=settings.dtype, backend_options=settings.backend_options)
    try:
        result = run_backend(pipeline, workload, args.reference_plans, args.warmup)
    finally:
        pipeline.close()
    return {**result, "stream": stream, "node_plan_interval_ms": plan_interval_ns / NS_PER_MS}


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Start node and publisher, collect warm-up + measured plans, stop both; returns the report."""
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_node_"))
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from alpamayo_ros.core.tiny_checkpoint import write_checkpoint

        checkpoint = write_checkpoint(out / "checkpoint")
        logger.info("wrote a tiny random checkpoint to %s", checkpoint)
    domain_id = args.domain_id if args.domain_id is not None else unique_domain_id()
    env = ros_env(domain_id)
    params_file = write_params_file(out / "drive.yaml", node_parameters(args, checkpoint))
    stamps_log = out / "published.jsonl"
    publisher_config = out / "publisher.json"
    publisher_config.write_text(json.dumps({
        "transport": args.transport, "width": args.width, "height": args.height, "cameras": list(args.cameras),
        "noise_std": args.noise, "odometry_topic": ODOMETRY_TOPIC, "stamps_log": str(stamps_log),
    }))  # fmt: skip
    side = RosSide(domain_id, "bench_node")
    reliable = side.reliable(depth=50)  # the node's outputs are reliable
    paths, timings = WallCollector(), WallCollector()
    side.node.create_subscription(PathMsg, PATH_TOPIC, paths, reliable)
    side.node.create_subscription(StageTimings, TIMINGS_TOPIC, timings, reliable)
    reasoning = side.collect(Reasoning, REASONING_TOPIC, reliable)
    diagnostics = side.collect(DiagnosticArray, "/diagnostics", reliable)
    logger.info("ROS domain %d; node log %s", domain_id, out / "node.log")
    node = start_console_script(NODE, env=env, log_path=out / "node.log", params_file=params_file)
    publisher = None
    publisher_restarts = 0
    exit_codes: dict[str, int | None] = {}
    try:
        started = time.monotonic()
        wait_for_ready(node, diagnostics, args.ready_timeout_s, out / "node.log")
        logger.info("node ready after %.1f s; starting the publisher", time.monotonic() - started)
        def start_publisher() -> Any:
            stamps_log.unlink(missing_ok=True)  # a restarted publisher's first tick is what the wait sees
            return start_python(
                f"import sys; from bench import bench_node; "
                f"sys.exit(bench_node.run_publisher(bench_node.Path({str(publisher_config)!r})))",
                env=env, log_path=out / "publisher.log",
            )  # fmt: skip

        def transport_report() -> str:
            """What the bench's own participant sees of the publisher, for a no-frames failure."""
            topics = [camera_topic(index, args.transport) for index in args.cameras]
            seen = {topic: side.node.count_publishers(topic) for topic in topics}
            running = publisher.poll() is None
            return (f"publishers the bench sees: {seen}; publisher running: {running}; publisher log:\n"
                    f"{log_excerpt(out / 'publisher.log', tail_chars=1500)}")  # fmt: skip

        publisher = start_publisher()
        wait_for_publishing(publisher, stamps_log, args.ready_timeout_s, out / "publisher.log")
        wanted = args.warmup + args.plans
        try:
            wait_for_plans(node, paths, timings, diagnostics, wanted, args.plan_timeout_s, out / "node.log")
        except NoFrames as exc:
            # NOTE: seen on this 2-core machine in full test runs (never alone): the node matched no
            # publisher of a fresh publisher process. One restart, said out loud.
            logger.warning("%s\n%s\nrestarting the publisher once", exc, transport_report())
            stop_process(publisher, STOP_TIMEOUT_S)
            publisher, publisher_restarts = start_publisher(), 1
            wait_for_publishing(publisher, stamps_log, args.ready_timeout_s, out / "publisher.log")
            try:
                wait_for_plans(node, paths, timings, diagnostics, wanted, args.plan_timeout_s, out / "node.log")
            except NoFrames as again:
                raise NoFrames(f"{again}\n{transport_report()}") from again
        # the node publishes its diagnostics after the last Path: let them arrive before reading
        deadline = time.monotonic() + 5.0
        while int(_last_diagnostics(diagnostics).get("plans", 0)) < wanted and time.monotonic() < deadline:
            time.sleep(0.05)
        node_diagnostics = _last_diagnostics(diagnostics)
    finally:
        if publisher is not None:
            exit_codes["publisher"] = stop_process(publisher, STOP_TIMEOUT_S)
        exit_codes["node"] = stop_process(node, STOP_TIMEOUT_S)
        side.close()
    published = {}
    for line in stamps_log.read_text().splitlines():
        entry = json.loads(line)
        published[entry.pop("stamp_ns")] = entry
    by_stamp = {stamp_to_ns(msg.header.stamp): msg for _, msg in timings.timed()}
    tokens = {stamp_to_ns(msg.header.stamp): msg.generated_tokens for msg in reasoning.messages}
    records, unmatched = plan_records(paths.timed()[args.warmup :], by_stamp, published, tokens)
    records = records[: args.plans]
    if len(records) < args.plans:
        raise RuntimeError(f"only {len(records)} of {args.plans} plans could be matched ({unmatched} unmatched)")
    reference = reference_pipeline(params_file, args, [r["t0_ns"] for r in records]) if args.reference_plans else None
    report: dict[str, Any] = {
        "config": {
            "checkpoint": str(checkpoint), "backend": args.backend, "device": args.device,
            "transport": args.transport, "height": args.height, "width": args.width, "cameras": list(args.cameras),
            "camera_hz": 1e9 / SensorRig.CAMERA_PERIOD_NS, "odometry_hz": 1e9 / SensorRig.ODOMETRY_PERIOD_NS,
            "plans": args.plans, "warmup": args.warmup, "max_reasoning_tokens": args.max_reasoning_tokens,
            "temperature": args.temperature,
            "noise_std": args.noise, "params": node_parameters(args, checkpoint),
        },
        **summarize(records),
        "generated_tokens": sorted({r["generated_tokens"] for r in records if r["generated_tokens"] is not None}),
        "pipeline_alone": reference,
        "unmatched_plans": unmatched,
        "camera_ticks_published": len(published),
        "publisher_restarts": publisher_restarts,
        "exit_codes": exit_codes,
        "node_diagnostics": node_diagnostics,
        "out": str(out),
        "plans": records,
    }  # fmt: skip
    return report


def markdown(report: dict[str, Any]) -> str:
    """The figure for RESULTS.md: p50/p90/p99 of every measure."""
    c = report["config"]
    lines = [
        f"## Node latency: {len(c['cameras'])} cameras x {c['height']}x{c['width']} {c['transport']}, "
        f"{c['backend']} on {c['device']}, reasoning <= {c['max_reasoning_tokens']} tokens at temperature "
        f"{c['temperature']}, {c['plans']} plans after {c['warmup']} warm-up",
        "",
        "| measure | p50 ms | p90 ms | p99 ms |",
        "| --- | --- | --- | --- |",
    ]
    for key, label in MEASURES:
        p = report["measures_ms"][key]
        lines.append(f"| {label} | {p['p50']:.1f} | {p['p90']:.1f} | {p['p99']:.1f} |")
    reference = report["pipeline_alone"]
    if reference:
        alone, in_node = reference["stages_ms"]["total"], report["measures_ms"]["total_ms"]
        windows = "streamed" if reference["stream"] else "fresh"
        lines += [
            "",
            f"Pipeline alone (this process after the node exited, {windows} windows, reasoning forced to "
            f"{reference['generated_tokens']} tokens, {reference['runs']} plans): total p50 {alone['p50']:.1f} ms, "
            f"p90 {alone['p90']:.1f} ms; in the node p50 {in_node['p50']:.1f} ms, p90 {in_node['p90']:.1f} ms "
            f"(generated tokens {report['generated_tokens']}).",
        ]
    diag = report["node_diagnostics"]
    skipped = {k: v for k, v in diag.items() if k.startswith(("rejected.", "dropped.")) and v != "0"}
    lines += [
        "",
        f"Node counters at the end: plans {diag.get('plans')}, ticks {diag.get('ticks')}, overruns "
        f"{diag.get('overruns')}, repeated t0 {diag.get('repeated_t0')}, skipped/dropped {skipped or 'none'}; "
        f"exit codes {report['exit_codes']}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (default: a tiny random one in OUT)")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--device", default="cpu", help="model.device: cpu, cuda or cuda:N")
    parser.add_argument("--transport", choices=("raw", "compressed"), default="compressed")
    parser.add_argument("--height", type=int, default=1080)
    parser.add_argument("--width", type=int, default=1920)
    parser.add_argument("--cameras", type=lambda s: [int(i) for i in s.split(",")], default=[0, 1, 2, 6],
                        help="upstream camera indices (default: the node's 0,1,2,6)")
    parser.add_argument("--plans", type=int, default=20, help="measured plans")
    parser.add_argument("--warmup", type=int, default=3, help="plans discarded first (after the node's own warm-up)")
    parser.add_argument("--max-reasoning-tokens", type=int, default=40, help="sampling.max_reasoning_tokens (a cap)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling.temperature; 0 = greedy as bench_pipeline (the node's default 0.6 adds "
                             "top-p sampling over the whole vocabulary to every reasoning token)")
    parser.add_argument("--noise", type=float, default=4.0, help="sensor noise std of the frames (grey levels)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME:=VALUE",
                        help="extra drive node parameter (YAML value), e.g. images.width=576; repeatable")
    parser.add_argument("--reference-plans", type=int, default=0,
                        help="then time Pipeline.plan alone this many times (after --warmup), for comparison")
    parser.add_argument("--out", type=Path, help="work directory: logs, params, publish log (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--domain-id", type=int, help="ROS_DOMAIN_ID (default: a free one, as the tests pick)")
    parser.add_argument("--ready-timeout-s", type=float, default=900.0, help="model load + warm-up limit")
    parser.add_argument("--plan-timeout-s", type=float, default=120.0, help="fail when no plan arrives for this long")
    parser.add_argument("--publisher-config", type=Path, help=argparse.SUPPRESS)  # the publisher process
    args = parser.parse_args(argv)
    if args.publisher_config:
        return run_publisher(args.publisher_config)
    try:
        args.param = parse_param_overrides(args.param)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        report = run_bench(args)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    if args.json:
        from alpamayo_ros.eval.report import write_json  # strict JSON (NaN -> null)

        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, report)
    print(markdown(report))
    unclean = {name: code for name, code in report["exit_codes"].items() if code != 0}
    if unclean:
        logger.error("processes did not exit cleanly: %s (logs in %s)", unclean, report["out"])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
