"""Frames are preprocessed once across overlapping windows, and a reused frame is exactly a fresh one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from alpamayo_ros.core.frame_cache import FrameCache, frame_key, frame_keys
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.preprocess import VisionGeometry, preprocess_frames, smart_resize
from alpamayo_ros.core.types import DrivingInput, SamplingSettings

CPU = torch.device("cpu")


def next_window(inputs: DrivingInput, seed: int) -> DrivingInput:
    """The window 100 ms later: each camera drops its oldest frame and gains a new one."""
    rng = np.random.default_rng(seed)
    new = rng.integers(0, 256, (inputs.images.shape[0], 1, *inputs.images.shape[2:]), dtype=np.uint8)
    step = 100_000_000
    return dataclasses.replace(
        inputs,
        images=np.concatenate([inputs.images[:, 1:], new], axis=1),
        frame_stamps_ns=np.concatenate([inputs.frame_stamps_ns[:, 1:], inputs.frame_stamps_ns[:, -1:] + step], axis=1),
        t0_ns=inputs.t0_ns + step,
    )


def _frames(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 96, 128, 3), dtype=np.uint8)


def test_reused_frames_equal_fresh_preprocessing() -> None:
    cache = FrameCache(VisionGeometry(), compute_device=CPU, store_device=CPU, capacity=8)
    frames = _frames(5, seed=0)
    keys = [f"f{i}" for i in range(5)]
    cache.preprocess(frames[:4], keys[:4])
    assert (cache.hits, cache.misses) == (0, 4)
    second = cache.preprocess(frames[1:], keys[1:])
    assert (cache.hits, cache.misses) == (3, 5)
    fresh = preprocess_frames(frames[1:], VisionGeometry())
    assert torch.equal(second.frames, fresh.frames)
    assert torch.equal(second.image_grid_thw, fresh.image_grid_thw)
    assert second.keys == tuple(keys[1:])


def test_least_recently_used_frames_are_evicted_and_zero_keeps_none() -> None:
    cache = FrameCache(VisionGeometry(), compute_device=CPU, store_device=CPU, capacity=3)
    frames = _frames(4, seed=1)
    cache.preprocess(frames[:3], ["a", "b", "c"])
    cache.preprocess(frames[:1], ["a"])  # a is now the most recent
    cache.preprocess(frames[3:], ["d"])  # evicts b
    misses = cache.misses
    cache.preprocess(frames[:1], ["a"])
    assert cache.misses == misses
    cache.preprocess(frames[1:2], ["b"])
    assert cache.misses == misses + 1 and len(cache) == 3

    none = FrameCache(VisionGeometry(), compute_device=CPU, store_device=CPU, capacity=0)
    none.preprocess(frames[:2], ["a", "b"])
    none.preprocess(frames[:2], ["a", "b"])
    assert (none.hits, none.misses, len(none)) == (0, 4, 0)


def test_frames_are_stored_resized_uint8_and_reused_ones_give_identical_patches() -> None:
    """The cache holds (3, h, w) uint8 frames, not patches; patches of a reused frame are the
    fresh frame's patches, bit for bit, in any vision-tower dtype."""
    geometry = VisionGeometry()
    frames = _frames(3, seed=4)
    cache = FrameCache(geometry, compute_device=CPU, store_device=CPU, capacity=4)
    first = cache.preprocess(frames[:2], ["a", "b"])
    size = smart_resize(*frames.shape[1:3], geometry)
    assert first.frames.dtype == torch.uint8 and first.frames.shape == (2, 3, *size)
    assert all(entry.dtype == torch.uint8 and entry.shape == (3, *size) for entry in cache._entries.values())
    reused = cache.preprocess(frames[1:], ["b", "c"])
    assert (cache.hits, cache.misses) == (1, 3)
    fresh = preprocess_frames(frames[1:], geometry)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(reused.patches(CPU, dtype), fresh.patches(CPU, dtype))


def test_bad_keys_are_rejected_by_name() -> None:
    cache = FrameCache(VisionGeometry(), compute_device=CPU, store_device=CPU, capacity=4)
    frames = _frames(2, seed=2)
    with pytest.raises(ValueError, match="keys: 1 keys for 2 frames"):
        cache.preprocess(frames, ["a"])
    with pytest.raises(ValueError, match="keys: the same frame key twice"):
        cache.preprocess(frames, ["a", "a"])
    with pytest.raises(ValueError, match="capacity"):
        FrameCache(VisionGeometry(), compute_device=CPU, store_device=CPU, capacity=-1)
    assert len(cache) == 0  # nothing half-stored


def test_frame_key_names_camera_stamp_and_content() -> None:
    image = _frames(1, seed=3)[0]
    key = frame_key(1, 10, image)
    assert key == frame_key(1, 10, image.copy())
    assert key != frame_key(0, 10, image)
    assert key != frame_key(1, 11, image)
    changed = image.copy()
    changed[50, 77, 2] ^= 1  # one channel of one pixel
    assert key != frame_key(1, 10, changed)


def test_pipeline_plan_with_reused_frames_equals_a_fresh_pipeline(tiny_checkpoint, make_driving_input) -> None:
    """Plan on window 1, then window 2 (sharing 3 of 4 frames per camera): the window-2 plan is
    bit-identical to one from a pipeline that keeps no frames."""
    first = make_driving_input(camera_indices=(0, 1), frames=4, seed=11)
    second = next_window(first, seed=12)
    settings = SamplingSettings(temperature=0.0, max_reasoning_tokens=6, seed=3)
    cached = Pipeline.from_checkpoint(tiny_checkpoint, backend="hf", dtype="float32")
    cached.plan(first, settings)
    reused = cached.plan(second, settings)
    assert (cached.frames.hits, cached.frames.misses) == (6, 10)
    fresh = Pipeline.from_checkpoint(tiny_checkpoint, backend="hf", dtype="float32", frame_cache=0)
    reference = fresh.plan(second, settings)
    assert (fresh.frames.hits, len(fresh.frames)) == (0, 0)
    assert reused.generated_ids == reference.generated_ids
    np.testing.assert_array_equal(reused.xyz, reference.xyz)


def test_a_plan_from_carried_keys_equals_one_that_hashes(tiny_checkpoint, make_driving_input) -> None:
    """Keys made where the frames arrived (DrivingInput.with_frame_keys) name the same frames:
    the same cache hits and the same plan, window after window."""
    first = make_driving_input(camera_indices=(0, 1), frames=4, seed=21)
    second = next_window(first, seed=22)
    settings = SamplingSettings(temperature=0.0, max_reasoning_tokens=6, seed=3)
    plans = {}
    for carried in (False, True):
        pipeline = Pipeline.from_checkpoint(tiny_checkpoint, backend="hf", dtype="float32")
        windows = [w.with_frame_keys(frame_keys(w)) if carried else w for w in (first, second)]
        plans[carried] = [pipeline.plan(window, settings) for window in windows]
        assert (pipeline.frames.hits, pipeline.frames.misses) == (6, 10)
    for hashed, carried in zip(plans[False], plans[True]):
        assert carried.generated_ids == hashed.generated_ids
        np.testing.assert_array_equal(carried.xyz, hashed.xyz)
