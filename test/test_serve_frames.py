"""The binary endpoint's frame delta against a real alpamayo-serve process: a streamed window
sends only its new frames (resized inline, or at capture size through shared memory) and still
plans exactly like Pipeline.plan; references the server cannot resolve (restart, eviction,
another session) cost one full resend, never a wrong plan; malformed deltas and shared-memory
references are refused naming the field, storing nothing; the frame store stays bounded; a
client leaves no segment in /dev/shm; a server that takes no shared memory gets resized frames."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import httpx
import msgspec
import numpy as np
import pytest
from serve_helpers import hf_server, plan_segments, small_frames_checkpoint

from alpamayo_ros.core.frame_key import KeyedFrame, keyed_frame
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.preprocess import VisionGeometry, smart_resize
from alpamayo_ros.core.types import DrivingInput, Plan, SamplingSettings
from alpamayo_ros.serve import wire
from alpamayo_ros.serve.client import RemotePlanner, RemoteRejected
from alpamayo_ros.serve.frame_store import FrameKey, FrameStore
from alpamayo_ros.serve.process import ServerProcess
from alpamayo_ros.serve.shm import SHM_DIR, FrameSegment

SETTINGS = SamplingSettings(num_samples=1, temperature=0.8, max_reasoning_tokens=6, flow_steps=3, seed=3)
STORE_FRAMES = 8  # one session's window (6 frames) fits, two sessions' do not
SPACING_NS = 100_000_000


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_frames_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("serve_frames") / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve_frames_log") / "server.log"
    process = hf_server(checkpoint, log, "--frame-store-frames", str(STORE_FRAMES)).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def pipeline(checkpoint: Path) -> Pipeline:
    return Pipeline.from_checkpoint(checkpoint, backend="hf", device="cpu")


def stream(make_driving_input: Callable[..., DrivingInput], windows: int, seed: int) -> list[DrivingInput]:
    """Consecutive windows of 2 cameras x 3 frames (128x192): each moves on by one new frame per camera."""
    window = make_driving_input(camera_indices=(0, 2), frames=3, height=128, width=192, seed=seed)
    result = [window]
    for index in range(1, windows):
        fresh = make_driving_input(camera_indices=(0, 2), frames=1, height=128, width=192, seed=seed * 100 + index)
        window = DrivingInput(
            images=np.concatenate([window.images[:, 1:], fresh.images], axis=1),
            camera_indices=window.camera_indices,
            frame_stamps_ns=window.frame_stamps_ns + SPACING_NS,
            t0_ns=window.t0_ns + SPACING_NS,
            ego_history_xyz=window.ego_history_xyz,
            ego_history_rot=window.ego_history_rot,
        )
        result.append(window)
    return result


def assert_same_plan(remote: Plan, local: Plan) -> None:
    np.testing.assert_allclose(remote.xyz, local.xyz, atol=1e-5, rtol=0)
    np.testing.assert_allclose(remote.rot, local.rot, atol=1e-5, rtol=0)
    assert remote.generated_ids == local.generated_ids


def store_stats(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/v1/plan/info", timeout=30).json()["frame_store"]


@pytest.mark.parametrize("transport", ["resized", "shm"])
def test_delta_stream_plans_like_the_pipeline_and_sends_only_new_frames(
    transport: str, server: ServerProcess, pipeline: Pipeline, make_driving_input: Callable[..., DrivingInput]
) -> None:
    """Resized: the new frames travel in the body. Shm: none does; the server resizes them."""
    windows = stream(make_driving_input, 4, seed=1)
    delta = RemotePlanner(server.url, timeout_s=120, frame_transport=transport)
    full = RemotePlanner(server.url, timeout_s=120, delta=False)
    assert delta.uses_shm == (transport == "shm") and not full.uses_shm
    sizes, frames = [], []
    for inputs in windows:
        plan = delta.plan(inputs, SETTINGS)
        assert_same_plan(plan, pipeline.plan(inputs, SETTINGS))
        assert "serve.parse" in plan.timings_ms and "serve.queue" in plan.timings_ms
        assert (plan.timings_ms["remote.shm_write"] > 0) == (plan.timings_ms["serve.resize"] > 0) == (transport == "shm")
        sizes.append(delta.last_request_bytes)
        frames.append(delta.last_sent_frames)
    assert_same_plan(full.plan(windows[-1], SETTINGS), pipeline.plan(windows[-1], SETTINGS))
    assert frames == [6, 2, 2, 2] and full.last_sent_frames == 6  # the first window whole, then the new frames
    frame_bytes = 64 * 96 * 3  # the small-frames checkpoint resizes 128x192 to 64x96
    assert full.last_request_bytes > 6 * frame_bytes
    if transport == "shm":
        assert max(sizes) < frame_bytes, sizes  # no pixels in the body
    else:
        assert sizes[0] > 6 * frame_bytes
        assert all(2 * frame_bytes < size < 3 * frame_bytes for size in sizes[1:]), sizes
    assert store_stats(server)["frames"] <= STORE_FRAMES
    delta.close()
    full.close()


def test_reused_stamp_with_new_pixels_is_sent_not_referred_to(
    server: ServerProcess, pipeline: Pipeline, make_driving_input: Callable[..., DrivingInput]
) -> None:
    """A paused simulator: the same stamps with other pixels. The key is exact, so the frames travel again."""
    first = make_driving_input(camera_indices=(0, 2), frames=3, height=128, width=192, seed=7)
    repainted = make_driving_input(camera_indices=(0, 2), frames=3, height=128, width=192, seed=8)
    planner = RemotePlanner(server.url, timeout_s=120, frame_transport="resized")
    planner.plan(first, SETTINGS)
    assert_same_plan(planner.plan(repainted, SETTINGS), pipeline.plan(repainted, SETTINGS))
    assert planner.last_request_bytes > 6 * 64 * 96 * 3
    planner.close()


def test_sessions_evicting_each_other_resend_and_the_store_stays_bounded(
    server: ServerProcess, pipeline: Pipeline, make_driving_input: Callable[..., DrivingInput]
) -> None:
    """Two clients' windows (12 frames) do not fit the store's 8: each finds its references
    evicted (409), sends its window again, and plans as the pipeline does."""
    planners = [RemotePlanner(server.url, timeout_s=120, frame_transport="resized") for _ in range(2)]
    streams = [stream(make_driving_input, 3, seed=20 + index) for index in range(2)]
    for step in range(3):
        for planner, windows in zip(planners, streams):
            assert_same_plan(planner.plan(windows[step], SETTINGS), pipeline.plan(windows[step], SETTINGS))
            held = store_stats(server)
            assert held["frames"] <= STORE_FRAMES and held["bytes"] <= STORE_FRAMES * 64 * 96 * 3
    assert planners[1].last_request_bytes > 6 * 64 * 96 * 3  # its references were gone: the whole window
    for planner in planners:
        planner.close()


def resized_window(server: ServerProcess, make_driving_input: Callable[..., DrivingInput]) -> DrivingInput:
    """A window whose frames are already at the server's frame size, for hand-made requests."""
    geometry = VisionGeometry(**httpx.get(server.url + "/v1/plan/info", timeout=30).json()["vision"])
    height, width = smart_resize(128, 192, geometry)
    return make_driving_input(camera_indices=(0, 2), frames=3, height=height, width=width, seed=30)


