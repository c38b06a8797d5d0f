"""Qwen3-VL image preprocessing in plain torch: smart resize, normalise, patchify.

Numerically the same as transformers' torchvision-backed Qwen2-VL image processor (which
upstream uses through the Qwen3-VL processor), but it takes one uint8 batch of frames on any
device (no PIL, no per-image Python loop), so on a GPU the whole step is a few kernels.

It happens in two places: frames are resized here (the form that is cached and moved: uint8,
a quarter of the bytes of bf16 patches), and normalised and patchified where the vision tower
runs (PreprocessedImages.patches, frames_to_patches).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

MAX_ASPECT_RATIO = 200  # Qwen's limit for smart_resize


@dataclass(frozen=True)
class VisionGeometry:
    """How frames become vision patches; defaults are Alpamayo 1.5's processor settings."""

    patch_size: int = 16  # pixels per patch side
    temporal_patch_size: int = 2  # a still image is repeated to fill the temporal patch
    merge_size: int = 2  # patches merged per side into one LLM token
    min_pixels: int = 163840
    max_pixels: int = 196608
    image_mean: float = 0.5
    image_std: float = 0.5

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels: {self.min_pixels} > max_pixels {self.max_pixels}")
        if not self.image_std > 0:
            raise ValueError(f"image_std: must be > 0, got {self.image_std}")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this many pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch (channels x time x pixels)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass
