"""The NIM-compatible door: NVIDIA's Alpamayo1.5 NIM 1.0.0 routes on the same pipeline, so a
client written for the NIM works unchanged (POST /v1/infer, /v1/vqa, chat completions with
nvext, the health, metadata, version and metrics routes).

NIM requests carry no capture times: frames are 0.1 s apart, each camera's newest at t0
(preparing-inputs), so t0 is taken as 0 and stamps are -0.3 ... 0 s. Every input error is a
422 naming the field, as the NIM's request-model validation answers.
"""

from __future__ import annotations

import dataclasses
import uuid
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, Awaitable, Callable

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ..core.types import (
    FRAME_SPACING_S, NUM_HISTORY_POSES, ROTATION_TOLERANCE, WAYPOINT_DT_S, DrivingInput, Plan, SamplingSettings,
)
from . import chat
from .nim_schema import (
    CAMERA_NAMES, DEFAULT_CAMERA_ORDER, DEFAULT_FRAMES, NIM_API_VERSION, NIM_MODEL_ID, Comfort, InferRequest,
    InferResponse, NvExt, SamplingFields, TrajectoryResult,
)
from .requests import Limits, RequestError, checked_settings, driving_input

IMAGE_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "BMP"})
#: The newest ego pose must be the origin of the t0 ego frame; farther off is a frame mix-up.
FINAL_POSE_TOLERANCE_M = 1e-2
#: Images of an answer-only request without camera_order, when not the default 16: frames of
#: the front camera, in the order given.
ANSWER_CAMERA = "front_wide"


def invalid(field: str, message: str) -> RequestError:
    return RequestError(field, message, status=422)


def as_422(error: RequestError) -> RequestError:
    """The shared checks answer 400; the NIM answers input errors with 422."""
    return invalid(error.field, error.message) if error.status == 400 else error


def served_model(model: str | None, served: str) -> None:
    if model not in (None, "", served, NIM_MODEL_ID):
        raise RequestError("model", f"model {model!r} is not served (serving {served!r} = {NIM_MODEL_ID!r})",
                           status=404, reason="model_not_found")


def camera_layout(count: int, camera_order: list[str] | None, frames: int | None, *, trajectory: bool,
                  fields: dict[str, str]) -> tuple[list[str], list[int], int]:
    """(camera names, their indices, frames per camera) of count camera-major images."""
    if camera_order is None:
        if count == len(DEFAULT_CAMERA_ORDER) * DEFAULT_FRAMES and frames in (None, DEFAULT_FRAMES):
            camera_order, frames = list(DEFAULT_CAMERA_ORDER), DEFAULT_FRAMES
        elif not trajectory and count <= DEFAULT_FRAMES and frames in (None, count):
            camera_order, frames = [ANSWER_CAMERA], count
        else:
            raise invalid(fields["images"], f"{count} images cannot be grouped without camera_order: send "
                          f"{len(DEFAULT_CAMERA_ORDER) * DEFAULT_FRAMES} (4 cameras x 4 frames) or name the "
                          "cameras in camera_order and num_frames_per_camera")
    if not camera_order:
        raise invalid(fields["camera_order"], "empty")
    indices = []
    for position, name in enumerate(camera_order):
        if name not in CAMERA_NAMES:
            raise invalid(f"{fields['camera_order']}[{position}]", f"unknown camera {name!r} "
                          f"(known: {sorted(name for name in CAMERA_NAMES if not name.startswith('camera_'))})")
        if CAMERA_NAMES[name] in indices:
            raise invalid(f"{fields['camera_order']}[{position}]", f"camera {name!r} named twice")
        indices.append(CAMERA_NAMES[name])
    frames = DEFAULT_FRAMES if frames is None else frames
    if count != len(camera_order) * frames:
        raise invalid(fields["images"], f"{count} images for {len(camera_order)} cameras x {frames} frames "
                      f"({fields['num_frames_per_camera']})")
    return list(camera_order), indices, frames


