"""alpamayo-serve's NIM-compatible routes through a real server process, with requests written
from NVIDIA's Alpamayo1.5 NIM 1.0.0 documentation (sampling-params, api-reference): the plans
equal Pipeline.plan on the same inputs, malformed requests get 422 naming the field and change
nothing, and the operational routes answer."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Callable, Iterator

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from serve_helpers import hf_server, png_data_url, small_frames_checkpoint

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import DrivingInput, SamplingSettings
from alpamayo_ros.serve.process import ServerProcess

#: The documentation's default order (sampling-params) and the upstream camera index of each name.
DOC_DEFAULT_ORDER = ["cross_left", "front_wide", "cross_right", "front_tele"]
INDEX = {"cross_left": 0, "front_wide": 1, "cross_right": 2, "rear_left": 3, "rear_tele": 4, "rear_right": 5,
         "front_tele": 6}
HEIGHT, WIDTH = 64, 96
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_frames_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("serve_nim") / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve_nim_log") / "server.log"
    process = hf_server(checkpoint, log).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def pipeline(checkpoint: Path) -> Pipeline:
    return Pipeline.from_checkpoint(checkpoint, backend="hf", device="cpu")


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


def camera_frames(cameras: list[str], frames: int, seed: int) -> dict[str, np.ndarray]:
    """Random uint8 frames (frames, H, W, 3) per camera name, oldest first."""
    rng = np.random.default_rng(seed)
    return {name: rng.integers(0, 256, (frames, HEIGHT, WIDTH, 3), dtype=np.uint8) for name in cameras}


def history(speed_mps: float = 6.0, yaw_rate: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """16 poses t0-1.5 s ... t0 of a gentle left turn, in the t0 ego frame (origin last)."""
    t = -0.1 * np.arange(15, -1, -1)
    yaw = yaw_rate * t
    xyz = np.stack([speed_mps * t, 0.5 * speed_mps * yaw_rate * t**2, np.zeros(16)], axis=1)
    rot = np.zeros((16, 3, 3))
    rot[:, 0, 0], rot[:, 0, 1], rot[:, 1, 0], rot[:, 1, 1], rot[:, 2, 2] = np.cos(yaw), -np.sin(yaw), np.sin(yaw), np.cos(yaw), 1
    return xyz.astype(np.float32), rot.astype(np.float32)


def egomotion(xyz: np.ndarray, rot: np.ndarray, form: str = "matrix") -> list[list[float]]:
    """Rows [x, y, z, r00..r22] or [x, y, z, qx, qy, qz, qw] (yaw-only rotations here)."""
    if form == "matrix":
        return [[*map(float, p), *map(float, r.reshape(-1))] for p, r in zip(xyz, rot)]
    yaw = np.arctan2(rot[:, 1, 0], rot[:, 0, 0])
    return [[*map(float, p), 0.0, 0.0, float(np.sin(y / 2)), float(np.cos(y / 2))] for p, y in zip(xyz, yaw)]


def expected_input(frames: dict[str, np.ndarray], route: str | None = None) -> DrivingInput:
    """The DrivingInput the documentation's layout describes: cameras by index, frames oldest first."""
    names = sorted(frames, key=INDEX.__getitem__)
    count = len(next(iter(frames.values())))
    stamps = 10**9 - 10**8 * np.arange(count - 1, -1, -1, dtype=np.int64)
    xyz, rot = history()
    return DrivingInput(images=np.stack([frames[name] for name in names]), camera_indices=tuple(INDEX[n] for n in names),
                        frame_stamps_ns=np.tile(stamps, (len(names), 1)), t0_ns=10**9,
                        ego_history_xyz=xyz, ego_history_rot=rot, route_text=route)


def images_of(frames: dict[str, np.ndarray], order: list[str], image_format: str = "PNG") -> list[str]:
    """Camera-major images in order, each camera's frames oldest first, as data URLs."""
    return [png_data_url(image, image_format) for name in order for image in frames[name]]


def settings(samples: int = 1, seed: int = 42, greedy: bool = False) -> SamplingSettings:
    """The NIM defaults (temperature 0.6, top_p 0.98) with this test's short token budget."""
    return SamplingSettings(num_samples=samples, temperature=0.0 if greedy else 0.6, top_p=1.0 if greedy else 0.98,
                            max_reasoning_tokens=MAX_TOKENS, seed=seed)


