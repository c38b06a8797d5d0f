"""What the server (and the pipeline under it) must refuse or must not be fooled by, through every
HTTP route of a real alpamayo-serve and in-process: ego rotations that are not rotations, a frame
re-sent with its old camera and stamp but new pixels, a request body that stops arriving; and
the `usage` block chat completions owe OpenAI clients."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import msgspec
import numpy as np
import pytest
from serve_helpers import SidecarClient, chat_request_parts, hf_server, small_frames_checkpoint

from alpamayo_ros.core.frame_cache import frame_key
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import DrivingInput, SamplingSettings
from alpamayo_ros.serve import wire
from alpamayo_ros.serve.process import ServerProcess

SETTINGS = SamplingSettings(temperature=0.0, top_p=1.0, max_reasoning_tokens=6, flow_steps=3, seed=5)
BODY_TIMEOUT_S = 1.0
EYE16 = np.tile(np.eye(3, dtype=np.float32), (16, 1, 1))
NOT_ROTATIONS = {
    "2*I": 2 * EYE16,
    "zeros": np.zeros((16, 3, 3), np.float32),
    "reflection": np.tile(np.diag([1.0, 1.0, -1.0]).astype(np.float32), (16, 1, 1)),
    "shear": np.tile(np.array([[1, 0.05, 0], [0, 1, 0], [0, 0, 1]], np.float32), (16, 1, 1)),
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_frames_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("serve_refusals") / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve_refusals_log") / "server.log"
    process = hf_server(checkpoint, log, "--body-timeout-s", str(BODY_TIMEOUT_S)).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def inputs(make_driving_input: Callable[..., DrivingInput]) -> DrivingInput:
    return make_driving_input(camera_indices=(1, 6), frames=2, height=64, width=96, seed=21)


def with_rotations(inputs: DrivingInput, rot: np.ndarray) -> dict:
    """inputs' fields with another ego_history_rot, bypassing DrivingInput's own check."""
    fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs) if f.init}
    return {**fields, "ego_history_rot": rot}


# -- rotations ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NOT_ROTATIONS))
def test_driving_input_refuses_matrices_that_are_not_rotations(inputs: DrivingInput, name: str) -> None:
    rot = NOT_ROTATIONS[name].copy()
    rot[-1] = np.eye(3)  # only the older poses are wrong
    with pytest.raises(ValueError, match=r"ego_history_rot: not a rotation .* at pose 0"):
        DrivingInput(**with_rotations(inputs, rot))


def test_driving_input_takes_real_rotations_at_float_precision(inputs: DrivingInput) -> None:
    yaw = np.linspace(-0.4, 0.0, 16)
    rot = np.zeros((16, 3, 3))
    rot[:, 0, 0], rot[:, 0, 1], rot[:, 1, 0], rot[:, 1, 1], rot[:, 2, 2] = np.cos(yaw), -np.sin(yaw), np.sin(yaw), np.cos(yaw), 1
    rot += np.random.default_rng(0).normal(0, 1e-5, rot.shape)  # rounding in a JSON or float32 round trip
    DrivingInput(**with_rotations(inputs, rot.astype(np.float32)))


def _binary(inputs: DrivingInput, rot: np.ndarray) -> bytes:
    request = msgspec.msgpack.decode(wire.encode_request(inputs, SETTINGS))
    request["ego_history_rot"]["data"] = rot.astype("<f4").tobytes()
    return msgspec.msgpack.encode(request)


def test_every_route_refuses_non_rotations_naming_the_field(server: ServerProcess, inputs: DrivingInput) -> None:
    parts, meta = chat_request_parts(inputs)
    bad = 2 * EYE16
    bad[-1] = np.eye(3)
    xyz = inputs.ego_history_xyz.tolist()
    failures = []
    with httpx.Client(base_url=server.url, timeout=120) as http:
        chat = http.post("/v1/chat/completions", json={
            "model": "alpamayo-1.5", "messages": [{"role": "user", "content": parts}], "output_modality": "trajectory",
            "image_meta": meta, "ego_history": {"xyz": xyz, "rot": bad.tolist()}})
        nvext = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": parts}],
            "nvext": {"egomotion": [[*p, *r.reshape(-1).tolist()] for p, r in zip(xyz, bad)],
                      "camera_order": ["front_wide", "front_tele"], "num_frames_per_camera": 2}})
        infer = http.post("/v1/infer", json={
            "images": [part["image_url"]["url"] for part in parts], "camera_order": ["front_wide", "front_tele"],
            "num_frames_per_camera": 2, "egomotion": [[*p, *r.reshape(-1).tolist()] for p, r in zip(xyz, bad)]})
        binary = http.post("/v1/plan", content=_binary(inputs, bad), headers={"content-type": wire.CONTENT_TYPE})
        for name, response, status, field in (("chat", chat, 400, "ego_history.rot"),
                                              ("chat nvext", nvext, 422, "nvext.egomotion"),
                                              ("infer", infer, 422, "egomotion"),
                                              ("binary", binary, 400, "ego_history_rot")):
            error = response.json().get("error", {})
            if response.status_code != status or error.get("param") != field or "not a rotation" not in error["message"]:
                failures.append(f"{name}: {response.status_code} {response.text[:300]}")
    arrays = {"image_frames": inputs.images.transpose(0, 1, 4, 2, 3), "camera_indices": np.array(inputs.camera_indices),
              "ego_history_xyz": inputs.ego_history_xyz[None, None], "ego_history_rot": bad[None, None]}
    status, reply, _ = SidecarClient(server.url).post("/predict", {}, arrays)
    if status != 400 or "ego_history_rot" not in reply["message"] or "not a rotation" not in reply["message"]:
        failures.append(f"sidecar: {status} {reply}")
    assert not failures, "\n".join(failures)


# -- frame fingerprint -------------------------------------------------------------------------


def test_frame_key_sees_every_changed_pixel() -> None:
    """A region anywhere, however small (one channel of one pixel), changes the key."""
    image = np.random.default_rng(4).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    key = frame_key(1, 10, image)
    rng = np.random.default_rng(5)
    for row, col, channel in zip(rng.integers(0, 1080, 50), rng.integers(0, 1920, 50), rng.integers(0, 3, 50)):
        changed = image.copy()
        changed[row, col, channel] ^= 0x10
        assert frame_key(1, 10, changed) != key, (row, col, channel)
    assert frame_key(1, 10, image[:, ::-1]) != key  # a non-contiguous view hashes its own pixels


def test_frame_keys_on_threads_equal_the_serial_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large requests are fingerprinted on a thread pool where the machine has cores for it
    (not this 2-core one by default): the keys are the same, in the same order."""
    from alpamayo_ros.core import frame_cache

    images = np.random.default_rng(6).integers(0, 256, (2, 3, 720, 1280, 3), dtype=np.uint8)
    window = DrivingInput(images=images, camera_indices=(0, 6), frame_stamps_ns=np.arange(6).reshape(2, 3), t0_ns=5,
                          ego_history_xyz=np.zeros((16, 3), np.float32), ego_history_rot=EYE16)
    monkeypatch.setattr(frame_cache, "_HASH_THREADS", 1)
    serial = frame_cache.frame_keys(window)
    monkeypatch.setattr(frame_cache, "_HASH_THREADS", 3)
    assert frame_cache.frame_keys(window) == serial
    assert serial == [frame_key(camera, stamp, images[row, col]) for row, camera in enumerate((0, 6))
                      for col, stamp in enumerate(range(row * 3, row * 3 + 3))]


