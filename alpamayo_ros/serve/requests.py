"""What every front door checks before a request may queue: settings within the server's limits,
a DrivingInput that the pipeline accepts, a route that may reach the prompt.

Everything is validated here, in the event loop, so a malformed request is refused whole (a 4xx
naming the field) and never reaches the pipeline thread half-applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core.types import CAMERAS, DrivingInput, SamplingSettings
from ..inputs.route import RouteRejected, check_route


class RequestError(ValueError):
    """A request the server refuses; field names the input at fault, status is the HTTP code,
    reason the error code a client can act on (and the rejection metric's label)."""

    def __init__(self, field: str, message: str, status: int = 400, reason: str = "invalid_request") -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """Upper bounds per request, so one request cannot hold the pipeline for unbounded time."""

    max_samples: int = 16
    max_reasoning_tokens: int = 1024
    max_flow_steps: int = 100
    max_images: int = 28  # 7 cameras x 4 frames
    max_image_pixels: int = 4096 * 4096
    max_route_chars: int = 512


def checked_settings(settings: SamplingSettings, limits: Limits, prefix: str = "settings.") -> SamplingSettings:
    """Return settings unchanged, or raise RequestError naming the first bad field."""
    bounded_ints = {
        "num_samples": (1, limits.max_samples),
        "max_reasoning_tokens": (1, limits.max_reasoning_tokens),
        "min_reasoning_tokens": (0, settings.max_reasoning_tokens),
        "flow_steps": (1, limits.max_flow_steps),
        "seed": (0, 2**63 - 1),
    }
    for name, (low, high) in bounded_ints.items():
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise RequestError(prefix + name, f"expected an integer in [{low}, {high}], got {value!r}")
    floats = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "noise_temperature": (0.0, 100.0)}
    for name, (low, high) in floats.items():
        value = getattr(settings, name)
        if not _finite_number(value) or not low <= value <= high:
            raise RequestError(prefix + name, f"expected a number in [{low}, {high}], got {value!r}")
    if settings.top_p == 0.0:
        raise RequestError(prefix + "top_p", "must be > 0")
    if settings.cfg_weight is not None and not _finite_number(settings.cfg_weight):
        raise RequestError(prefix + "cfg_weight", f"expected a finite number or null, got {settings.cfg_weight!r}")
    return settings


def checked_route(text: str | None, limits: Limits, field: str = "route") -> str | None:
    """The stripped route (None when empty), or RequestError with the route check's reason."""
    if text is None:
        return None
    try:
        return check_route(text, limits.max_route_chars)
    except RouteRejected as error:
        raise RequestError(field, f"{error.reason} ({error.detail})") from error


def driving_input(
    *,
    images: np.ndarray,
    camera_indices: tuple[int, ...],
    frame_stamps_ns: np.ndarray,
    t0_ns: int,
    ego_history_xyz: np.ndarray,
    ego_history_rot: np.ndarray,
    route_text: str | None,
    limits: Limits,
    fields: dict[str, str] | None = None,
) -> DrivingInput:
    """Build a DrivingInput; its own checks become RequestErrors naming the request's field.

    fields: DrivingInput field -> the name the caller's request uses for it.
    """
    names = {
        "images": "images",
        "camera_indices": "camera_indices",
        "frame_stamps_ns": "frame_stamps_ns",
        "ego_history_xyz": "ego_history_xyz",
        "ego_history_rot": "ego_history_rot",
        "ego_history": "ego_history_xyz",
        **(fields or {}),
    }
    if images.ndim == 5 and images.shape[0] * images.shape[1] > limits.max_images:
        raise RequestError(names["images"], f"{images.shape[0] * images.shape[1]} images (limit {limits.max_images})")
    if images.ndim == 5 and images.shape[0] * images.shape[1] == 0:
        raise RequestError(names["images"], "no images")
    if images.ndim == 5 and images.shape[2] * images.shape[3] > limits.max_image_pixels:
        raise RequestError(names["images"], f"{images.shape[3]}x{images.shape[2]} pixels per image (limit {limits.max_image_pixels})")
    checked_cameras(camera_indices, names["camera_indices"])
    route = checked_route(route_text, limits, names.get("route_text", "route_text"))
    try:
        return DrivingInput(
            images=images,
            camera_indices=tuple(camera_indices),
            frame_stamps_ns=frame_stamps_ns,
            t0_ns=int(t0_ns),
            ego_history_xyz=ego_history_xyz,
            ego_history_rot=ego_history_rot,
            route_text=route,
        )
    except ValueError as error:
        field = str(error).split(":", 1)[0]
        raise RequestError(names.get(field, field), str(error).split(":", 1)[-1].strip()) from error


def checked_cameras(camera_indices: tuple[int, ...] | list[int], field: str = "camera_indices") -> None:
    """Refuse camera indices the model does not know (RequestError naming field)."""
    unknown = [index for index in camera_indices if index not in CAMERAS]
    if unknown:
        raise RequestError(field, f"unknown camera index {unknown} (known: {sorted(CAMERAS)})")


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