def egomotion_history(rows: list[list[float]] | None, field: str) -> tuple[np.ndarray, np.ndarray]:
    """(xyz (16, 3), rot (16, 3, 3)) from 16 rows of [x, y, z, r00..r22] or [x, y, z, qx, qy, qz, qw];
    a quaternion must be unit (within the rotation tolerance) and the newest pose the origin."""
    if rows is None:
        raise invalid(field, f"required for trajectories: {NUM_HISTORY_POSES} rows, oldest first")
    if len(rows) != NUM_HISTORY_POSES:
        raise invalid(field, f"expected {NUM_HISTORY_POSES} rows (t0-1.5 s ... t0), got {len(rows)}")
    xyz = np.zeros((NUM_HISTORY_POSES, 3))
    rot = np.zeros((NUM_HISTORY_POSES, 3, 3))
    for i, row in enumerate(rows):
        values = np.asarray(row, dtype=np.float64)
        if not np.isfinite(values).all():
            raise invalid(f"{field}[{i}]", "non-finite values (NaN or inf)")
        if len(values) == 12:
            rot[i] = values[3:].reshape(3, 3)
        elif len(values) == 7:
            rot[i] = _quaternion_matrix(values[3:], f"{field}[{i}]")
        else:
            raise invalid(f"{field}[{i}]", f"expected 12 values [x, y, z, r00..r22] or 7 [x, y, z, qx, qy, qz, qw], "
                          f"got {len(values)}")
        xyz[i] = values[:3]
    final_offset = float(np.abs(xyz[-1]).max())
    final_turn = float(np.abs(rot[-1] - np.eye(3)).max())
    if final_offset > FINAL_POSE_TOLERANCE_M or final_turn > ROTATION_TOLERANCE:
        raise invalid(f"{field}[{NUM_HISTORY_POSES - 1}]", f"the newest pose must be the origin of the t0 ego frame "
                      f"(position off by {final_offset:.3g} m, rotation off identity by {final_turn:.3g})")
    return xyz.astype(np.float32), rot.astype(np.float32)


def _quaternion_matrix(q: np.ndarray, field: str) -> np.ndarray:
    norm = float(np.linalg.norm(q))
    if abs(norm - 1.0) > ROTATION_TOLERANCE:
        raise invalid(field, f"quaternion [qx, qy, qz, qw] is not unit (norm {norm:.6g})")
    x, y, z, w = q / norm
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ])


def nim_input(images: list[np.ndarray], camera_order: list[str] | None, frames: int | None, *, trajectory: bool,
              egomotion: list[list[float]] | None, nav_text: str | None, limits: Limits,
              fields: dict[str, str]) -> tuple[DrivingInput, list[str], int]:
    """Group decoded camera-major images into a DrivingInput (cameras ascending by index)."""
    if len(images) > limits.max_images:
        raise invalid(fields["images"], f"{len(images)} images (limit {limits.max_images})")
    names, indices, frames = camera_layout(len(images), camera_order, frames, trajectory=trajectory, fields=fields)
    if len({image.shape for image in images}) > 1:
        raise invalid(fields["images"], f"all images must have one size, got {sorted({i.shape[:2] for i in images})}")
    if trajectory:
        xyz, rot = egomotion_history(egomotion, fields["egomotion"])
    else:
        xyz = np.zeros((NUM_HISTORY_POSES, 3), dtype=np.float32)
        rot = np.tile(np.eye(3, dtype=np.float32), (NUM_HISTORY_POSES, 1, 1))
    rows = sorted(range(len(indices)), key=lambda row: indices[row])
    grid = [images[row * frames:(row + 1) * frames] for row in rows]
    spacing_ns = int(FRAME_SPACING_S * 1e9)
    stamps = -spacing_ns * np.arange(frames - 1, -1, -1, dtype=np.int64)
    try:
        inputs = driving_input(
            images=np.stack([np.stack(row) for row in grid]), camera_indices=tuple(sorted(indices)),
            frame_stamps_ns=np.tile(stamps, (len(indices), 1)), t0_ns=0, ego_history_xyz=xyz, ego_history_rot=rot,
            route_text=nav_text, limits=limits,
            fields={"ego_history_xyz": fields["egomotion"], "ego_history_rot": fields["egomotion"],
                    "ego_history": fields["egomotion"], "route_text": fields["nav_text"], "images": fields["images"]})
    except RequestError as error:
        raise as_422(error) from error
    return inputs, names, frames


def settings_of(request: SamplingFields, samples: int, limits: Limits, *, seed: int | None, top_k: int | None) -> SamplingSettings:
    """SamplingSettings of a NIM request's rollout controls (top_k 1 = greedy)."""
    if top_k not in (None, 1):
        raise invalid("top_k", f"only 1 (greedy) or null is supported, got {top_k}")
    settings = SamplingSettings(
        num_samples=samples, temperature=0.0 if top_k == 1 else request.temperature, top_p=request.top_p,
        max_reasoning_tokens=request.max_tokens, seed=SamplingSettings.seed if seed is None else seed)
    names = {"num_samples": "num_traj_samples", "max_reasoning_tokens": "max_tokens"}
    try:
        return checked_settings(settings, limits, prefix="")
    except RequestError as error:
        raise invalid(names.get(error.field, error.field), error.message) from error