def _patched(inputs: DrivingInput) -> DrivingInput:
    """inputs with an 8x8 block of the newest front frame repainted; same cameras and stamps."""
    images = inputs.images.copy()
    images[0, -1, 20:28, 30:38] = 255 - images[0, -1, 20:28, 30:38]
    return dataclasses.replace(inputs, images=images)


def test_pipeline_replans_a_frame_whose_pixels_changed_under_the_same_stamp(checkpoint: Path, inputs: DrivingInput) -> None:
    cached = Pipeline.from_checkpoint(checkpoint, backend="hf", device="cpu")
    cached.plan(inputs, SETTINGS)
    changed = _patched(inputs)
    replanned = cached.plan(changed, SETTINGS)
    assert cached.frames.misses == inputs.images.shape[0] * inputs.images.shape[1] + 1  # only the changed frame
    fresh = Pipeline.from_checkpoint(checkpoint, backend="hf", device="cpu", frame_cache=0).plan(changed, SETTINGS)
    np.testing.assert_array_equal(replanned.xyz, fresh.xyz)
    assert replanned.generated_ids == fresh.generated_ids


def test_server_replans_a_resent_frame_with_new_pixels(server: ServerProcess, checkpoint: Path, inputs: DrivingInput) -> None:
    def plan_over_http(window: DrivingInput) -> np.ndarray:
        parts, meta = chat_request_parts(window)
        response = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "alpamayo-1.5", "messages": [{"role": "user", "content": parts}], "output_modality": "trajectory",
            "image_meta": meta, "temperature": 0.0, "top_p": 1.0, "seed": SETTINGS.seed,
            "max_reasoning_tokens": SETTINGS.max_reasoning_tokens, "flow_steps": SETTINGS.flow_steps,
            "ego_history": {"xyz": window.ego_history_xyz.tolist(), "rot": window.ego_history_rot.tolist()}})
        assert response.status_code == 200, response.text
        return np.array(response.json()["trajectory"]["pred_xyz"])

    plan_over_http(inputs)
    misses = httpx.get(server.url + "/v1/metadata").json()["frame_cache"]["misses"]
    changed = _patched(inputs)
    served = plan_over_http(changed)
    assert httpx.get(server.url + "/v1/metadata").json()["frame_cache"]["misses"] == misses + 1
    expected = Pipeline.from_checkpoint(checkpoint, backend="hf", device="cpu", frame_cache=0).plan(changed, SETTINGS)
    np.testing.assert_allclose(served, expected.xyz, atol=1e-5, rtol=0)


