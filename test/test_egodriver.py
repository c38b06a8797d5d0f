"""alpamayo-egodriver over real gRPC: carla-driver-interface's FakeLoop (a CARLA-free AlpaSim
runtime) drives two concurrent sessions; the answers are checked against the in-process pipeline
on the recorded inputs, the inputs against the evaluator's assembly from the same messages, and
malformed calls against the field each one names.

Over 400 lines: the cases share one egodriver process (the module's service fixture: a model
load behind a gRPC server), which a split would start again per file."""

from __future__ import annotations

import io
import json
import pickle
import threading
import uuid
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from carla_driver_interface.contract import METADATA_KEY
from carla_driver_interface.geometry import Pose
from carla_driver_interface.protocol import (DriveRequest, DriveSessionCloseRequest, DriveSessionRequest,
                                             EgodriverServiceStub, Empty, RolloutCameraImage, RolloutEgoTrajectory,
                                             RouteRequest, channel_options)  # fmt: skip
from carla_driver_interface.testing import FakeCamera, FakeLoop, render_road
from PIL import Image

from alpamayo_ros.drive.loop import Planned
from alpamayo_ros.drive.selection import select_sample
from alpamayo_ros.inputs.ego_history import MAX_SAMPLES_BUFFERED
from alpamayo_ros.inputs.frame_sync import MAX_FRAMES_BUFFERED
from alpamayo_ros.settings import SPECS, sampling_settings
from alpamayo_ros.sim.cli import build_parser, egodriver_settings, parse_camera_map
from alpamayo_ros.sim.geometry import to_local, trajectory_arrays
from alpamayo_ros.sim.loop import SessionLoop
from alpamayo_ros.sim.process import EgodriverProcess, start_egodriver
from alpamayo_ros.sim.record import read_plan
from alpamayo_ros.sim.session import PendingObservations, Session
from alpamayo_ros.testing.threads import set_torch_threads

CAMERAS = (FakeCamera(logical_id="camera_front_wide_120fov", width=320, height=180, fov_deg=90.0),
           FakeCamera(logical_id="camera_front_tele_30fov", width=320, height=180, fov_deg=30.0))  # fmt: skip
CAMERA_ARGS = ["--camera", "camera_front_wide_120fov=1", "--camera", "camera_front_tele_30fov=6"]
# four samples: of two the medoid is always the first, and of the tiny model's three it was too
PARAMS = {"sampling.num_samples": 4, "sampling.selection": "medoid", "sampling.max_reasoning_tokens": 8,
          "sampling.flow_steps": 4}
STEP_US = 100_000
FIRST_PLAN_STEP = 15  # 1.5 s of odometry history at 10 Hz
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def service(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[EgodriverProcess, Path]:
    record = tmp_path_factory.mktemp("egodriver_record")
    args = ["--checkpoint", str(tiny_checkpoint), "--record", str(record), *CAMERA_ARGS]
    for name, value in PARAMS.items():
        args += ["-p", f"{name}={value}"]
    process = start_egodriver(args, env={"OMP_NUM_THREADS": "1"})  # one thread: the same sums as the test's
    yield process, record
    assert process.stop() == 0, "".join(process.log[-20:])


@pytest.fixture(scope="module")
def stub(service: tuple[EgodriverProcess, Path]) -> EgodriverServiceStub:
    channel = grpc.insecure_channel(service[0].address, options=channel_options())
    yield EgodriverServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint: Path):
    from alpamayo_ros.core.pipeline import Pipeline

    set_torch_threads(1)  # the service's float sums (conftest restores the count after this file)
    return Pipeline.from_checkpoint(str(tiny_checkpoint), backend="hf", device="cpu")


def drives(record: Path, session: str) -> list[dict]:
    return [json.loads(line) for line in (record / session / "drives.jsonl").read_text().splitlines()]


def sessions_in(record: Path) -> set[str]:
    return {p.name for p in record.iterdir() if p.is_dir()}