def comfort(xyz: np.ndarray, yaw: np.ndarray) -> Comfort:
    """Comfort figures of one trajectory (64, 3) starting from the origin at t0."""
    points = np.concatenate([np.zeros((1, 3)), xyz.astype(np.float64)])
    speed = np.linalg.norm(np.diff(points, axis=0), axis=1) / WAYPOINT_DT_S
    accel = np.diff(speed) / WAYPOINT_DT_S
    yaw_rate = np.diff(np.unwrap(np.concatenate([[0.0], yaw.astype(np.float64)]))) / WAYPOINT_DT_S
    return Comfort(max_abs_longitudinal_accel_mps2=float(np.abs(accel).max()),
                   max_abs_lateral_accel_mps2=float(np.abs(speed * yaw_rate).max()),
                   max_abs_jerk_mps3=float(np.abs(np.diff(accel) / WAYPOINT_DT_S).max()),
                   max_speed_mps=float(speed.max()))


def trajectories(plan: Plan) -> list[TrajectoryResult]:
    yaw = plan.yaw
    closed = plan.reasoning_closed or [True] * len(plan.coc)
    return [TrajectoryResult(xyz=plan.xyz[i].tolist(), rotations=plan.rot[i].tolist(), reasoning=plan.coc[i],
                             reasoning_closed=closed[i], comfort=comfort(plan.xyz[i], yaw[i]))
            for i in range(len(plan.coc))]


def decoded(urls: list[str], field: str, limits: Limits) -> list[np.ndarray]:
    try:
        return [chat.decode_image(url, f"{field}[{i}]", limits, IMAGE_FORMATS, bare_base64=True)
                for i, url in enumerate(urls)]
    except RequestError as error:
        raise as_422(error) from error


INFER_FIELDS = {name: name for name in ("images", "camera_order", "num_frames_per_camera", "egomotion", "nav_text")}
NVEXT_FIELDS = {"images": "messages", **{name: f"nvext.{name}" for name in
                                         ("camera_order", "num_frames_per_camera", "egomotion", "nav_text")}}


async def chat_nim(body: chat.ChatCompletionRequest, trajectory: bool, *,
                   run: Callable[[Callable[[Any], Any]], Awaitable[Any]], limits: Limits,
                   count_plan: Callable[[Any], None]) -> chat.ChatCompletion:
    """A chat request in the NIM's envelope: images in order, Alpamayo fields under nvext;
    count_plan adds a plan to the server's metrics."""
    nvext = body.nvext or NvExt()

    def parse() -> tuple:
        try:
            question = None if trajectory else chat.question(body)
            length = chat.answer_length(body, limits)
        except RequestError as error:
            raise as_422(error) from error
        seed = nvext.seed if nvext.seed is not None else body.seed
        samples = (nvext.num_traj_samples or 1) if trajectory else body.n
        controls = SamplingFields.model_construct(temperature=body.temperature, top_p=body.top_p, max_tokens=length)
        settings = settings_of(controls, samples, limits, seed=seed, top_k=nvext.top_k or body.top_k)
        images = decoded([part.image_url.url for part in chat.image_parts(body)], "messages", limits)
        if not images:
            raise invalid("messages", "no image_url content part: at least one camera image is required")
        inputs, _, _ = nim_input(images, nvext.camera_order, nvext.num_frames_per_camera, trajectory=trajectory,
                                 egomotion=nvext.egomotion, nav_text=nvext.nav_text, limits=limits,
                                 fields=NVEXT_FIELDS)
        return inputs, settings, question, length

    inputs, settings, question, length = await run_in_threadpool(parse)
    if trajectory:
        def plan_job(pipeline: Any) -> chat.ChatCompletion:
            plan = pipeline.plan(inputs, settings)
            count_plan(plan)
            content = [result.model_dump_json() for result in trajectories(plan)]
            return chat.trajectory_completion(plan, NIM_MODEL_ID, chat.prompt_tokens(pipeline, inputs), content)
        return await run(plan_job)

    def text_job(pipeline: Any) -> chat.ChatCompletion:
        replies = pipeline.generate_text(inputs, question, settings, max_new_tokens=length)
        return chat.text_completion(replies, length, NIM_MODEL_ID, chat.prompt_tokens(pipeline, inputs, question))
    return await run(text_job)


