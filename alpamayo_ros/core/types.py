"""Plain data that crosses the boundary between the ROS layer and the model core.

Frames: "t0 ego frame" is x forward, y left, z up, origin at the ego pose at t0 (the
newest camera time the plan is made for). All arrays are numpy so the ROS layer, the
evaluator and the benchmark never need torch to build or read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from .frame_key import frame_key_prefix, is_frame_key

#: Upstream camera index -> (dataset camera name, display name used in the prompt).
CAMERAS: dict[int, tuple[str, str]] = {
    0: ("camera_cross_left_120fov", "Front left camera"),
    1: ("camera_front_wide_120fov", "Front camera"),
    2: ("camera_cross_right_120fov", "Front right camera"),
    3: ("camera_rear_left_70fov", "Rear left camera"),
    4: ("camera_rear_tele_30fov", "Rear camera"),
    5: ("camera_rear_right_70fov", "Rear right camera"),
    6: ("camera_front_tele_30fov", "Front telephoto camera"),
}

NUM_HISTORY_POSES = 16  # 1.5 s at 10 Hz, t0 included
HISTORY_DT_S = 0.1
NUM_WAYPOINTS = 64  # 6.4 s at 10 Hz
WAYPOINT_DT_S = 0.1
FRAMES_PER_CAMERA = 4
FRAME_SPACING_S = 0.1
#: The action expert's weights: full precision, or FP8 copies with the kernel chosen for the
#: device or named (core/fp8_linear.py).
EXPERT_QUANTIZATIONS = ("none", "fp8", "fp8_cutlass", "fp8_marlin", "fp8_scaled_mm", "fp8_dequant")
#: Speculative reasoning on the vLLM backbone (core/vllm_adapter/speculation.py).
SPECULATION_METHODS = ("none", "plans", "ngram")
#: Where the "plans" proposer looks drafts up: on the GPU inside vLLM's step ("device"), on the
#: host ("host"), or "auto" (device on CUDA, host elsewhere; core/vllm_adapter/engine.py).
SPECULATION_PROPOSERS = ("auto", "host", "device")
#: When the vLLM backbone's rows attend to their shared prompt in one pass
#: (core/vllm_adapter/cascade.py).
CASCADE_MODES = ("off", "auto", "on")
#: Largest |R^T R - I| entry and |det R - 1| an ego-history rotation may show. Rotations from
#: interpolated unit quaternions are orthonormal to float32 precision (~1e-6); 1e-3 leaves room
#: for rounded JSON or single-precision round trips and still refuses a scaled, sheared or
#: reflected matrix (2*I is off by 3, a 1-degree shear by ~1.7e-2).
ROTATION_TOLERANCE = 1e-3


@dataclass(frozen=True)
class DrivingInput:
    """One planning request: what the model sees at time t0.

    images: uint8 RGB, shape (cameras, frames, H, W, 3); cameras sorted by index,
        frames oldest first (t0-0.3 s ... t0).
    camera_indices: upstream camera index of each image row (see CAMERAS), ascending.
    frame_stamps_ns: int64 (cameras, frames), capture time of every frame.
    ego_history_xyz: float32 (16, 3), poses at t0-1.5 s ... t0 in the t0 ego frame (m);
        the last row is the origin.
    ego_history_rot: float32 (16, 3, 3), rotations in the t0 ego frame; last is identity. Each
        must be a rotation (ROTATION_TOLERANCE): a scaled or reflected matrix is refused here,
        so no producer (server, node, evaluator) can plan from one.
    route_text: navigation instruction ("Turn right in 30m") or None.
    frame_keys: frame_key of every frame, camera-major then oldest first, computed where the
        frames arrived (the drive loop) so a plan does not hash them again; None: the plan hashes
        them. Set only by with_frame_keys, and not a constructor argument: replace() gives an
        input without them, so changed images can never carry the old pixels' keys.
    """

    images: np.ndarray
    camera_indices: tuple[int, ...]
    frame_stamps_ns: np.ndarray
    t0_ns: int
    ego_history_xyz: np.ndarray
    ego_history_rot: np.ndarray
    route_text: str | None = None
    frame_keys: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.images.dtype != np.uint8 or self.images.ndim != 5 or self.images.shape[-1] != 3:
            raise ValueError(f"images: expected uint8 (cameras, frames, H, W, 3), got {self.images.dtype} {self.images.shape}")
        if len(self.camera_indices) != self.images.shape[0]:
            raise ValueError(f"camera_indices: {len(self.camera_indices)} indices for {self.images.shape[0]} cameras")
        if list(self.camera_indices) != sorted(set(self.camera_indices)):
            raise ValueError(f"camera_indices: must be unique and ascending, got {self.camera_indices}")
        unknown = [i for i in self.camera_indices if i not in CAMERAS]
        if unknown:
            raise ValueError(f"camera_indices: unknown camera index {unknown} (known: {sorted(CAMERAS)})")
        if self.frame_stamps_ns.shape != self.images.shape[:2]:
            raise ValueError(f"frame_stamps_ns: shape {self.frame_stamps_ns.shape} != {self.images.shape[:2]}")
        if self.ego_history_xyz.shape != (NUM_HISTORY_POSES, 3):
            raise ValueError(f"ego_history_xyz: expected ({NUM_HISTORY_POSES}, 3), got {self.ego_history_xyz.shape}")
        if self.ego_history_rot.shape != (NUM_HISTORY_POSES, 3, 3):
            raise ValueError(f"ego_history_rot: expected ({NUM_HISTORY_POSES}, 3, 3), got {self.ego_history_rot.shape}")
        if not (np.isfinite(self.ego_history_xyz).all() and np.isfinite(self.ego_history_rot).all()):
            raise ValueError("ego_history: non-finite values")
        bad = not_rotations(self.ego_history_rot)
        if bad:
            raise ValueError(f"ego_history_rot: not a rotation (orthonormal within {ROTATION_TOLERANCE}, "
                             f"determinant +1) at pose {bad[0][0]}: {bad[0][1]}")

    def with_frame_keys(self, keys: Sequence[str]) -> DrivingInput:
        """This input with its frames' keys (frame_key of each, camera-major then oldest first).
        images become read-only, so the pixels the keys name cannot change: images and every
        numpy array it is a view of (a view stays writable through its base). Memory that numpy
        does not own (a torch tensor's, a pinned host buffer) stays the caller's to leave as is."""
        cameras, frames, height, width = self.images.shape[:4]
        if len(keys) != cameras * frames:
            raise ValueError(f"frame_keys: {len(keys)} keys for {cameras * frames} frames")
        for slot, key in enumerate(keys):
            camera, stamp = self.camera_indices[slot // frames], int(self.frame_stamps_ns.flat[slot])
            if not is_frame_key(key, camera, stamp, height, width):
                raise ValueError(f"frame_keys[{slot}]: {key!r} is not a key of camera {camera}'s frame at {stamp} ns "
                                 f"({height}x{width}): expected {frame_key_prefix(camera, stamp, height, width)!r} "
                                 f"+ 32 hex digits")
        array = self.images
        while isinstance(array, np.ndarray):
            array.flags.writeable = False
            array = array.base
        keyed = replace(self)
        object.__setattr__(keyed, "frame_keys", tuple(keys))  # frozen, and deliberately no init argument
        return keyed


def not_rotations(matrices: np.ndarray, tolerance: float = ROTATION_TOLERANCE) -> list[tuple[int, str]]:
    """(index, what is wrong) of every 3x3 matrix in matrices (N, 3, 3) that is not a rotation:
    R^T R off the identity, or a determinant off +1 (a reflection), by more than tolerance."""
    rot = np.asarray(matrices, dtype=np.float64)
    gram_error = np.abs(np.einsum("nji,njk->nik", rot, rot) - np.eye(3)).max(axis=(1, 2))
    det = np.linalg.det(rot)
    bad = []
    for index in np.flatnonzero((gram_error > tolerance) | (np.abs(det - 1.0) > tolerance)):
        bad.append((int(index), f"|R^T R - I| = {gram_error[index]:.3g}, det = {det[index]:.3g}"))
    return bad


class PlanCancelled(RuntimeError):
    """A plan stopped between decode or flow steps because its stop event was set (shutdown)."""


@dataclass(frozen=True)
class SamplingSettings:
    """How one plan is sampled. Defaults follow upstream's rollout entry point."""

    num_samples: int = 1
    temperature: float = 0.6  # reasoning text; <= 0 means greedy
    top_p: float = 0.98
    max_reasoning_tokens: int = 256
    min_reasoning_tokens: int = 0  # benchmarks force an exact length: no stop before this many
    flow_steps: int = 10
    noise_temperature: float = 1.0  # scale of the initial flow-matching noise
    cfg_weight: float | None = None  # nav classifier-free guidance weight; None = off
    seed: int = 0


@dataclass
class Plan:
    """Output of one pipeline run.

    xyz: float32 (samples, 64, 3) waypoints at t0+0.1 ... t0+6.4 s in the t0 ego frame (m).
    rot: float32 (samples, 64, 3, 3) yaw rotations of those waypoints.
    coc: chain-of-causation text per sample; when generation stopped before <|cot_end|> (token
        budget), the text generated so far, and reasoning_closed says so.
    generated_ids: reasoning token ids per sample (up to and including <|traj_future_start|>).
    timings_ms: stage name -> milliseconds (preprocess, backbone, expert, action, total, ...).
    accel_mps2, curvature_per_m: float32 (samples, 64) the model's actions, de-normalised
        (what the output gate checks; None from producers that do not report them).
    within_bounds: bool (samples,) every action step inside the action space's own bounds.
    """

    xyz: np.ndarray
    rot: np.ndarray
    coc: list[str]
    generated_ids: list[list[int]]
    t0_ns: int
    backend: str
    timings_ms: dict[str, float] = field(default_factory=dict)
    accel_mps2: np.ndarray | None = None
    curvature_per_m: np.ndarray | None = None
    within_bounds: np.ndarray | None = None
    reasoning_closed: list[bool] = field(default_factory=list)  # per sample: False = coc cut at the token budget
    # speculative reasoning (vllm.speculation), summed over the samples: draft tokens the
    # model verified, and how many of them it accepted (0 and 0 with speculation off)
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def yaw(self) -> np.ndarray:
        """Heading of every waypoint, (samples, 64), radians."""
        return np.arctan2(self.rot[..., 1, 0], self.rot[..., 0, 0])
