"""The OpenAI-compatible front door: chat.completions requests in, DrivingInput + settings out,
Plans and VQA replies back as chat.completion objects.

Images are `image_url` content parts (base64 data URLs, JPEG or PNG); what the chat API has no
field for travels as extra body fields (the openai client's `extra_body`): `image_meta` gives
each image's camera index and capture time, in the order of the image parts; `ego_history`,
`route`, the sampling settings the chat API lacks, and `output_modality: "trajectory"`.
A NIM client's request instead puts its Alpamayo fields under `nvext` and sends no `image_meta`
(serve/nim.py groups its images); both kinds get OpenAI's `usage` block back.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import uuid
from typing import Annotated, Literal

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from ..core.pipeline import Pipeline, TextReply
from ..core.preprocess import smart_resize
from ..core.prompt import render_driving_prompt, render_vqa_prompt
from ..core.types import CAMERAS, NUM_HISTORY_POSES, WAYPOINT_DT_S, DrivingInput, Plan, SamplingSettings
from .nim_schema import NvExt, Usage
from .requests import Limits, RequestError, checked_settings, driving_input

IMAGE_FORMATS = frozenset({"JPEG", "PNG"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str = Field(description="data:image/png;base64,... or data:image/jpeg;base64,...")
    detail: str | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class ImageMeta(_Strict):
    camera_index: int = Field(description="upstream camera index (0..6), see core.types.CAMERAS")
    stamp_ns: int = Field(description="capture time of the image, ns")


class EgoHistory(_Strict):
    xyz: list[list[float]] = Field(description="16 poses (t0-1.5 s ... t0) in the t0 ego frame, m")
    rot: list[list[list[float]]] = Field(description="16 rotation matrices in the t0 ego frame")


class ChatCompletionRequest(_Strict):
    """chat.completions with Alpamayo's extra fields; unknown fields are refused by name."""

    model: str | None = Field(default=None, description="the served model id (or NIM's nvidia/alpamayo1.5); "
                                                        "omitted: the served model")
    messages: list[Message] = Field(min_length=1)
    output_modality: Literal["trajectory", "text"] = "text"
    image_meta: list[ImageMeta] = Field(default_factory=list, description="one per image part, in order")
    ego_history: EgoHistory | None = None
    route: str | None = None
    t0_ns: int | None = Field(default=None, description="default: the newest image stamp")
    n: int = SamplingSettings.num_samples
    temperature: float = SamplingSettings.temperature
    top_p: float = SamplingSettings.top_p
    seed: int | None = SamplingSettings.seed
    top_k: int | None = Field(default=None, ge=1, description="1 = greedy; larger values are not supported")
    nvext: NvExt | None = Field(default=None, description="NIM's Alpamayo fields (see README, Serving)")
    max_reasoning_tokens: int = SamplingSettings.max_reasoning_tokens
    flow_steps: int = SamplingSettings.flow_steps
    cfg_weight: float | None = SamplingSettings.cfg_weight
    max_tokens: int | None = Field(default=None, description="VQA answer length (text modality)")
    max_completion_tokens: int | None = Field(default=None, description="same as max_tokens")
    stream: Literal[False] = False


class Trajectory(BaseModel):
    pred_xyz: list[list[list[float]]] = Field(description="(samples, 64, 3), t0 ego frame, m")
    pred_rot: list[list[list[list[float]]]] = Field(description="(samples, 64, 3, 3)")
    dt: float = Field(description="seconds between waypoints; waypoint k is at t0 + (k+1) dt")
    t0_ns: int
    reasoning: list[str]
    generated_tokens: list[int] = Field(description="reasoning tokens generated per sample")
    timings_ms: dict[str, float]
    drafted_tokens: int = Field(0, description="speculative reasoning, all samples: draft tokens verified")
    accepted_tokens: int = Field(0, description="speculative reasoning: draft tokens accepted")


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    trajectory: Trajectory | None = None


def usage(prompt_tokens: int, generated: list[list[int]]) -> Usage:
    completion = sum(len(row) for row in generated)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


