"""Request and response shapes of NVIDIA's Alpamayo1.5 NIM 1.0.0 API, as its documentation gives
them (docs.nvidia.com/nim/alpamayo, 1.0.0: api-reference, sampling-params, preparing-inputs);
README's Serving section tables every field, its page, and where the docs leave a form open.

Camera names: the NIM takes the dataset's full camera names (camera_front_wide_120fov) or the
short names (front_wide); both map to the upstream camera index of core.types.CAMERAS.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..core.types import CAMERAS, FRAMES_PER_CAMERA

#: The model id NIM clients send; accepted besides the server's own --model-name.
NIM_MODEL_ID = "nvidia/alpamayo1.5"
#: The NIM API version these routes follow (GET /v1/version "api").
NIM_API_VERSION = "1.0.0"


def _short_name(full: str) -> str:
    return re.sub(r"_\d+fov$", "", full.removeprefix("camera_"))


#: camera name (full or short) -> upstream camera index.
CAMERA_NAMES: dict[str, int] = {
    **{name: index for index, (name, _) in CAMERAS.items()},
    **{_short_name(name): index for index, (name, _) in CAMERAS.items()},
}
#: The layout of a request without camera_order: 4 cameras x 4 frames, camera-major.
DEFAULT_CAMERA_ORDER = ("cross_left", "front_wide", "cross_right", "front_tele")
DEFAULT_FRAMES = FRAMES_PER_CAMERA

SEED_MAX = 2**31 - 1
MAX_TOKENS_MAX = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingFields(_Strict):
    """The VLM rollout controls every NIM request shares (sampling-params page)."""

    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS_MAX,
                            description="VLM generation budget: reasoning tokens (trajectory) or answer tokens")
    temperature: float = Field(default=0.6, ge=0.0, le=2.0)
    top_p: float = Field(default=0.98, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1, description="1 = greedy; null = off; larger values are refused")
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX, description="null: the server's default seed (0)")


class InferRequest(SamplingFields):
    """POST /v1/infer, the native schema: every field at the top level, no nvext."""

    images: list[str] = Field(min_length=1, description="base64 or data:image/...;base64 (JPEG, PNG, WebP, BMP), "
                                                        "camera-major, each camera's frames oldest first")
    mode: Literal["trajectory", "answer", "both"] = "trajectory"
    camera_order: list[str] | None = Field(default=None, description="camera names in the images' order")
    num_frames_per_camera: int | None = Field(default=None, ge=1, le=FRAMES_PER_CAMERA)
    egomotion: list[list[float]] | None = Field(
        default=None, description="16 rows, t0-1.5 s ... t0 in the t0 ego frame: [x, y, z, r00 ... r22] "
                                  "(rotation row-major) or [x, y, z, qx, qy, qz, qw]")
    num_traj_samples: int = Field(default=1, ge=1)
    nav_text: str | None = None
    question: str | None = None
    model: str | None = None


class NvExt(_Strict):
    """The Alpamayo fields of an OpenAI-style request (chat completions, vqa). seed and top_k
    here win over the top-level ones."""

    egomotion: list[list[float]] | None = None
    num_traj_samples: int | None = Field(default=None, ge=1)
    nav_text: str | None = None
    camera_order: list[str] | None = None
    num_frames_per_camera: int | None = Field(default=None, ge=1, le=FRAMES_PER_CAMERA)
    question: str | None = None
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    top_k: int | None = Field(default=None, ge=1)


class Comfort(BaseModel):
    """Kinematic comfort of one trajectory, from its waypoints (finite differences at dt_s)."""

    max_abs_longitudinal_accel_mps2: float
    max_abs_lateral_accel_mps2: float
    max_abs_jerk_mps3: float
    max_speed_mps: float


class TrajectoryResult(BaseModel):
    xyz: list[list[float]] = Field(description="64 waypoints t0+0.1 s ... t0+6.4 s, t0 ego frame, m")
    rotations: list[list[list[float]]] = Field(description="64 rotation matrices")
    reasoning: str
    reasoning_closed: bool = Field(description="false: the reasoning was cut at max_tokens")
    comfort: Comfort


class Usage(BaseModel):
    """OpenAI's token counts, in chat completions and /v1/infer alike."""

    prompt_tokens: int
    completion_tokens: int = Field(description="tokens generated over all choices (or samples and the answer)")
    total_tokens: int


class InferResponse(BaseModel):
    id: str
    model: str
    mode: str
    camera_order: list[str]
    num_frames_per_camera: int
    dt_s: float
    trajectories: list[TrajectoryResult] | None = None
    answer: str | None = None
    usage: Usage
    warnings: list[str] = Field(default_factory=list)
    timings_ms: dict[str, float] = Field(default_factory=dict)
    drafted_tokens: int = Field(0, description="speculative reasoning, all samples: draft tokens verified (0: off)")
    accepted_tokens: int = Field(0, description="speculative reasoning: draft tokens accepted")
