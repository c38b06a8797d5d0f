"""Image preprocessing (resize here, patches where the vision tower runs) equals transformers'
Qwen2-VL image processor, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from alpamayo_ros.core.preprocess import (
    PreprocessedImages,
    VisionGeometry,
    preprocess_frames,
    resize_frames,
    smart_resize,
)

GEOMETRY = VisionGeometry()  # Alpamayo 1.5: patch 16, merge 2, pixels 163840..196608


def reference_processor():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        min_pixels=GEOMETRY.min_pixels,
        max_pixels=GEOMETRY.max_pixels,
    )


@pytest.mark.parametrize(
    ("height", "width", "resized", "grid"),
    [
        (1080, 1920, (320, 576), (20, 36)),  # camera frames: 720 patches, 180 tokens
        (480, 640, (384, 512), (24, 32)),
        (240, 426, (320, 544), (20, 34)),  # upscaled to reach min_pixels
    ],
)
def test_matches_transformers_bit_for_bit(height: int, width: int, resized: tuple, grid: tuple) -> None:
    frames = np.random.default_rng(height).integers(0, 256, (2, height, width, 3), dtype=np.uint8)
    ours = preprocess_frames(frames, GEOMETRY)
    reference = reference_processor()(
        images=[torch.from_numpy(frame).permute(2, 0, 1) for frame in frames], return_tensors="pt"
    )
    assert smart_resize(height, width, GEOMETRY) == resized
    assert ours.image_grid_thw.tolist() == reference["image_grid_thw"].tolist() == [[1, *grid]] * 2
    assert ours.frames.dtype == torch.uint8 and ours.frames.shape == (2, 3, *resized)
    patches = ours.patches("cpu", torch.float32)
    assert patches.shape == (2 * grid[0] * grid[1], 1536)
    assert torch.equal(patches, reference["pixel_values"])
    # made in a vision tower's dtype: exactly the cast the tower would apply to the reference
    assert torch.equal(ours.patches("cpu", torch.bfloat16), reference["pixel_values"].bfloat16())
    assert ours.tokens_per_image == [grid[0] * grid[1] // 4] * 2


def test_resized_frames_are_torchvisions_resize() -> None:
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF

    frames = np.random.default_rng(1).integers(0, 256, (3, 1080, 1920, 3), dtype=np.uint8)
    ours = resize_frames(torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(), (320, 576))
    expected = tvF.resize(
        torch.from_numpy(frames).permute(0, 3, 1, 2),
        [320, 576],
        interpolation=InterpolationMode.BICUBIC,
        antialias=True,
    )
    assert ours.dtype == torch.uint8
    assert torch.equal(ours, expected)


def test_frames_already_at_size_are_not_resampled() -> None:
    frames = np.random.default_rng(2).integers(0, 256, (1, 320, 576, 3), dtype=np.uint8)
    ours = preprocess_frames(frames, GEOMETRY)
    assert ours.image_grid_thw.tolist() == [[1, 20, 36]]
    # patch 0 holds the top-left 16x16 pixels of channel 0, twice (temporal patch of a still image)
    first = (torch.from_numpy(frames[0, :16, :16, 0]).float() - 127.5) / 127.5
    patches = ours.patches("cpu", torch.float32)
    assert torch.equal(patches[0, :256].view(16, 16), first)
    assert torch.equal(patches[0, 256:512].view(16, 16), first)


def test_bad_frames_are_rejected_by_name() -> None:
    with pytest.raises(ValueError, match=r"frames: expected uint8 \(N, H, W, 3\)"):
        preprocess_frames(np.zeros((2, 64, 64, 3), dtype=np.float32), GEOMETRY)
    with pytest.raises(ValueError, match="frames"):
        preprocess_frames(np.zeros((64, 64, 3), dtype=np.uint8), GEOMETRY)
    with pytest.raises(ValueError, match="keys: 1 keys for 2 frames"):
        preprocess_frames(np.zeros((2, 64, 64, 3), dtype=np.uint8), GEOMETRY, keys=["a"])
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 4000, GEOMETRY)
    with pytest.raises(ValueError, match="min_pixels"):
        VisionGeometry(min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError, match=r"frames: expected uint8 \(N, 3, h, w\) with sides multiples of 32"):
        PreprocessedImages(frames=torch.zeros((1, 3, 32, 48), dtype=torch.uint8), geometry=GEOMETRY, keys=("a",))