class PreprocessedImages:
    """Frames resized for the vision tower, still uint8: the form that is cached and moved.

    Patches hold every pixel twice (the temporal patch of a still image) in a float dtype,
    4x the bytes in bf16 and 8x in float32, so patches() makes them on the vision tower's
    device, right before it runs.
    frames: uint8 (num_images, 3, h, w); h and w multiples of geometry.factor (smart_resize).
    geometry: how the frames become patches and tokens.
    keys: one name per image; equal keys mean equal pixels, so backends may cache per key
        (see core.frame_cache).
    """

    frames: torch.Tensor
    geometry: VisionGeometry
    keys: tuple[str, ...]

    def __post_init__(self) -> None:
        factor, shape = self.geometry.factor, tuple(self.frames.shape)
        aligned = len(shape) == 4 and shape[1] == 3 and shape[2] % factor == 0 and shape[3] % factor == 0
        if self.frames.dtype != torch.uint8 or not aligned:
            raise ValueError(
                f"frames: expected uint8 (N, 3, h, w) with sides multiples of {factor}, got {self.frames.dtype} {shape}"
            )

    @property
    def image_grid_thw(self) -> torch.Tensor:
        """int64 (num_images, 3) on the host: (1, grid_h, grid_w) in patches per image."""
        n, _, height, width = self.frames.shape
        p = self.geometry.patch_size
        return torch.tensor([[1, height // p, width // p]] * n, dtype=torch.long)

    @property
    def merge_size(self) -> int:
        """Patches merged per side into one LLM token."""
        return self.geometry.merge_size

    @property
    def tokens_per_image(self) -> list[int]:
        """LLM tokens (merged patches) of each image."""
        return (self.image_grid_thw.prod(dim=-1) // self.merge_size**2).tolist()

    def patches(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """Qwen3-VL patches (num_images * grid_h * grid_w, patch_dim) in dtype on device."""
        return frames_to_patches(self.frames.to(device, non_blocking=True), self.geometry, dtype)


def smart_resize(height: int, width: int, geometry: VisionGeometry) -> tuple[int, int]:
    """Pick the output size: sides multiples of geometry.factor, area within the pixel bounds."""
    if height < 1 or width < 1:
        raise ValueError(f"image size: must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image size: aspect ratio of {height}x{width} exceeds {MAX_ASPECT_RATIO}")
    factor = geometry.factor
    out_h = round(height / factor) * factor
    out_w = round(width / factor) * factor
    if out_h * out_w > geometry.max_pixels:
        scale = math.sqrt(height * width / geometry.max_pixels)
        out_h = max(factor, math.floor(height / scale / factor) * factor)
        out_w = max(factor, math.floor(width / scale / factor) * factor)
    elif out_h * out_w < geometry.min_pixels:
        scale = math.sqrt(geometry.min_pixels / (height * width))
        out_h = math.ceil(height * scale / factor) * factor
        out_w = math.ceil(width * scale / factor) * factor
    return out_h, out_w


def resize_frames(frames_nchw: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bicubic, antialiased resize of uint8 (N, 3, H, W) frames, as torchvision does it.

    On CPU torch resizes uint8 natively; elsewhere torchvision goes through float32 with
    clamping and rounding. Following the same two paths keeps CPU results bit-identical.
    On CPU the result keeps the input's memory layout: torch's uint8 kernel reads channels-last
    frames (a permuted (N, H, W, 3) batch) as they are, and takes twice as long from NCHW.
    """
    if tuple(frames_nchw.shape[-2:]) == size:
        return frames_nchw
    if frames_nchw.device.type == "cpu":
        return F.interpolate(frames_nchw, size=size, mode="bicubic", align_corners=False, antialias=True)
    resized = F.interpolate(frames_nchw.float(), size=size, mode="bicubic", align_corners=False, antialias=True)
    return resized.clamp_(0, 255).round_().to(torch.uint8)


def resize_nhwc(frames: torch.Tensor, geometry: VisionGeometry) -> torch.Tensor:
    """Resize uint8 (N, H, W, 3) frames for the vision tower: uint8 (N, 3, h, w) on their device,
    contiguous on a GPU; on the CPU channels-last (pixels in (N, h, w, 3) order, so
    `.permute(0, 2, 3, 1)` of it is free). The values are the same either way.

    On the CPU the frames are not first copied into NCHW order: that copy and the slower kernel
    it leads to cost ~3x the resize of full-HD frames (bench/RESULTS.md, "Serving overhead on the
    CPU"). On a GPU they are, as always, so GPU results stay those of every earlier run.
    """
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames: expected uint8 (N, H, W, 3), got {frames.dtype} {tuple(frames.shape)}")
    nchw = frames.permute(0, 3, 1, 2)
    if nchw.device.type != "cpu":
        nchw = nchw.contiguous()
    return resize_frames(nchw, smart_resize(frames.shape[1], frames.shape[2], geometry))


def patchify(normalized: torch.Tensor, geometry: VisionGeometry) -> torch.Tensor:
    """Cut float (N, 3, H, W) images into Qwen3-VL patches, (N * gh * gw, patch_dim).

    Patches are ordered by merge window (row-major), then within a window; each patch holds
    channels x time x rows x cols, with the still image repeated along time.
    """
    n, channels, height, width = normalized.shape
    p, m, t = geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    blocks = normalized.reshape(n, channels, grid_h // m, m, p, grid_w // m, m, p)
    # (n, window row, window col, row in window, col in window, channel, pixel row, pixel col)
    blocks = blocks.permute(0, 2, 5, 3, 6, 1, 4, 7)
    blocks = blocks.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
    return blocks.reshape(n * grid_h * grid_w, channels * t * p * p)


def frames_to_patches(frames: torch.Tensor, geometry: VisionGeometry, dtype: torch.dtype) -> torch.Tensor:
    """Qwen3-VL patches of resized uint8 (N, 3, h, w) frames, in dtype, on the frames' device.

    Normalised in float32 like the reference processor, then cast: the numbers a vision tower
    in dtype sees from transformers' processor (patchify only moves values, so casting before
    it is exact and its temporal copy is made in dtype, not float32).
    """
    # (x/255 - mean)/std folded into one affine step, in float32 like the reference
    scale = 255.0 * geometry.image_std
    normalized = (frames.float() - 255.0 * geometry.image_mean) / scale
    return patchify(normalized.to(dtype), geometry)


def preprocess_frames(
    frames: np.ndarray | torch.Tensor,
    geometry: VisionGeometry = VisionGeometry(),
    device: torch.device | str | None = None,
    keys: Sequence[str] | None = None,
) -> PreprocessedImages:
    """Resize uint8 RGB frames (N, H, W, 3), all one size, for the vision tower.

    The work happens on `device` (default: where the frames are). keys name the images
    (default: a fresh unique name each, i.e. nothing is ever shared).
    """
    if isinstance(frames, np.ndarray):
        frames = torch.from_numpy(np.ascontiguousarray(frames))
    if device is not None:
        frames = frames.to(device, non_blocking=True)
    n = frames.shape[0] if frames.ndim else 0
    if keys is not None and len(keys) != n:
        raise ValueError(f"keys: {len(keys)} keys for {n} frames")
    resized = resize_nhwc(frames, geometry).contiguous()
    keys = keys if keys is not None else [uuid.uuid4().hex for _ in range(n)]
    return PreprocessedImages(frames=resized, geometry=geometry, keys=tuple(keys))