def prompt_tokens(pipeline: Pipeline, inputs: DrivingInput, question: str | None = None) -> int:
    """Length of the prompt pipeline.plan (question None) or generate_text renders for inputs,
    counted from the frame geometry without preprocessing the frames again."""
    geometry = pipeline.frames.geometry
    height, width = smart_resize(*inputs.images.shape[2:4], geometry)
    per_image = (height // geometry.factor) * (width // geometry.factor)
    layout = {"camera_indices": inputs.camera_indices, "frames_per_camera": inputs.images.shape[1],
              "tokens_per_image": [per_image] * (inputs.images.shape[0] * inputs.images.shape[1])}
    if question is None:
        return len(render_driving_prompt(pipeline.tokenizer, history_ids=pipeline.history_ids(inputs),
                                         route_text=inputs.route_text, **layout))
    return len(render_vqa_prompt(pipeline.tokenizer, question=question, **layout))


def sampling_settings(request: ChatCompletionRequest, limits: Limits) -> SamplingSettings:
    if request.top_k not in (None, 1):
        raise RequestError("top_k", f"only 1 (greedy) or null is supported, got {request.top_k}")
    settings = SamplingSettings(
        num_samples=request.n,
        temperature=0.0 if request.top_k == 1 else request.temperature,
        top_p=request.top_p,
        max_reasoning_tokens=request.max_reasoning_tokens,
        flow_steps=request.flow_steps,
        cfg_weight=request.cfg_weight,
        seed=SamplingSettings.seed if request.seed is None else request.seed,
    )
    names = {"num_samples": "n"}
    try:
        return checked_settings(settings, limits, prefix="")
    except RequestError as error:
        raise RequestError(names.get(error.field, error.field), error.message) from error


def answer_length(request: ChatCompletionRequest, limits: Limits) -> int:
    length = request.max_completion_tokens or request.max_tokens or 256
    if not 1 <= length <= limits.max_reasoning_tokens:
        raise RequestError("max_tokens", f"expected an integer in [1, {limits.max_reasoning_tokens}], got {length}")
    return length


def question(request: ChatCompletionRequest) -> str:
    """The user's text parts, joined (or NIM's nvext.question): the VQA question."""
    if request.nvext is not None and request.nvext.question:
        return request.nvext.question
    texts = [
        part if isinstance(part, str) else part.text
        for message in request.messages
        if message.role == "user"
        for part in ([message.content] if isinstance(message.content, str) else message.content)
        if isinstance(part, str) or isinstance(part, TextPart)
    ]
    text = "\n".join(t for t in texts if t.strip())
    if not text:
        raise RequestError("messages", "no user text: the text modality needs a question")
    return text


def image_parts(request: ChatCompletionRequest) -> list[ImagePart]:
    """The image_url parts of every message, in order."""
    return [
        part
        for message in request.messages
        if not isinstance(message.content, str)
        for part in message.content
        if isinstance(part, ImagePart)
    ]


def chat_driving_input(request: ChatCompletionRequest, limits: Limits, require_history: bool) -> DrivingInput:
    """Decode the image parts and group them by camera (oldest first) into a DrivingInput."""
    parts = image_parts(request)
    if not parts:
        raise RequestError("messages", "no image_url content part: at least one camera image is required")
    if len(parts) > limits.max_images:
        raise RequestError("messages", f"{len(parts)} images (limit {limits.max_images})")
    if len(request.image_meta) != len(parts):
        raise RequestError("image_meta", f"{len(request.image_meta)} entries for {len(parts)} image parts (one per image, in order)")
    unknown = sorted({meta.camera_index for meta in request.image_meta} - set(CAMERAS))
    if unknown:
        raise RequestError("image_meta.camera_index", f"unknown camera index {unknown} (known: {sorted(CAMERAS)})")
    images = [decode_image(part.image_url.url, f"messages.image_url[{i}]", limits) for i, part in enumerate(parts)]
    sizes = {image.shape for image in images}
    if len(sizes) > 1:
        raise RequestError("messages", f"all images must have one size, got {sorted(s[:2] for s in sizes)}")
    by_camera: dict[int, list[tuple[int, np.ndarray]]] = {}
    for meta, image in zip(request.image_meta, images):
        by_camera.setdefault(meta.camera_index, []).append((meta.stamp_ns, image))
    counts = {camera: len(frames) for camera, frames in by_camera.items()}
    if len(set(counts.values())) > 1:
        raise RequestError("image_meta", f"every camera needs the same number of frames, got {counts}")
    cameras = sorted(by_camera)
    rows = [sorted(by_camera[camera], key=lambda frame: frame[0]) for camera in cameras]
    for camera, row in zip(cameras, rows):
        stamps = [stamp for stamp, _ in row]
        if len(set(stamps)) != len(stamps):
            raise RequestError("image_meta", f"camera {camera}: two images with the same stamp_ns")
    stamps = np.array([[stamp for stamp, _ in row] for row in rows], dtype=np.int64)
    xyz, rot = _history(request.ego_history, require_history)
    return driving_input(
        images=np.stack([np.stack([image for _, image in row]) for row in rows]),
        camera_indices=tuple(cameras),
        frame_stamps_ns=stamps,
        t0_ns=request.t0_ns if request.t0_ns is not None else int(stamps.max()),
        ego_history_xyz=xyz,
        ego_history_rot=rot,
        route_text=request.route,
        limits=limits,
        fields={
            "camera_indices": "image_meta.camera_index",
            "ego_history_xyz": "ego_history.xyz",
            "ego_history_rot": "ego_history.rot",
            "ego_history": "ego_history",
            "route_text": "route",
            "frame_stamps_ns": "image_meta.stamp_ns",
        },
    )


def decode_image(url: str, field: str, limits: Limits, formats: frozenset[str] = IMAGE_FORMATS,
                 bare_base64: bool = False) -> np.ndarray:
    """A base64 data URL of one of formats (bare base64 too, with bare_base64) as uint8 RGB
    (H, W, 3); the size is checked before decoding."""
    header, sep, payload = url.partition(",")
    if bare_base64 and not url.startswith("data:"):
        header, sep, payload = "data:image/*;base64", ",", url
    if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise RequestError(field, "expected a data URL: data:image/png;base64,... or data:image/jpeg;base64,...")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise RequestError(field, f"bad base64 ({error})") from error
    try:
        with Image.open(io.BytesIO(raw)) as image:
            if image.format not in formats:
                raise RequestError(field, f"expected {' or '.join(sorted(formats))}, got {image.format}")
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise RequestError(field, f"{width}x{height} pixels (limit {limits.max_image_pixels})")
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except RequestError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise RequestError(field, f"not a decodable {'/'.join(sorted(formats))} image ({error})") from error


def trajectory_completion(plan: Plan, model: str, prompt_length: int, content: list[str] | None = None) -> ChatCompletion:
    """content: the message of each choice (default: its reasoning text)."""
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        choices=[
            Choice(index=i, message=ResponseMessage(content=text), finish_reason="stop")
            for i, text in enumerate(plan.coc if content is None else content)
        ],
        usage=usage(prompt_length, plan.generated_ids),
        trajectory=Trajectory(
            pred_xyz=plan.xyz.tolist(),
            pred_rot=plan.rot.tolist(),
            dt=WAYPOINT_DT_S,
            t0_ns=plan.t0_ns,
            reasoning=list(plan.coc),
            generated_tokens=[len(row) for row in plan.generated_ids],
            timings_ms=plan.timings_ms,
            drafted_tokens=plan.drafted_tokens,
            accepted_tokens=plan.accepted_tokens,
        ),
    )