def assert_matches_pipeline(pipeline, npz: Path) -> int:
    """The answer as sent equals Pipeline.plan on the recorded input, in AlpaSim's local frame, and
    drives the sample the node's Path would (sampling.selection); returns that sample's index."""
    driving_input, recorded, response = read_plan(npz)
    settings = sampling_settings({**{n: s.default for n, s in SPECS.items()}, **PARAMS})
    plan = pipeline.plan(driving_input, replace(settings, seed=recorded["seed"]))
    debug = pickle.loads(response.debug_info.unstructured_debug_info)
    assert debug["reasoning"] == plan.coc, npz
    assert len(response.debug_info.sampled_trajectories) == len(plan.xyz) == PARAMS["sampling.num_samples"]
    for sample, trajectory in enumerate(response.debug_info.sampled_trajectories):
        _, xyz, _ = trajectory_arrays(trajectory)
        expected, _ = to_local(plan.xyz[sample], plan.rot[sample], recorded["xyz_t0"], recorded["rot_t0"])
        np.testing.assert_allclose(xyz[1:], expected, atol=1e-5, rtol=0, err_msg=f"{npz} sample {sample}")
    selected, _ = select_sample(plan.xyz, PARAMS["sampling.selection"])
    assert debug["selected_sample"] == selected and debug["reasoning_text"] == plan.coc[selected], npz
    assert trajectory_arrays(response.trajectory)[1].tolist() == trajectory_arrays(
        response.debug_info.sampled_trajectories[selected])[1].tolist()  # fmt: skip
    return selected


def assert_alpasim_trajectory(line: dict, response) -> None:
    """The current pose first (at the plan's t0), then 64 waypoints 0.1 s apart, all finite."""
    stamps, xyz, quat = trajectory_arrays(response.trajectory)
    assert len(stamps) == 65 and stamps[0] == line["t0_us"] <= line["time_now_us"]
    assert (np.diff(stamps) == STEP_US).all()
    assert np.isfinite(xyz).all() and np.allclose(np.linalg.norm(quat, axis=1), 1.0, atol=1e-5)


def test_fake_loop_drives_two_sessions(service, pipeline) -> None:
    """Acceptance: 2 concurrent sessions, >= 20 drive calls with plans, every answer valid once the
    inputs suffice, every plan equal to Pipeline.plan on its input within 1e-5 m, and every answer
    the sample the node would publish (the medoid)."""
    process, record = service
    before = sessions_in(record)
    steps = {3: 27, 11: 28}  # seed -> drive calls
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            with FakeLoop(process.address, CAMERAS, initial_speed_mps=4.0 + seed / 10, timeout_s=TIMEOUT_S) as loop:
                results[seed] = loop.run(steps[seed], seed=seed)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not errors, errors
    new = sessions_in(record) - before
    assert len(new) == 2
    planned_total, selected = 0, set()
    for session in new:
        lines = drives(record, session)
        seed = next(s for s in steps if len(lines) == steps[s])
        result = results[seed]
        assert result.steps == len(lines) == steps[seed]
        outcomes = [line["outcome"] for line in lines]
        first = outcomes.index("planned")
        assert first == FIRST_PLAN_STEP, outcomes
        assert set(outcomes[:first]) <= {"frame_mismatch", "history_short"}, outcomes
        assert all(o == "planned" for o in outcomes[first:]), outcomes
        for line in lines[:first]:
            assert line["poses"] == 0 and line["detail"]  # an empty answer (hold) saying why
        for line in lines[first:]:
            npz = record / session / f"plan_{line['tick']:05d}.npz"
            _, recorded, response = read_plan(npz)
            assert_alpasim_trajectory(line, response)
            assert line["seed"] == recorded["seed"] == seed  # the session's seed, as the node's sampling.seed
            # the runtime drove where the answer said: the ego's next pose is the plan at the next step
            if line["tick"] + 1 < result.steps:
                np.testing.assert_allclose(result.ego.positions[line["tick"] + 1],
                                           _interpolate(response.trajectory, line["time_now_us"] + STEP_US),
                                           atol=1e-4)  # fmt: skip
            selected.add(assert_matches_pipeline(pipeline, npz))
            planned_total += 1
    assert planned_total >= 20
    assert selected - {0}, selected  # the medoid, not always the first sample