def post(server: ServerProcess, body: bytes) -> httpx.Response:
    return httpx.post(server.url + "/v1/plan", content=body, headers={"content-type": wire.CONTENT_TYPE}, timeout=120)


def test_unknown_references_get_409_naming_the_frames(
    server: ServerProcess, make_driving_input: Callable[..., DrivingInput]
) -> None:
    inputs = resized_window(server, make_driving_input)
    response = post(server, wire.encode_request(inputs, SETTINGS, session="never-sent-anything", sent_slots=[0, 1]))
    error = response.json()["error"]
    assert response.status_code == 409 and error["code"] == "frames_missing" and error["param"] == "sent_slots"
    assert "4 referenced frames" in error["message"] and f"camera 2 stamp {inputs.frame_stamps_ns[1, 2]}" in error["message"]


def test_malformed_deltas_are_refused_naming_the_field_and_store_nothing(
    server: ServerProcess, make_driving_input: Callable[..., DrivingInput]
) -> None:
    inputs = resized_window(server, make_driving_input)
    every = list(range(6))

    def request(**changes: object) -> bytes:
        fields = wire.decode_request(wire.encode_request(inputs, SETTINGS, session="malformed", sent_slots=every))
        for name, value in changes.items():
            setattr(fields, name, value)
        return msgspec.msgpack.encode(fields)

    half_height = wire.pack_array(inputs.images.reshape(6, *inputs.images.shape[2:])[:, ::2])
    cases = {
        "camera_indices": request(camera_indices=[0, 42]),
        "sent": request(sent=half_height),
        "frame_size": request(frame_size=[inputs.images.shape[2] + 1, inputs.images.shape[3]]),
        "sent_slots": request(sent_slots=[0, 1, 2, 3, 4, 6]),
        "session": request(session="../../etc"),
        "images": request(images=wire.pack_array(inputs.images)),
        "frame_stamps_ns": request(frame_stamps_ns=wire.pack_array(inputs.frame_stamps_ns[:1])),
    }
    before = store_stats(server)["frames"]
    for field, body in cases.items():
        response = post(server, body)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == field, (field, error)
        assert error["message"].startswith(f"{field}:"), error
    assert store_stats(server)["frames"] == before  # nothing of a refused request was kept
    full = post(server, wire.encode_request(inputs, SETTINGS))  # the old full-frame request needs no session
    assert full.status_code == 200 and wire.decode_reply(full.content).xyz.shape == (1, 64, 3)