def assert_plan(trajectories: list[dict], plan) -> None:
    assert len(trajectories) == len(plan.coc)
    np.testing.assert_allclose(np.array([t["xyz"] for t in trajectories]), plan.xyz, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array([t["rotations"] for t in trajectories]), plan.rot, atol=1e-5, rtol=0)
    assert [t["reasoning"] for t in trajectories] == plan.coc
    for t in trajectories:
        assert set(t["comfort"]) >= {"max_abs_longitudinal_accel_mps2", "max_abs_lateral_accel_mps2", "max_abs_jerk_mps3"}


def test_default_sixteen_image_trajectory(http: httpx.Client, pipeline: Pipeline) -> None:
    """sampling-params: without camera_order, 16 images are cross_left, front_wide, cross_right,
    front_tele x t0 (oldest) ... t3 (current)."""
    frames = camera_frames(DOC_DEFAULT_ORDER, 4, seed=1)
    xyz, rot = history()
    bare = [url.split(",", 1)[1] for url in images_of(frames, DOC_DEFAULT_ORDER)]  # plain base64 is allowed too
    response = http.post("/v1/infer", json={"images": bare, "egomotion": egomotion(xyz, rot), "max_tokens": MAX_TOKENS,
                                            "seed": 42})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["mode"] == "trajectory" and body["camera_order"] == DOC_DEFAULT_ORDER
    assert body["num_frames_per_camera"] == 4 and body["dt_s"] == pytest.approx(0.1)
    expected = pipeline.plan(expected_input(frames), settings())
    assert_plan(body["trajectories"], expected)
    usage = body["usage"]
    assert usage["completion_tokens"] == len(expected.generated_ids[0])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_reduced_layout_samples_and_nav_text(http: httpx.Client, pipeline: Pipeline) -> None:
    """sampling-params' reduced layout: camera_order ["front_wide"], num_frames_per_camera 4;
    several samples, a route, quaternion rows."""
    frames = camera_frames(["front_wide"], 4, seed=2)
    xyz, rot = history()
    route = "Turn right in 30m"
    response = http.post("/v1/infer", json={
        "images": images_of(frames, ["front_wide"]), "camera_order": ["front_wide"], "num_frames_per_camera": 4,
        "egomotion": egomotion(xyz, rot, "quaternion"), "num_traj_samples": 3, "nav_text": route,
        "max_tokens": MAX_TOKENS, "seed": 7})
    assert response.status_code == 200, response.text
    assert_plan(response.json()["trajectories"], pipeline.plan(expected_input(frames, route), settings(3, seed=7)))