def _interpolate(trajectory, stamp_us: int) -> np.ndarray:
    stamps, xyz, _ = trajectory_arrays(trajectory)
    return np.array([np.interp(stamp_us, stamps, xyz[:, k]) for k in range(3)])


# ---- a session driven call by call: malformed calls, and the evaluator's assembly ----


def jpeg(camera: FakeCamera, pose: Pose) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(render_road(camera, pose)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


class ManualRun:
    """What a runtime sends for one step, kept so the same messages can be replayed elsewhere."""

    def __init__(self, steps: int, speed_mps: float = 5.0) -> None:
        self.steps = [(k * STEP_US, Pose.from_xyz_yaw(speed_mps * k * STEP_US / 1e6, 0.2, 0.0, 0.01 * k))
                      for k in range(steps)]  # fmt: skip
        self.images = {(k, c.logical_id): jpeg(c, pose) for k, (_, pose) in enumerate(self.steps) for c in CAMERAS}

    def start(self, stub: EgodriverServiceStub, session: str, seed: int) -> None:
        request = DriveSessionRequest(session_uuid=session, random_seed=seed)
        request.rollout_spec.vehicle.available_cameras.extend(c.available_camera() for c in CAMERAS)
        stub.start_session(request, timeout=TIMEOUT_S)

    def observe(self, stub: EgodriverServiceStub, session: str, k: int) -> None:
        now_us, pose = self.steps[k]
        egomotion = RolloutEgoTrajectory(session_uuid=session)
        egomotion.trajectory.poses.append(pose.to_proto_at_time(now_us))
        stub.submit_egomotion_observation(egomotion, timeout=TIMEOUT_S)
        for camera in CAMERAS:
            stub.submit_image_observation(image_request(session, camera.logical_id, now_us, self.images[k, camera.logical_id]),
                                          timeout=TIMEOUT_S)  # fmt: skip

    def drive(self, stub: EgodriverServiceStub, session: str, k: int):
        now_us = self.steps[k][0]
        return stub.drive(DriveRequest(session_uuid=session, time_now_us=now_us, time_query_us=now_us + STEP_US),
                          timeout=TIMEOUT_S)  # fmt: skip


def image_request(session: str, logical_id: str, stamp_us: int, data: bytes) -> RolloutCameraImage:
    request = RolloutCameraImage(session_uuid=session)
    request.camera_image.logical_id = logical_id
    request.camera_image.frame_start_us = request.camera_image.frame_end_us = stamp_us
    request.camera_image.image_bytes = data
    return request


def egomotion_request(session: str, stamps_us: list[int], xyz: tuple[float, float, float] = (0.0, 0.0, 0.0),
                      states: int | None = None) -> RolloutEgoTrajectory:  # fmt: skip
    from carla_driver_interface.protocol import DynamicState

    request = RolloutEgoTrajectory(session_uuid=session)
    for stamp in stamps_us:
        request.trajectory.poses.append(Pose(np.array(xyz), np.array([0.0, 0.0, 0.0, 1.0])).to_proto_at_time(stamp))
    request.dynamic_states.extend(DynamicState() for _ in range(len(stamps_us) if states is None else states))
    return request


def test_malformed_calls_name_the_field_and_touch_nothing(service, stub) -> None:
    """Each malformed call gets a gRPC error naming its field; the session that saw them answers
    exactly as its twin that did not (same seed, same good messages)."""
    _, record = service
    run = ManualRun(FIRST_PLAN_STEP + 3)
    hit, twin = f"hit-{uuid.uuid4()}", f"twin-{uuid.uuid4()}"
    for session in (hit, twin):
        run.start(stub, session, seed=5)
    last = len(run.steps) - 1
    for k in range(last):
        for session in (hit, twin):
            run.observe(stub, session, k)
            run.drive(stub, session, k)
    now_us = run.steps[last][0]
    for session in (hit, twin):
        run.observe(stub, session, last)  # the good observations of the last step, then the bad calls
    good_jpeg = run.images[last, CAMERAS[0].logical_id]
    cameras = [c.available_camera() for c in CAMERAS]
    malformed = [
        (lambda: stub.submit_image_observation(image_request("no-such-session", CAMERAS[0].logical_id, now_us, good_jpeg)),
         grpc.StatusCode.NOT_FOUND, "session_uuid"),
        (lambda: stub.drive(DriveRequest(session_uuid="no-such-session", time_now_us=now_us)),
         grpc.StatusCode.NOT_FOUND, "session_uuid"),
        (lambda: stub.submit_image_observation(image_request(hit, CAMERAS[0].logical_id, now_us, b"not an image")),
         grpc.StatusCode.INVALID_ARGUMENT, "camera_image.image_bytes"),
        (lambda: stub.submit_image_observation(image_request(hit, CAMERAS[0].logical_id, now_us, good_jpeg[:-200])),
         grpc.StatusCode.INVALID_ARGUMENT, "camera_image.image_bytes"),
        (lambda: stub.submit_image_observation(image_request(hit, "camera_rear_left_70fov", now_us, good_jpeg)),
         grpc.StatusCode.INVALID_ARGUMENT, "camera_image.logical_id"),
        (lambda: stub.submit_egomotion_observation(egomotion_request(hit, [now_us])),
         grpc.StatusCode.INVALID_ARGUMENT, "trajectory.poses[0].timestamp_us"),
        (lambda: stub.submit_egomotion_observation(egomotion_request(hit, [now_us + 20_000, now_us + 10_000])),
         grpc.StatusCode.INVALID_ARGUMENT, "trajectory.poses[1].timestamp_us"),
        (lambda: stub.submit_egomotion_observation(egomotion_request(hit, [now_us + 10_000], xyz=(np.nan, 0.0, 0.0))),
         grpc.StatusCode.INVALID_ARGUMENT, "trajectory.poses[0].pose"),
        (lambda: stub.submit_egomotion_observation(egomotion_request(hit, [])),
         grpc.StatusCode.INVALID_ARGUMENT, "trajectory.poses"),
        (lambda: stub.submit_egomotion_observation(egomotion_request(hit, [now_us + 10_000], states=3)),
         grpc.StatusCode.INVALID_ARGUMENT, "dynamic_states"),
        (lambda: stub.submit_route(_route(hit, now_us, bad_index=3)),
         grpc.StatusCode.INVALID_ARGUMENT, "route.waypoints[3]"),
        (lambda: stub.drive(DriveRequest(session_uuid=hit, time_now_us=now_us - 2 * STEP_US)),
         grpc.StatusCode.INVALID_ARGUMENT, "time_now_us"),
        (lambda: stub.start_session(_session_request(hit, cameras)),
         grpc.StatusCode.ALREADY_EXISTS, "session_uuid"),
        (lambda: stub.start_session(_session_request(f"s-{uuid.uuid4()}", cameras[:1])),
         grpc.StatusCode.FAILED_PRECONDITION, "rollout_spec.vehicle.available_cameras"),
    ]
    for i, (call, code, field) in enumerate(malformed):
        with pytest.raises(grpc.RpcError) as raised:
            call()
        assert raised.value.code() == code, (i, raised.value.details())
        assert raised.value.details().startswith(f"{field}: "), (i, raised.value.details())
    answers = {session: run.drive(stub, session, last) for session in (hit, twin)}
    assert len(answers[hit].trajectory.poses) == 65
    assert answers[hit].trajectory == answers[twin].trajectory
    assert list(answers[hit].debug_info.sampled_trajectories) == list(answers[twin].debug_info.sampled_trajectories)
    assert [line["outcome"] for line in drives(record, hit)] == [line["outcome"] for line in drives(record, twin)]
    for session in (hit, twin):
        stub.close_session(DriveSessionCloseRequest(session_uuid=session), timeout=TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as raised:  # closed means gone
        run.drive(stub, hit, last)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def _route(session: str, stamp_us: int, bad_index: int) -> RouteRequest:
    request = RouteRequest(session_uuid=session)
    request.route.timestamp_us = stamp_us
    for i in range(6):
        request.route.waypoints.add(x=10.0 * i, y=np.nan if i == bad_index else 0.0, z=0.0)
    return request


def _session_request(session: str, cameras: list) -> DriveSessionRequest:
    request = DriveSessionRequest(session_uuid=session)
    request.rollout_spec.vehicle.available_cameras.extend(cameras)
    return request


def test_inputs_equal_the_evaluators_assembly(service, stub, tiny_checkpoint: Path) -> None:
    """The same JPEG frames and poses, as the node's ROS messages through the evaluator's bag feed
    into a drive loop of its own (the node's front door: its decoders, frame selection and ego
    history), give the service's per-tick inputs."""
    from nav_msgs.msg import Odometry
    from sensor_msgs.msg import CompressedImage

    from alpamayo_ros.drive.loop import DriveLoop
    from alpamayo_ros.eval.evaluate import BagFeed, drive_settings

    _, record = service
    run = ManualRun(FIRST_PLAN_STEP + 4, speed_mps=7.0)
    session = f"assembly-{uuid.uuid4()}"
    run.start(stub, session, seed=1)
    for k in range(len(run.steps)):
        run.observe(stub, session, k)
        run.drive(stub, session, k)
    stub.close_session(DriveSessionCloseRequest(session_uuid=session), timeout=TIMEOUT_S)

    topics = {c.logical_id: f"/{c.logical_id}/compressed" for c in CAMERAS}
    settings = drive_settings(None, {"model.checkpoint_path": str(tiny_checkpoint), "cameras.topics": list(topics.values()),
                                     "cameras.indices": [1, 6], "cameras.transports": ["compressed", "compressed"],
                                     **PARAMS})  # fmt: skip
    loop = DriveLoop(settings)
    loop.ready(0)
    feed = BagFeed(loop)
    compared = 0
    for k, (now_us, pose) in enumerate(run.steps):
        odometry = Odometry()
        odometry.header.frame_id = "local"
        odometry.header.stamp.sec, odometry.header.stamp.nanosec = divmod(now_us * 1000, 1_000_000_000)
        proto = pose.to_proto()  # what went on the wire (float32 fields)
        position, orientation = odometry.pose.pose.position, odometry.pose.pose.orientation
        position.x, position.y, position.z = proto.vec.x, proto.vec.y, proto.vec.z
        orientation.x, orientation.y, orientation.z, orientation.w = proto.quat.x, proto.quat.y, proto.quat.z, proto.quat.w
        feed.add(now_us * 1000, settings.odometry_topic, odometry)
        for camera in CAMERAS:
            image = CompressedImage(format="jpeg", data=run.images[k, camera.logical_id])
            image.header.stamp = odometry.header.stamp
            feed.add(now_us * 1000, topics[camera.logical_id], image)
        npz = record / session / f"plan_{k:05d}.npz"
        started = loop.tick(now_us * 1000)
        loop.idle(now_us * 1000)
        if not npz.exists():
            assert started.request is None, k  # neither side could plan
            continue
        served, _, _ = read_plan(npz)
        expected = started.request.assembly.driving_input
        assert served.camera_indices == expected.camera_indices and served.t0_ns == expected.t0_ns
        np.testing.assert_array_equal(served.images, expected.images)
        np.testing.assert_array_equal(served.frame_stamps_ns, expected.frame_stamps_ns)
        np.testing.assert_array_equal(served.ego_history_xyz, expected.ego_history_xyz)
        np.testing.assert_array_equal(served.ego_history_rot, expected.ego_history_rot)
        compared += 1
    assert compared == len(run.steps) - FIRST_PLAN_STEP


def observe_in_process(session: Session, run: ManualRun, k: int) -> None:
    """ManualRun.observe, straight into a Session (no gRPC)."""
    now_us, pose = run.steps[k]
    egomotion = RolloutEgoTrajectory(session_uuid=session.uuid)
    egomotion.trajectory.poses.append(pose.to_proto_at_time(now_us))
    session.add_egomotion(egomotion)
    for camera in CAMERAS:
        session.add_image(image_request(session.uuid, camera.logical_id, now_us, run.images[k, camera.logical_id]))


def test_a_long_session_without_drives_keeps_its_pending_frames_bounded(pipeline, tiny_checkpoint: Path) -> None:
    """10 s of observations and no drive(): what waits stays within the loop's frame retention,
    and the drive that comes at last plans from the same input as a twin whose every observation
    reached its loop (at the same clock), so nothing the loop would have used was dropped."""
    args = build_parser().parse_args(["--checkpoint", str(tiny_checkpoint), *CAMERA_ARGS,
                                      *(f"-p{name}={value}" for name, value in PARAMS.items())])  # fmt: skip
    camera_map = parse_camera_map(args.camera)
    settings = egodriver_settings(args, camera_map)
    lock = threading.Lock()
    hit, twin = (Session(name, SessionLoop(settings, pipeline, lock, seed=9), camera_map, settings.model_id)
                 for name in ("long", "twin"))  # fmt: skip
    run = ManualRun(100)
    last = len(run.steps) - 1
    last_ns = run.steps[last][0] * 1000
    kept_frames = (settings.frame_sync.retention_ns // (STEP_US * 1000) + 1) * len(CAMERAS)
    for k in range(len(run.steps)):
        observe_in_process(hit, run, k)
        observe_in_process(twin, run, k)
        for deliver in twin.pending.take():  # the twin's loop sees everything, at the final drive's clock
            deliver(last_ns)
        assert len(hit.pending) <= kept_frames + k + 1, k  # the frames within retention, and the poses so far
    assert hit.pending.superseded == len(run.steps) * len(CAMERAS) - kept_frames
    answers = {session.uuid: session.drive(run.steps[last][0]) for session in (hit, twin)}
    assert len(hit.pending) == 0
    planned = [answers[name].step.outcome for name in ("long", "twin")]
    assert all(isinstance(outcome, Planned) for outcome in planned), planned
    served, expected = (outcome.request.assembly.driving_input for outcome in planned)
    assert served.t0_ns == expected.t0_ns == last_ns
    np.testing.assert_array_equal(served.images, expected.images)
    np.testing.assert_array_equal(served.frame_stamps_ns, expected.frame_stamps_ns)
    np.testing.assert_array_equal(served.ego_history_xyz, expected.ego_history_xyz)
    assert answers["long"].response.trajectory == answers["twin"].response.trajectory


def test_pending_observations_keep_the_newest_within_the_loops_caps() -> None:
    """Frames that barely advance (a stuck camera clock) and a flood of poses: the counts stop at
    the loop's own caps, the newest stay, and they come out in arrival order."""
    pending = PendingObservations(frame_retention_ns=10**9)
    delivered: list[tuple[str, int]] = []
    for i in range(MAX_SAMPLES_BUFFERED + 100):
        pending.add_pose(i, lambda _now, i=i: delivered.append(("pose", i)))
        if i % 50 == 0:
            pending.add_frame(1, 7, lambda _now, i=i: delivered.append(("frame", i)))
    frames = (MAX_SAMPLES_BUFFERED + 100 + 49) // 50
    assert len(pending) == MAX_SAMPLES_BUFFERED + MAX_FRAMES_BUFFERED
    assert pending.superseded == 100 + frames - MAX_FRAMES_BUFFERED
    for deliver in pending.take():
        deliver(0)
    poses = [i for kind, i in delivered if kind == "pose"]
    assert poses == list(range(100, MAX_SAMPLES_BUFFERED + 100))
    frame_arrivals = [i for kind, i in delivered if kind == "frame"]
    assert frame_arrivals == list(range(0, MAX_SAMPLES_BUFFERED + 100, 50))[-MAX_FRAMES_BUFFERED:]
    order = [i for _, i in delivered]
    assert order == sorted(order)  # arrival order across the sources
    assert len(pending) == 0 and pending.take() == []


def test_get_version_declares_alpasims_camera_convention(stub) -> None:
    version, call = stub.get_version.with_call(Empty(), timeout=TIMEOUT_S)
    assert version.version_id.startswith("alpamayo_ros-egodriver") and version.grpc_api_version.minor > 0
    assert dict(call.initial_metadata())[METADATA_KEY] == "2"


def test_sim_demo_reports_a_closed_loop(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """alpamayo-sim-demo: the runtime drives the service; the report has progress, time off the
    road, latency per tick and the reasoning of every plan."""
    import subprocess
    import sys

    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "alpamayo_ros.sim.demo", "--out", str(out), "--checkpoint",
                           str(tiny_checkpoint), "--steps", "18", "--cameras", "1", "--size", "320x180",
                           "-p", "sampling.max_reasoning_tokens=4"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == len(report["ticks"]) == 18 and report["plans"] == 18 - FIRST_PLAN_STEP
    assert report["service_exit_code"] == 0 and np.isfinite(report["progress_m"])
    assert report["time_off_road_s"] >= 0 and report["drive_ms"]["planned_p50"] > 0
    planned = [t for t in report["ticks"] if t["outcome"] == "planned"]
    assert all(t["reasoning"] and t["drive_ms"] > 0 for t in planned)
    assert "time off the lane" in (out / "report.md").read_text()


def test_param_overrides_reach_the_settings_in_either_form(tiny_checkpoint: Path) -> None:
    args = build_parser().parse_args(["--checkpoint", str(tiny_checkpoint), "-p", "sampling.num_samples:=4",
                                      "--param", "sampling.selection=medoid", "-p", "model.id:=run=1"])  # fmt: skip
    settings = egodriver_settings(args, parse_camera_map(args.camera))
    assert settings.sampling.num_samples == 4 and settings.selection == "medoid" and settings.model_id == "run=1"


@pytest.mark.parametrize(("args", "named"), [
    (["--camera", "camera_front_wide_120fov"], "--camera"),
    (["--camera", "camera_front_wide_120fov=9"], "cameras.indices"),
    (["-p", "sampling.selection=all"], "sampling.selection"),
    (["-p", "model.backend=remote"], "model.backend"),
    (["-p", "sampling.selecton:=first"], "unknown parameter 'sampling.selecton'; did you mean 'sampling.selection'?"),
])  # fmt: skip
def test_bad_settings_stop_the_service_naming_them(tiny_checkpoint: Path, args: list[str], named: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "alpamayo_ros.sim.cli", "--checkpoint", str(tiny_checkpoint), *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and named in done.stderr, done.stderr


def test_bench_egodriver_smoke(tmp_path: Path) -> None:
    """python -m bench.bench_egodriver --smoke: both sides timed on the CPU (kept from rotting, not a speed test)."""
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "bench.bench_egodriver", "--smoke", "--runs", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["runs"] == 2 and result["drive_ms"]["p50"] > 0 and result["plan_ms"]["p90"] > 0