def test_malformed_shm_references_are_refused_naming_the_field_and_store_nothing(
    server: ServerProcess, make_driving_input: Callable[..., DrivingInput]
) -> None:
    inputs = make_driving_input(camera_indices=(0, 2), frames=3, height=128, width=192, seed=31)
    geometry = VisionGeometry(**httpx.get(server.url + "/v1/plan/info", timeout=30).json()["vision"])
    segment = FrameSegment()
    name = segment.write(list(inputs.images.reshape(6, 128, 192, 3)))
    every = list(range(6))

    def request(**changes: object) -> bytes:
        where = wire.ShmFrames(name=name, offset=0, dtype="uint8", shape=[6, 128, 192, 3])
        for key, value in changes.items():
            setattr(where, key, value)
        size = smart_resize(128, 192, geometry)
        return wire.encode_request(inputs, SETTINGS, session="shm-malformed", sent_slots=every, shm=(where, size))

    both = wire.decode_request(request())
    both.sent = wire.pack_array(np.zeros((6, 64, 96, 3), dtype=np.uint8))
    cases = [
        ("shm.name", request(name="../../etc/passwd"), "invalid_request"),
        ("shm.name", request(name="alpamayo_" + "0" * 32), "shm_unavailable"),  # no such segment
        ("shm.offset", request(offset=segment.size + 1), "invalid_request"),
        ("shm.shape", request(offset=1), "invalid_request"),  # the frames would end past the segment
        ("shm.shape", request(shape=[6, 128, 192, 4]), "invalid_request"),
        ("shm.shape", request(shape=[6, 128, 192]), "invalid_request"),
        ("shm.shape", request(shape=[6, 192, 128, 3]), "invalid_request"),  # does not resize to frame_size
        ("shm.dtype", request(dtype="float32"), "invalid_request"),
        ("sent_slots", request(shape=[5, 128, 192, 3]), "invalid_request"),
        ("sent", msgspec.msgpack.encode(both), "invalid_request"),
    ]
    before = store_stats(server)["frames"]
    for field, body, code in cases:
        response = post(server, body)
        error = response.json()["error"]
        assert 400 <= response.status_code < 500 and (error["param"], error["code"]) == (field, code), (field, error)
        assert error["message"].startswith(f"{field}:"), error
    assert store_stats(server)["frames"] == before  # nothing of a refused request was kept
    valid = post(server, request())  # the server keeps serving, and reads the same segment fine
    assert valid.status_code == 200 and wire.decode_reply(valid.content).timings_ms["serve.resize"] > 0
    segment.close()
    assert not (SHM_DIR / name).exists()