def register(app: FastAPI, *, run: Callable[[Callable[[Any], Any]], Awaitable[Any]], ready: Callable[[], bool],
             metrics_text: Callable[[], Response], count_plan: Callable[[Any], None], guarded: list[Any],
             model_name: str, limits: Limits, describe: Callable[[], dict]) -> None:
    """Add the NIM routes to app. run queues a job for the pipeline; count_plan adds a plan to
    the server's metrics; describe gives the backend facts /v1/metadata reports."""

    @app.post("/v1/infer", dependencies=guarded, response_model=InferResponse, response_model_exclude_none=True,
              summary="NIM native inference: mode trajectory | answer | both")
    async def infer(body: InferRequest) -> InferResponse:
        served_model(body.model, model_name)
        trajectory = body.mode in ("trajectory", "both")
        answering = body.mode in ("answer", "both")

        def parse() -> tuple:
            if answering and not (body.question and body.question.strip()):
                raise invalid("question", f"required for mode {body.mode!r}")
            settings = settings_of(body, body.num_traj_samples if trajectory else 1, limits, seed=body.seed,
                                   top_k=body.top_k)
            images = decoded(body.images, "images", limits)
            inputs, names, frames = nim_input(images, body.camera_order, body.num_frames_per_camera,
                                              trajectory=trajectory, egomotion=body.egomotion, nav_text=body.nav_text,
                                              limits=limits, fields=INFER_FIELDS)
            return inputs, names, frames, settings

        inputs, names, frames, settings = await run_in_threadpool(parse)

        def job(pipeline: Any) -> InferResponse:
            result: dict[str, Any] = {"trajectories": None, "answer": None, "drafted_tokens": 0, "accepted_tokens": 0}
            prompt, generated, timings = 0, [], {}
            if trajectory:
                plan = pipeline.plan(inputs, settings)
                count_plan(plan)
                result["trajectories"] = trajectories(plan)
                result["drafted_tokens"], result["accepted_tokens"] = plan.drafted_tokens, plan.accepted_tokens
                prompt, generated, timings = chat.prompt_tokens(pipeline, inputs), plan.generated_ids, plan.timings_ms
            if answering:
                question = body.question.strip()
                one = dataclasses.replace(settings, num_samples=1)  # one answer, whatever K the plan had
                reply = pipeline.generate_text(inputs, question, one, max_new_tokens=body.max_tokens)[0]
                result["answer"] = chat.vqa_content(reply)
                prompt += chat.prompt_tokens(pipeline, inputs, question)
                generated = [*generated, reply.token_ids]
            return InferResponse(id=f"infer-{uuid.uuid4().hex}", model=NIM_MODEL_ID, mode=body.mode, camera_order=names,
                                 num_frames_per_camera=frames, dt_s=WAYPOINT_DT_S, usage=chat.usage(prompt, generated),
                                 timings_ms=timings, **result)

        return await run(job)

    @app.post("/v1/vqa", dependencies=guarded, response_model=chat.ChatCompletion, response_model_exclude_none=True,
              summary="NIM VQA: an OpenAI-style message with images and a question (text part or nvext.question)")
    async def vqa(body: chat.ChatCompletionRequest) -> chat.ChatCompletion:
        served_model(body.model, model_name)
        for field, asked in (("output_modality", body.output_modality == "trajectory"),
                             ("nvext.egomotion", body.nvext is not None and body.nvext.egomotion is not None)):
            if asked:
                raise invalid(field, "/v1/vqa answers questions; trajectories come from /v1/infer or /v1/chat/completions")
        return await chat_nim(body, trajectory=False, run=run, limits=limits, count_plan=count_plan)

    @app.get("/v1/health/live", summary="NIM liveness: 200 while the process serves")
    async def live() -> JSONResponse:
        return JSONResponse({"object": "health.response", "message": "live", "status": "live"})

    @app.get("/v1/health/ready", summary="NIM readiness: 200 once the pipeline is loaded and warmed up, else 503")
    async def health_ready() -> JSONResponse:
        if ready():
            return JSONResponse({"object": "health.response", "message": "ready", "status": "ready"})
        return JSONResponse({"object": "health.response", "message": "not ready", "status": "not_ready"},
                            status_code=503)

    @app.get("/v1/metrics", dependencies=guarded, summary="Prometheus text format (as /metrics)")
    async def nim_metrics() -> Response:
        return metrics_text()

    @app.get("/v1/version", dependencies=guarded)
    async def version() -> dict:
        try:
            release = package_version("alpamayo_ros")
        except PackageNotFoundError:
            release = "unknown"
        return {"release": release, "api": NIM_API_VERSION}

    @app.get("/v1/metadata", dependencies=guarded)
    async def metadata() -> dict:
        facts = describe()
        return {"version": NIM_API_VERSION, "modelInfo": [{"shortName": model_name, "modelUrl": NIM_MODEL_ID}],
                "selectedModelProfileId": facts.get("profile", "loading"), **facts}