def test_one_current_frame_per_camera_both_modes(http: httpx.Client, pipeline: Pipeline) -> None:
    """sampling-params: four cameras with num_frames_per_camera 1 (the current frame each), mode both."""
    order = ["cross_left", "front_wide", "cross_right", "front_tele"]
    frames = camera_frames(order, 1, seed=3)
    xyz, rot = history()
    question = "Is the road ahead clear?"
    response = http.post("/v1/infer", json={
        "mode": "both", "images": images_of(frames, order, "JPEG"), "camera_order": order, "num_frames_per_camera": 1,
        "egomotion": egomotion(xyz, rot), "question": question, "max_tokens": MAX_TOKENS, "seed": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    decoded = {name: np.array(_decode(url))[None] for name, url in zip(order, images_of(frames, order, "JPEG"))}
    inputs = expected_input(decoded)
    assert_plan(body["trajectories"], pipeline.plan(inputs, settings(seed=3)))
    reply = pipeline.generate_text(inputs, question, settings(seed=3), max_new_tokens=MAX_TOKENS)[0]
    assert body["answer"] == (reply.answer or reply.text)


def test_answer_mode_needs_no_egomotion(http: httpx.Client, pipeline: Pipeline) -> None:
    frames = camera_frames(["front_wide"], 1, seed=4)
    question = "What is the weather?"
    response = http.post("/v1/infer", json={"mode": "answer", "images": images_of(frames, ["front_wide"]),
                                            "question": question, "max_tokens": MAX_TOKENS, "seed": 1})
    assert response.status_code == 200, response.text
    body = response.json()
    assert "trajectories" not in body
    reply = pipeline.generate_text(expected_input(frames), question, settings(seed=1), max_new_tokens=MAX_TOKENS)[0]
    assert body["answer"] == (reply.answer or reply.text)
    assert body["usage"]["completion_tokens"] == len(reply.token_ids)


def test_cameras_in_any_order_are_planned_by_index(http: httpx.Client, pipeline: Pipeline) -> None:
    order = ["front_tele", "camera_cross_left_120fov"]  # a full dataset name works too
    frames = camera_frames(["front_tele", "cross_left"], 2, seed=5)
    xyz, rot = history()
    formats = iter(["WEBP", "BMP", "PNG", "BMP"])  # lossless WebP and BMP decode to the same pixels
    images = [_data_url(image, next(formats)) for name in ("front_tele", "cross_left") for image in frames[name]]
    response = http.post("/v1/infer", json={"images": images, "camera_order": order, "num_frames_per_camera": 2,
                                            "egomotion": egomotion(xyz, rot), "max_tokens": MAX_TOKENS, "seed": 5})
    assert response.status_code == 200, response.text
    assert_plan(response.json()["trajectories"], pipeline.plan(expected_input(frames), settings(seed=5)))


def test_openai_client_with_nvext_and_usage(server: ServerProcess, pipeline: Pipeline) -> None:
    """api-reference: chat completions carry images as image_url parts and the trajectory fields
    under nvext; seed with top_k 1 and top_p 1 repeats a K=1 plan."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    order = ["front_wide", "front_tele"]
    frames = camera_frames(order, 2, seed=6)
    xyz, rot = history()
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images_of(frames, order)]
    completion = client.chat.completions.create(
        model="nvidia/alpamayo1.5", messages=[{"role": "user", "content": parts}], max_tokens=MAX_TOKENS, top_p=1.0,
        seed=9, extra_body={"top_k": 1, "nvext": {"egomotion": egomotion(xyz, rot), "camera_order": order,
                                                   "num_frames_per_camera": 2, "num_traj_samples": 1}})
    expected = pipeline.plan(expected_input(frames), settings(seed=9, greedy=True))
    assert_plan([json.loads(choice.message.content) for choice in completion.choices], expected)
    inputs = expected_input(frames)
    prompt = len(pipeline.driving_prompt(inputs, pipeline.preprocess(inputs)).input_ids)
    assert completion.usage.prompt_tokens == prompt
    assert completion.usage.completion_tokens == len(expected.generated_ids[0])
    assert completion.usage.total_tokens == prompt + len(expected.generated_ids[0])


def test_vqa_route_and_operational_routes(http: httpx.Client, pipeline: Pipeline) -> None:
    frames = camera_frames(["front_wide"], 1, seed=8)
    question = "How many lanes are there?"
    response = http.post("/v1/vqa", json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images_of(frames, ["front_wide"])[0]}}]}],
        "nvext": {"question": question}, "max_tokens": MAX_TOKENS, "seed": 2})
    assert response.status_code == 200, response.text
    reply = pipeline.generate_text(expected_input(frames), question, settings(seed=2), max_new_tokens=MAX_TOKENS)[0]
    assert response.json()["choices"][0]["message"]["content"] == (reply.answer or reply.text)
    assert response.json()["usage"]["completion_tokens"] == len(reply.token_ids)
    assert http.get("/v1/health/live").status_code == 200
    assert http.get("/v1/health/ready").json()["status"] == "ready"
    assert http.get("/v1/version").json()["api"] == "1.0.0"
    metadata = http.get("/v1/metadata").json()
    assert metadata["backend"] == "hf" and metadata["selectedModelProfileId"].startswith("hf")
    assert "alpamayo_requests_total" in http.get("/v1/metrics").text
    assert http.get("/v1/models").json()["data"][0]["id"]


def _data_url(image: np.ndarray, image_format: str) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=image_format, **({"lossless": True} if image_format == "WEBP" else {}))
    return f"data:image/{image_format.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _decode(url: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as image:
        return np.asarray(image.convert("RGB"))


def _valid_body() -> dict:
    frames = camera_frames(["front_wide"], 4, seed=10)
    xyz, rot = history()
    return {"images": images_of(frames, ["front_wide"]), "camera_order": ["front_wide"], "num_frames_per_camera": 4,
            "egomotion": egomotion(xyz, rot), "max_tokens": MAX_TOKENS, "seed": 4}


def _scaled_rotations(factor: float) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        for row in body["egomotion"][:-1]:
            row[3:] = [factor * v for v in row[3:]]
    return mutate


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda body: body.__setitem__(key, value)


def _row(index: int, values: list[float]) -> Callable[[dict], None]:
    return lambda body: body["egomotion"].__setitem__(index, values)


# (name, change to a valid /v1/infer request, HTTP status, field the error must name)
MALFORMED = [
    ("15 images, no camera_order", lambda b: (b.pop("camera_order"), b.pop("num_frames_per_camera"),
                                              b.__setitem__("images", b["images"][:3] * 5)), 422, "images"),
    ("unknown camera", _set("camera_order", ["roof_cam"]), 422, "camera_order[0]"),
    ("camera named twice", lambda b: b.update(camera_order=["front_wide", "front_wide"], num_frames_per_camera=2), 422, "camera_order[1]"),
    ("images do not fill the layout", _set("num_frames_per_camera", 3), 422, "images"),
    ("five frames per camera", _set("num_frames_per_camera", 5), 422, "num_frames_per_camera"),
    ("15 egomotion rows", lambda b: b["egomotion"].pop(0), 422, "egomotion"),
    ("egomotion row of 5", _row(3, [0.0] * 5), 422, "egomotion[3]"),
    ("rotations 2*I", _scaled_rotations(2.0), 422, "egomotion"),
    ("rotations all zero", _scaled_rotations(0.0), 422, "egomotion"),
    ("quaternion not unit", _row(2, [-1.3, 0, 0, 0, 0, 0.5, 0.5]), 422, "egomotion[2]"),
    ("newest pose off the origin", _row(15, [2.0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]), 422, "egomotion[15]"),
    ("trajectory without egomotion", lambda b: b.pop("egomotion"), 422, "egomotion"),
    ("answer without question", _set("mode", "answer"), 422, "question"),
    ("unknown mode", _set("mode", "video"), 422, "mode"),
    ("bad base64", lambda b: b["images"].__setitem__(0, "@@@not base64@@@"), 422, "images[0]"),
    ("gif image", lambda b: b["images"].__setitem__(0, png_data_url(np.zeros((HEIGHT, WIDTH, 3), np.uint8), "GIF")), 422, "images[0]"),
    ("mixed image sizes", lambda b: b["images"].__setitem__(1, png_data_url(np.zeros((32, 48, 3), np.uint8))), 422, "images"),
    ("top_k 5", _set("top_k", 5), 422, "top_k"),
    ("temperature 3", _set("temperature", 3.0), 422, "temperature"),
    ("zero samples", _set("num_traj_samples", 0), 422, "num_traj_samples"),
    ("too many samples", _set("num_traj_samples", 1000), 422, "num_traj_samples"),
    ("nav_text with model tokens", _set("nav_text", "turn <|im_end|> left"), 422, "nav_text"),
    ("unknown field", _set("frobnicate", 1), 422, "frobnicate"),
    ("unknown model", _set("model", "gpt-4"), 404, "model"),
]


def test_malformed_requests_get_the_documented_status_naming_the_field(http: httpx.Client) -> None:
    before = http.post("/v1/infer", json=_valid_body())
    assert before.status_code == 200, before.text
    cache_before = http.get("/v1/metadata").json()["frame_cache"]
    failures = []
    requests = [("/v1/infer", name, mutate, status, field) for name, mutate, status, field in MALFORMED]
    chat_body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}}
                                                          for u in _valid_body()["images"]]}],
                 "nvext": {"egomotion": _valid_body()["egomotion"], "camera_order": ["back_cam"]}}
    for path, name, mutate, status, field in requests:
        body = _valid_body()
        mutate(body)
        response = http.post(path, json=body)
        error = response.json().get("error", {})
        if response.status_code != status or error.get("param") != field or field not in error.get("message", ""):
            failures.append(f"{name}: {response.status_code} {response.text[:300]}")
    for path, body, field in (("/v1/chat/completions", chat_body, "nvext.camera_order[0]"),
                              ("/v1/vqa", {**chat_body, "question": "why?"}, "question")):
        response = http.post(path, json=body)
        if response.status_code != 422 or response.json()["error"]["param"] != field:
            failures.append(f"{path}: {response.status_code} {response.text[:300]}")
    assert not failures, "\n".join(failures)
    assert http.get("/v1/metadata").json()["frame_cache"] == cache_before  # nothing reached the pipeline
    after = http.post("/v1/infer", json=_valid_body())
    assert after.json()["trajectories"] == before.json()["trajectories"]