def text_completion(replies: list[TextReply], max_new_tokens: int, model: str, prompt_length: int) -> ChatCompletion:
    """One choice per sample: the answer between the answer tokens, or all generated text when
    the model never closed an answer; "length" when the reply used every allowed token."""
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        choices=[
            Choice(
                index=i,
                message=ResponseMessage(content=vqa_content(reply)),
                finish_reason="length" if len(reply.token_ids) >= max_new_tokens else "stop",
            )
            for i, reply in enumerate(replies)
        ],
        usage=usage(prompt_length, [reply.token_ids for reply in replies]),
    )


def vqa_content(reply: TextReply) -> str:
    return reply.answer or reply.text


def _history(history: EgoHistory | None, required: bool) -> tuple[np.ndarray, np.ndarray]:
    """The ego history as float32 arrays; the text modality may omit it (the VQA prompt does not show it)."""
    if history is None:
        if required:
            raise RequestError("ego_history", "required for output_modality 'trajectory' ({xyz: 16x3, rot: 16x3x3})")
        xyz = np.zeros((NUM_HISTORY_POSES, 3), dtype=np.float32)
        return xyz, np.tile(np.eye(3, dtype=np.float32), (NUM_HISTORY_POSES, 1, 1))
    try:
        xyz = np.asarray(history.xyz, dtype=np.float32)
    except ValueError as error:
        raise RequestError("ego_history.xyz", f"expected a ({NUM_HISTORY_POSES}, 3) array ({error})") from error
    try:
        rot = np.asarray(history.rot, dtype=np.float32)
    except ValueError as error:
        raise RequestError("ego_history.rot", f"expected a ({NUM_HISTORY_POSES}, 3, 3) array ({error})") from error
    for field, array in (("ego_history.xyz", xyz), ("ego_history.rot", rot)):
        if not np.isfinite(array).all():
            raise RequestError(field, "non-finite values (NaN or inf)")
    return xyz, rot
