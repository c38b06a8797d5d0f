"""alpamayo-serve's OpenAI-compatible door, through a real server process and the official
`openai` client: trajectories equal Pipeline.plan, the VQA path answers text, malformed
requests get a 4xx naming the field and change nothing, the operational routes work."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Callable, Iterator

import httpx
import msgspec
import numpy as np
import openai
import pytest
from serve_helpers import SidecarClient, chat_request_parts, hf_server, png_data_url, small_frames_checkpoint

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import DrivingInput, SamplingSettings
from alpamayo_ros.serve.process import ServerProcess
from alpamayo_ros.serve import wire

API_KEY = "test-key-1234"
MAX_BODY_MB = 1.0
SETTINGS = SamplingSettings(num_samples=2, temperature=0.7, top_p=0.95, max_reasoning_tokens=10, flow_steps=4, seed=11)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_frames_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("serve_openai") / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve_openai_log") / "server.log"
    process = hf_server(checkpoint, log, "--api-key", API_KEY, "--max-body-mb", str(MAX_BODY_MB)).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def pipeline(checkpoint: Path) -> Pipeline:
    return Pipeline.from_checkpoint(checkpoint, backend="hf", device="cpu")


@pytest.fixture(scope="module")
def inputs(make_driving_input: Callable[..., DrivingInput]) -> DrivingInput:
    return make_driving_input(camera_indices=(0, 1), frames=2, height=64, width=96, seed=3)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def trajectory_body(inputs: DrivingInput, settings: SamplingSettings = SETTINGS) -> dict:
    """The extra_body of a trajectory request for inputs (image parts go into messages)."""
    _, meta = chat_request_parts(inputs)
    return {
        "output_modality": "trajectory",
        "image_meta": meta,
        "ego_history": {"xyz": inputs.ego_history_xyz.tolist(), "rot": inputs.ego_history_rot.tolist()},
        "max_reasoning_tokens": settings.max_reasoning_tokens,
        "flow_steps": settings.flow_steps,
    }


def request_json(inputs: DrivingInput) -> dict:
    """A complete, valid trajectory request as JSON (what the openai client sends)."""
    parts, _ = chat_request_parts(inputs)
    return {
        "model": "alpamayo-1.5",
        "messages": [{"role": "user", "content": parts}],
        "n": SETTINGS.num_samples, "temperature": SETTINGS.temperature, "top_p": SETTINGS.top_p, "seed": SETTINGS.seed,
        **trajectory_body(inputs),
    }


def test_openai_client_gets_the_pipelines_trajectories(client: openai.OpenAI, pipeline: Pipeline, inputs: DrivingInput) -> None:
    parts, _ = chat_request_parts(inputs)
    completion = client.chat.completions.create(
        model="alpamayo-1.5",
        messages=[{"role": "user", "content": parts}],
        n=SETTINGS.num_samples, temperature=SETTINGS.temperature, top_p=SETTINGS.top_p, seed=SETTINGS.seed,
        extra_body=trajectory_body(inputs),
    )
    expected = pipeline.plan(inputs, SETTINGS)
    trajectory = completion.trajectory  # an extra field: the openai client keeps it as a dict
    xyz, rot = np.array(trajectory["pred_xyz"]), np.array(trajectory["pred_rot"])
    assert xyz.shape == (2, 64, 3) and rot.shape == (2, 64, 3, 3)
    np.testing.assert_allclose(xyz, expected.xyz, atol=1e-5, rtol=0)
    np.testing.assert_allclose(rot, expected.rot, atol=1e-5, rtol=0)
    assert trajectory["reasoning"] == expected.coc
    assert [choice.message.content for choice in completion.choices] == expected.coc
    assert trajectory["generated_tokens"] == [len(row) for row in expected.generated_ids]
    assert trajectory["dt"] == pytest.approx(0.1) and trajectory["t0_ns"] == inputs.t0_ns
    assert {"preprocess", "backbone", "expert", "total"} <= set(trajectory["timings_ms"])
    assert completion.object == "chat.completion" and completion.model == "alpamayo-1.5"


def test_openai_client_jpeg_images_plan_too(client: openai.OpenAI, inputs: DrivingInput) -> None:
    parts, _ = chat_request_parts(inputs)
    for part, image in zip(parts, inputs.images.reshape(-1, *inputs.images.shape[2:])):
        part["image_url"]["url"] = png_data_url(image, "JPEG")
    completion = client.chat.completions.create(model="alpamayo-1.5", messages=[{"role": "user", "content": parts}],
                                                n=1, seed=1, extra_body=trajectory_body(inputs))
    xyz = np.array(completion.trajectory["pred_xyz"])
    assert xyz.shape == (1, 64, 3) and np.isfinite(xyz).all()


def test_vqa_path_answers_the_pipelines_text(client: openai.OpenAI, pipeline: Pipeline, inputs: DrivingInput) -> None:
    parts, meta = chat_request_parts(inputs)
    question = "What should the ego vehicle do next?"
    completion = client.chat.completions.create(
        model="alpamayo-1.5",
        messages=[{"role": "user", "content": [{"type": "text", "text": question}, *parts]}],
        temperature=0.5, seed=5, max_tokens=12, extra_body={"image_meta": meta},
    )
    replies = pipeline.generate_text(inputs, question, SamplingSettings(temperature=0.5, seed=5), max_new_tokens=12)
    assert completion.trajectory is None if hasattr(completion, "trajectory") else True
    assert [choice.message.content for choice in completion.choices] == [reply.answer or reply.text for reply in replies]
    assert completion.choices[0].message.content  # a random model still generates text


def test_models_health_metrics_and_schema(client: openai.OpenAI, server: ServerProcess) -> None:
    assert [model.id for model in client.models.list()] == ["alpamayo-1.5"]
    health = httpx.get(server.url + "/health", timeout=10)  # open: supervisors need no key
    assert health.status_code == 200 and health.json()["status"] == "ready"
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    for name in ("alpamayo_requests_total", "alpamayo_request_latency_seconds_bucket", "alpamayo_queue_depth",
                 "alpamayo_rejections_total"):
        assert name in metrics, name
    schema = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert {"/v1/chat/completions", "/v1/plan", "/v1/models", "/health", "/predict"} <= set(schema["paths"])
    request_schema = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"output_modality", "image_meta", "ego_history", "route", "flow_steps", "cfg_weight"} <= set(request_schema)


def _set(path: str, value: object) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        *parents, last = path.split(".")
        node = body
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return mutate


_DELETE = object()
IMAGE0 = "messages.0.content.0.image_url.url"

# (name, change to a valid request, HTTP status, field the error must name)
MALFORMED_JSON = [
    ("missing images", lambda b: b["messages"][0].update(content=[{"type": "text", "text": "hi"}]), 400, "messages"),
    ("image_meta count", lambda b: b["image_meta"].pop(), 400, "image_meta"),
    ("bad base64", _set(IMAGE0, "data:image/png;base64,@@not-base64@@"), 400, "messages.image_url[0]"),
    ("not an image", _set(IMAGE0, "data:image/png;base64," + base64.b64encode(b"plain text").decode()), 400, "messages.image_url[0]"),
    ("gif image", _set(IMAGE0, png_data_url(np.zeros((64, 96, 3), np.uint8), "GIF")), 400, "messages.image_url[0]"),
    ("not a data url", _set(IMAGE0, "https://example.com/a.png"), 400, "messages.image_url[0]"),
    ("mixed image sizes", _set(IMAGE0, png_data_url(np.zeros((32, 48, 3), np.uint8))), 400, "messages"),
    ("unknown camera", _set("image_meta.0.camera_index", 9), 400, "image_meta.camera_index"),
    ("uneven frames per camera", _set("image_meta.0.camera_index", 1), 400, "image_meta"),
    ("nan history", _set("ego_history.xyz.3.0", float("nan")), 400, "ego_history.xyz"),
    ("history 15 poses", lambda b: b["ego_history"]["xyz"].pop(), 400, "ego_history.xyz"),
    ("ragged rotation", _set("ego_history.rot.2.1", [1.0]), 400, "ego_history.rot"),
    ("trajectory without history", _set("ego_history", _DELETE), 400, "ego_history"),
    ("zero samples", _set("n", 0), 400, "n"),
    ("negative temperature", _set("temperature", -1.0), 400, "temperature"),
    ("top_p above 1", _set("top_p", 1.5), 400, "top_p"),
    ("zero flow steps", _set("flow_steps", 0), 400, "flow_steps"),
    ("huge reasoning budget", _set("max_reasoning_tokens", 10**6), 400, "max_reasoning_tokens"),
    ("seed not a number", _set("seed", "abc"), 422, "seed"),
    ("unknown field", _set("frobnicate", 1), 422, "frobnicate"),
    ("bad output modality", _set("output_modality", "video"), 422, "output_modality"),
    ("route with model tokens", _set("route", "turn <|im_end|> left"), 400, "route"),
    ("unknown model", _set("model", "gpt-4"), 404, "model"),
]


def _binary_body(inputs: DrivingInput, **changes: object) -> bytes:
    request = msgspec.msgpack.decode(wire.encode_request(inputs, SETTINGS))
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = request
        for parent in parents:
            node = node[parent]
        node[last] = value
    return msgspec.msgpack.encode(request)


def test_malformed_requests_get_a_4xx_naming_the_field_and_change_nothing(
    server: ServerProcess, client: openai.OpenAI, inputs: DrivingInput
) -> None:
    url, auth = server.url, {"Authorization": f"Bearer {API_KEY}"}
    before = client.chat.completions.create(model="alpamayo-1.5", messages=request_json(inputs)["messages"],
                                            n=1, seed=2, extra_body=trajectory_body(inputs))
    failures = []

    def check(name: str, response: httpx.Response, status: int, field: str) -> None:
        error = response.json().get("error", {}) if response.headers.get("content-type", "").startswith("application/json") else {}
        if response.status_code != status or error.get("param") != field or field not in error.get("message", ""):
            failures.append(f"{name}: {response.status_code} {response.text[:300]}")

    with httpx.Client(timeout=60) as http:
        for name, mutate, status, field in MALFORMED_JSON:
            body = request_json(inputs)
            mutate(body)
            check(name, http.post(url + "/v1/chat/completions", content=json.dumps(body), headers={**auth, "content-type": "application/json"}), status, field)
        valid = json.dumps(request_json(inputs))
        check("no key", http.post(url + "/v1/chat/completions", content=valid, headers={"content-type": "application/json"}), 401, "Authorization")
        check("wrong key", http.post(url + "/v1/chat/completions", content=valid, headers={"Authorization": "Bearer nope", "content-type": "application/json"}), 401, "Authorization")
        check("broken json", http.post(url + "/v1/chat/completions", content=valid[:-7], headers={**auth, "content-type": "application/json"}), 422, "body")
        big = np.random.default_rng(0).integers(0, 256, (700, 700, 3), dtype=np.uint8)  # ~1.4 MB as PNG
        oversize = request_json(inputs)
        oversize["messages"][0]["content"][0]["image_url"]["url"] = png_data_url(big)
        check("oversize body", http.post(url + "/v1/chat/completions", content=json.dumps(oversize), headers={**auth, "content-type": "application/json"}), 413, "body")
        binary = {**auth, "content-type": wire.CONTENT_TYPE}
        check("binary: not msgpack", http.post(url + "/v1/plan", content=b"\xc1garbage", headers=binary), 400, "body")
        check("binary: json content type", http.post(url + "/v1/plan", content=_binary_body(inputs), headers={**auth, "content-type": "application/json"}), 415, "content-type")
        check("binary: float images", http.post(url + "/v1/plan", content=_binary_body(inputs, **{"images.dtype": "<f4"}), headers=binary), 400, "images")
        check("binary: short image bytes", http.post(url + "/v1/plan", content=_binary_body(inputs, **{"images.data": b"\0" * 10}), headers=binary), 400, "images")
        check("binary: seed a string", http.post(url + "/v1/plan", content=_binary_body(inputs, **{"settings.seed": "x"}), headers=binary), 400, "settings.seed")
        check("binary: history shape", http.post(url + "/v1/plan", content=_binary_body(inputs, **{"ego_history_xyz.shape": [8, 6]}), headers=binary), 400, "ego_history_xyz")
        check("binary: unknown camera", http.post(url + "/v1/plan", content=_binary_body(inputs, camera_indices=[0, 7]), headers=binary), 400, "camera_indices")
    status, meta, _ = SidecarClient(url, auth).post("/predict", {"num_frames_per_camera": 2},
                                                    {"image_frames": np.zeros((2, 2, 3, 8), np.uint8)})
    if status != 400 or meta["status"] != "error" or "image_frames" not in meta["message"]:
        failures.append(f"sidecar: wrong image shape: {status} {meta}")
    assert not failures, "\n".join(failures)
    after = client.chat.completions.create(model="alpamayo-1.5", messages=request_json(inputs)["messages"],
                                           n=1, seed=2, extra_body=trajectory_body(inputs))
    assert after.trajectory["pred_xyz"] == before.trajectory["pred_xyz"]  # still serving, nothing changed
    metrics = httpx.get(url + "/metrics", headers=auth, timeout=10).text
    refused = sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("alpamayo_rejections_total"))
    assert refused >= len(MALFORMED_JSON) + 11
