"""RemotePlanner against a real alpamayo-serve process: Plans equal in-process Pipeline.plan,
errors fall into remote_unavailable / remote_timeout / remote_rejected, a killed server is
reported quickly and planned with again soon after it returns. Also the FlashDrive sidecar
endpoints, through a client written from that protocol's published facts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
from serve_helpers import SidecarClient, hf_server, small_frames_checkpoint

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import DrivingInput, SamplingSettings
from alpamayo_ros.serve.process import ServerProcess, free_port
from alpamayo_ros.serve.client import RemotePlanner, RemoteRejected, RemoteTimeout, RemoteUnavailable

API_KEY = "client-key"
SETTINGS = SamplingSettings(num_samples=2, temperature=0.8, max_reasoning_tokens=8, flow_steps=4, seed=5, cfg_weight=1.5)
SIDECAR_SETTINGS = '{"max_reasoning_tokens": 6, "flow_steps": 3}'


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_frames_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("serve_client") / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve_client_log") / "server.log"
    process = hf_server(checkpoint, log, "--api-key", API_KEY, "--sidecar-settings", SIDECAR_SETTINGS).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def pipeline(checkpoint: Path) -> Pipeline:
    return Pipeline.from_checkpoint(checkpoint, backend="hf", device="cpu")


@pytest.fixture(scope="module")
def stream(make_driving_input: Callable[..., DrivingInput]) -> list[DrivingInput]:
    """Two consecutive windows of 2 cameras x 3 frames (128x192, resized on the client to 64x96):
    the second shares two frames per camera with the first."""
    first = make_driving_input(camera_indices=(0, 2), frames=3, height=128, width=192, seed=1, route_text="Turn left in 40m")
    fresh = make_driving_input(camera_indices=(0, 2), frames=1, height=128, width=192, seed=2)
    second = DrivingInput(
        images=np.concatenate([first.images[:, 1:], fresh.images], axis=1),
        camera_indices=first.camera_indices,
        frame_stamps_ns=first.frame_stamps_ns + 100_000_000,
        t0_ns=first.t0_ns + 100_000_000,
        ego_history_xyz=first.ego_history_xyz,
        ego_history_rot=first.ego_history_rot,
        route_text=first.route_text,
    )
    return [first, second]


def test_remote_plans_equal_in_process_plans(server: ServerProcess, pipeline: Pipeline, stream: list[DrivingInput]) -> None:
    planner = RemotePlanner(server.url, timeout_s=120, api_key=API_KEY)
    for inputs in stream:
        remote, local = planner.plan(inputs, SETTINGS), pipeline.plan(inputs, SETTINGS)
        np.testing.assert_allclose(remote.xyz, local.xyz, atol=1e-5, rtol=0)
        np.testing.assert_allclose(remote.rot, local.rot, atol=1e-5, rtol=0)
        assert remote.coc == local.coc and remote.generated_ids == local.generated_ids
        assert remote.reasoning_closed == local.reasoning_closed and len(remote.reasoning_closed) == len(local.coc)
        assert remote.t0_ns == inputs.t0_ns and "cfg_prefill" in remote.timings_ms  # the route reached the prompt
        assert remote.timings_ms["remote.roundtrip"] >= remote.timings_ms["total"]
    assert planner.backend == "remote:hf"
    planner.close()


def test_rejections_and_timeouts_are_told_apart(server: ServerProcess, stream: list[DrivingInput]) -> None:
    planner = RemotePlanner(server.url, timeout_s=120, api_key=API_KEY)
    with pytest.raises(RemoteRejected) as rejected:
        planner.plan(stream[0], SamplingSettings(top_p=2.0))
    assert rejected.value.status == 400 and "settings.top_p" in rejected.value.message
    assert rejected.value.reason == "remote_rejected"
    with pytest.raises(RemoteRejected) as unauthorized:
        RemotePlanner(server.url, timeout_s=120, api_key="wrong").plan(stream[0], SETTINGS)
    assert unauthorized.value.status == 401
    impatient = RemotePlanner(server.url, timeout_s=0.05, api_key=API_KEY)  # far less than one plan takes
    with pytest.raises(RemoteTimeout) as timeout:
        for _ in range(20):  # the first call may also spend its budget on the geometry
            impatient.plan(stream[0], SETTINGS)
    assert timeout.value.reason == "remote_timeout"
    assert planner.plan(stream[0], SETTINGS).xyz.shape == (2, 64, 3)  # still serving


def test_unreachable_server_fails_fast_and_construction_never_blocks(stream: list[DrivingInput]) -> None:
    started = time.monotonic()
    planner = RemotePlanner(f"http://127.0.0.1:{free_port()}", timeout_s=30)
    with pytest.raises(RemoteUnavailable) as first:
        planner.plan(stream[0], SETTINGS)
    with pytest.raises(RemoteUnavailable, match="next try in"):  # within the backoff: no connection attempt
        planner.plan(stream[0], SETTINGS)
    assert first.value.reason == "remote_unavailable"
    assert time.monotonic() - started < 10  # hang guard: refused connections do not wait for timeout_s


def test_sidecar_protocol_plans_like_the_pipeline(server: ServerProcess, pipeline: Pipeline, stream: list[DrivingInput]) -> None:
    """Autoware's node: (cams, frames, 3, H, W) frames in shared memory, (1, 1, 16, ...) history inline."""
    inputs = stream[0]
    client = SidecarClient(server.url, {"Authorization": f"Bearer {API_KEY}"})
    assert client.http.get("/health").status_code == 200
    status, meta, _ = client.post("/reset", {}, {})
    assert (status, meta["status"]) == (200, "ok")
    arrays = {
        "image_frames": inputs.images.transpose(0, 1, 4, 2, 3),
        "camera_indices": np.array(inputs.camera_indices[::-1], dtype=np.int64),  # any order; rows follow
        "ego_history_xyz": inputs.ego_history_xyz[None, None],
        "ego_history_rot": inputs.ego_history_rot[None, None],
    }
    arrays["image_frames"] = arrays["image_frames"][::-1]
    status, meta, reply = client.post("/predict", {"num_frames_per_camera": 3, "nav_text": inputs.route_text},
                                      arrays, shm_keys=("image_frames",))
    assert status == 200 and meta["status"] == "ok", meta
    expected = pipeline.plan(inputs, SamplingSettings(temperature=0.0, top_p=1.0, max_reasoning_tokens=6, flow_steps=3))
    np.testing.assert_allclose(reply["traj_batch"], expected.xyz, atol=1e-5, rtol=0)
    np.testing.assert_allclose(reply["rot_batch"], expected.rot, atol=1e-5, rtol=0)
    assert meta["cot"] == expected.coc[0] and meta["server_sec"] > 0
    status, meta, _ = client.post("/predict", {}, {**arrays, "image_frames": arrays["image_frames"]},
                                  shm_keys=())  # inline frames work too
    assert status == 200 and meta["status"] == "ok"


def test_killed_server_is_reported_and_planned_with_again_after_it_returns(
    server: ServerProcess, stream: list[DrivingInput]
) -> None:
    """Last in the module: it kills the module's server and starts it again on the same port."""
    planner = RemotePlanner(server.url, timeout_s=60, api_key=API_KEY, max_backoff_s=2.0)
    planner.plan(stream[0], SETTINGS)
    server.kill()
    started = time.monotonic()
    with pytest.raises(RemoteUnavailable):
        planner.plan(stream[1], SETTINGS)
    assert time.monotonic() - started < 10  # hang guard: a dead server is reported, not waited for
    for _ in range(10):  # while it is down, every tick fails the same way, and fast
        with pytest.raises(RemoteUnavailable):
            planner.plan(stream[1], SETTINGS)
        time.sleep(0.3)
    server.start()  # returns once /health says ready
    ready = time.monotonic()
    while True:
        attempt = time.monotonic()
        try:
            plan = planner.plan(stream[1], SETTINGS)
            break
        except RemoteUnavailable:
            assert attempt - ready < 5, "no plan within 5 s of the server's return"
            time.sleep(0.1)
    assert attempt - ready < 5 and plan.xyz.shape == (2, 64, 3)