# -- body read timeout -------------------------------------------------------------------------


def _stalled_request(port: int, head: bytes, partial: bytes) -> tuple[bytes, float]:
    """Send head and part of a body, then nothing; return what the server sent until it closed,
    and how long after the stall that took."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head + partial)
        stalled = time.monotonic()
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received, time.monotonic() - stalled


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_that_stops_arriving_gets_408_and_a_closed_connection(server: ServerProcess, framing: str) -> None:
    body = b'{"model": "alpamayo-1.5", "messages": [' + b" " * 5000
    if framing == "content-length":
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body) * 2}\r\n\r\n").encode()
        partial = body
    else:
        head = b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        partial = f"{len(body):x}\r\n".encode() + body + b"\r\n"
    received, waited = _stalled_request(server.port, head, partial)
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), received[:300]
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"
    assert waited < BODY_TIMEOUT_S + 30  # bounded: the 1 s limit plus generous scheduling slack
    assert httpx.get(server.url + "/v1/health/ready", timeout=30).status_code == 200  # still serving


def test_a_slow_route_is_not_cut_by_the_body_timeout(server: ServerProcess, inputs: DrivingInput) -> None:
    """The deadline bounds the body's arrival, not the plan: a plan longer than it is answered."""
    parts, meta = chat_request_parts(inputs)
    response = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": "alpamayo-1.5", "messages": [{"role": "user", "content": parts}], "output_modality": "trajectory",
        "image_meta": meta, "max_reasoning_tokens": 40, "flow_steps": 40, "n": 4,
        "ego_history": {"xyz": inputs.ego_history_xyz.tolist(), "rot": inputs.ego_history_rot.tolist()}})
    assert response.status_code == 200, response.text
    assert response.json()["trajectory"]["timings_ms"]["total"] > 0


# -- usage -------------------------------------------------------------------------------------


def test_chat_completions_report_usage(server: ServerProcess, checkpoint: Path, inputs: DrivingInput) -> None:
    pipeline = Pipeline.from_checkpoint(checkpoint, backend="hf", device="cpu")
    parts, meta = chat_request_parts(inputs)
    history = {"xyz": inputs.ego_history_xyz.tolist(), "rot": inputs.ego_history_rot.tolist()}
    common = {"model": "alpamayo-1.5", "image_meta": meta, "temperature": 0.0, "top_p": 1.0, "seed": SETTINGS.seed}
    planned = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        **common, "messages": [{"role": "user", "content": parts}], "output_modality": "trajectory", "ego_history": history,
        "max_reasoning_tokens": SETTINGS.max_reasoning_tokens, "flow_steps": SETTINGS.flow_steps}).json()
    plan = pipeline.plan(inputs, SETTINGS)
    prompt = len(pipeline.driving_prompt(inputs, pipeline.preprocess(inputs)).input_ids)
    generated = len(plan.generated_ids[0])
    assert planned["usage"] == {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    question = "Any pedestrians?"
    answered = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        **common, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": question}, *parts]}]}).json()
    reply = pipeline.generate_text(inputs, question, dataclasses.replace(SETTINGS), max_new_tokens=5)[0]
    assert answered["usage"]["completion_tokens"] == len(reply.token_ids)
    assert answered["usage"]["total_tokens"] == answered["usage"]["prompt_tokens"] + len(reply.token_ids)
    assert answered["usage"]["prompt_tokens"] > 0


def test_body_timeout_in_process_answers_408_to_a_stalled_receive() -> None:
    """The middleware on its own, around a real Starlette app that reads its body: the second
    body chunk never comes, so the app's wait is cut and the client gets 408."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from alpamayo_ros.serve.app import BodyTimeout
    from alpamayo_ros.serve.metrics import ServerMetrics

    async def echo(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(await request.body())))

    metrics = ServerMetrics(lambda: 0)
    app = BodyTimeout(Starlette(routes=[Route("/", echo, methods=["POST"])]), timeout_s=0.2, metrics=metrics)
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", b"100")],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("x", 1), "client": ("y", 2),
             "root_path": ""}

    async def run() -> list[dict]:
        chunks = [{"type": "http.request", "body": b"x" * 10, "more_body": True}]
        never = asyncio.Event()

        async def receive() -> dict:
            if chunks:
                return chunks.pop()
            await never.wait()
            return {"type": "http.disconnect"}

        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await asyncio.wait_for(app(scope, receive, send), 30)
        return sent

    sent = asyncio.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["error"]["code"] == "body_timeout"
    assert b"alpamayo_rejections_total{reason=\"body_timeout\"} 1.0" in metrics.render()