def test_planner_unlinks_its_segment_on_close_and_at_exit(
    server: ServerProcess, make_driving_input: Callable[..., DrivingInput]
) -> None:
    before = plan_segments()
    planner = RemotePlanner(server.url, timeout_s=120, frame_transport="shm")
    planner.plan(stream(make_driving_input, 1, seed=50)[0], SETTINGS)
    assert len(plan_segments() - before) == 1
    planner.close()
    assert plan_segments() - before == set()
    ended = subprocess.run(  # an interpreter that exits without close()
        [sys.executable, "-c", "import numpy as np; from alpamayo_ros.serve.shm import FrameSegment; "
         "segment = FrameSegment(); print(segment.write([np.zeros((8, 8, 3), np.uint8)]))"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert ended.stdout.strip().startswith("alpamayo_") and not (SHM_DIR / ended.stdout.strip()).exists()
    assert plan_segments() - before == set()


def test_a_server_without_shm_gets_resized_frames(
    checkpoint: Path, pipeline: Pipeline, make_driving_input: Callable[..., DrivingInput], tmp_path: Path
) -> None:
    """--no-shm: auto falls back to resized frames (and plans the same), shm is refused with 403."""
    windows = stream(make_driving_input, 2, seed=60)
    no_shm = hf_server(checkpoint, tmp_path / "server.log", "--no-shm").start()
    try:
        auto = RemotePlanner(no_shm.url, timeout_s=120)
        assert auto.uses_shm
        for inputs in windows:
            assert_same_plan(auto.plan(inputs, SETTINGS), pipeline.plan(inputs, SETTINGS))
        assert not auto.uses_shm and auto.last_sent_frames == 2 and auto.last_request_bytes > 2 * 64 * 96 * 3
        auto.close()
        forced = RemotePlanner(no_shm.url, timeout_s=120, frame_transport="shm")
        with pytest.raises(RemoteRejected) as refused:
            forced.plan(windows[0], SETTINGS)
        assert (refused.value.status, refused.value.code) == (403, "shm_unavailable") and "shm:" in refused.value.message
        forced.close()
    finally:
        no_shm.stop()


def test_frame_store_bounds_count_and_bytes() -> None:
    store = FrameStore(max_frames=3, max_bytes=3 * 100)

    def frame(stamp: int, height: int = 10, channels: int = 1) -> KeyedFrame:
        return keyed_frame(0, stamp, np.full((height, 10, channels), stamp, dtype=np.uint8))  # 100 bytes by default

    keys = [FrameKey("s", 0, stamp, 10, 10) for stamp in range(5)]
    store.put({key: frame(key.stamp_ns) for key in keys[:3]})
    store.take([keys[0]])  # keys[0] becomes the most recent
    store.put({keys[3]: frame(3)})
    found, missing = store.take(keys[:4])
    assert set(found) == {keys[0], keys[2], keys[3]} and missing == [keys[1]]
    assert found[keys[2]].key == frame(2).key  # held with the key of its own pixels
    store.put({keys[4]: frame(4, channels=2)})  # 200 bytes: two older frames go
    assert len(store) == 2 and store.nbytes == 300
    store.put({keys[0]: frame(0, height=40)})  # over max_bytes alone: not kept
    assert store.nbytes <= 300 and store.take([keys[0]])[1] == [keys[0]]
    with pytest.raises(ValueError, match="max_frames"):
        FrameStore(max_frames=-1, max_bytes=0)


def test_server_restart_mid_stream_costs_one_resend_not_an_error(
    server: ServerProcess, pipeline: Pipeline, make_driving_input: Callable[..., DrivingInput]
) -> None:
    """Last in the module: it restarts the module's server (on the same port)."""
    windows = stream(make_driving_input, 4, seed=40)
    planner = RemotePlanner(server.url, timeout_s=120, frame_transport="resized")
    for inputs in windows[:2]:
        planner.plan(inputs, SETTINGS)
    server.stop()
    server.start()  # an empty frame store: the next window's references are unknown
    for inputs in windows[2:]:
        assert_same_plan(planner.plan(inputs, SETTINGS), pipeline.plan(inputs, SETTINGS))
    assert 2 * 64 * 96 * 3 < planner.last_request_bytes < 3 * 64 * 96 * 3  # after the one resend, deltas again
    planner.close()
