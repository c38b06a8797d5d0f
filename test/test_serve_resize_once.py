"""The serving path does each frame's work once: a CPU resize from the frames' own layout gives
the bytes of the NCHW path; frames a server resized for shared-memory clients reach the plan
through the pipeline's frame cache (the plan resizes nothing again) and still plan exactly like
Pipeline.plan; shared-memory copies on several threads give the bytes of one thread."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterator

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from serve_helpers import hf_server, small_frames_checkpoint
from test_serve_frames import SETTINGS, assert_same_plan, stream

from alpamayo_ros.core.frame_cache import FrameCache, frame_key, frame_keys
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.preprocess import VisionGeometry, resize_nhwc, smart_resize
from alpamayo_ros.core.types import DrivingInput, SamplingSettings
from alpamayo_ros.serve import shm, wire
from alpamayo_ros.serve.client import RemotePlanner
from alpamayo_ros.serve.frame_store import FrameStore
from alpamayo_ros.serve.plan_request import parse_plan_request
from alpamayo_ros.serve.process import ServerProcess
from alpamayo_ros.serve.requests import Limits, RequestError

CPU = torch.device("cpu")
GEOMETRY = VisionGeometry()


@pytest.mark.parametrize(("height", "width"), [(1080, 1920), (240, 426), (320, 576), (97, 131)])
def test_cpu_resize_of_the_nhwc_view_is_the_nchw_resize(height: int, width: int) -> None:
    """Down, up, unchanged and odd sizes: the same bytes as resizing a contiguous NCHW copy."""
    frames = torch.from_numpy(np.random.default_rng(height).integers(0, 256, (2, height, width, 3), dtype=np.uint8))
    size = smart_resize(height, width, GEOMETRY)
    nchw = frames.permute(0, 3, 1, 2).contiguous()
    expected = nchw if size == (height, width) else F.interpolate(
        nchw, size=size, mode="bicubic", align_corners=False, antialias=True)
    ours = resize_nhwc(frames, GEOMETRY)
    assert ours.shape == (2, 3, *size) and torch.equal(ours, expected)
    assert ours.permute(0, 2, 3, 1).is_contiguous()  # channels-last: its NHWC view needs no copy
    with pytest.raises(ValueError, match=r"frames: expected uint8 \(N, H, W, 3\)"):
        resize_nhwc(frames.float(), GEOMETRY)


def test_remembered_frames_are_hits_equal_to_fresh_preprocessing() -> None:
    frames = np.random.default_rng(3).integers(0, 256, (3, 1080, 1920, 3), dtype=np.uint8)
    keys = [frame_key(1, stamp, frame) for stamp, frame in enumerate(frames)]
    fresh = FrameCache(GEOMETRY, compute_device=CPU, store_device=CPU, capacity=0).preprocess(frames, keys).frames
    cache = FrameCache(GEOMETRY, compute_device=CPU, store_device=CPU, capacity=8)
    cache.remember(keys[:2], cache.resize(frames[:2]))
    assert (cache.hits, cache.misses, len(cache)) == (0, 0, 2)
    reused = cache.preprocess(list(frames), keys).frames  # a list of frames works as the batch does
    assert (cache.hits, cache.misses) == (2, 1)
    assert reused.is_contiguous() and torch.equal(reused, fresh)
    with pytest.raises(ValueError, match="keys: 1 keys for 2 frames"):
        cache.remember(keys[:1], cache.resize(frames[:2]))


def test_shm_copies_on_threads_equal_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    frames = list(np.random.default_rng(4).integers(0, 256, (3, 64, 96, 3), dtype=np.uint8))
    nbytes = 3 * frames[0].nbytes
    segment = shm.FrameSegment()
    try:
        monkeypatch.setattr(shm, "_COPY_THREADS", 1)
        serial = shm.read_segment("shm", segment.write(frames), shm.PLAN_SEGMENT, 0, nbytes).copy()
        monkeypatch.setattr(shm, "_COPY_THREADS", 3)
        monkeypatch.setattr(shm, "_COPY_PART_BYTES", 5000)  # every copy split in parts on threads
        assert len(shm._byte_parts(nbytes)) == 3
        name = segment.write(frames[::-1])
        threaded = shm.read_segment("shm", name, shm.PLAN_SEGMENT, frames[0].nbytes, 2 * frames[0].nbytes)
        assert np.array_equal(serial, np.concatenate([f.reshape(-1) for f in frames]))
        assert np.array_equal(threaded, np.concatenate([f.reshape(-1) for f in frames[::-1][1:]]))
        with pytest.raises(RequestError, match="shm.shape: needs"):  # a refusal still names the field
            shm.read_segment("shm", name, shm.PLAN_SEGMENT, frames[0].nbytes, nbytes)
    finally:
        segment.close()


def test_shm_frames_reach_the_plan_resized_once(make_driving_input: Callable[..., DrivingInput]) -> None:
    """In-process, the server's own steps: parse a shared-memory delta, resize its new frames (the
    job), then the plan's preprocess: every frame a cache hit, equal to resizing the capture-size
    window afresh; the frame store holds the new frames as the window has them."""
    windows = stream(make_driving_input, 2, seed=7)
    size = smart_resize(*windows[0].images.shape[2:4], GEOMETRY)
    cache = FrameCache(GEOMETRY, compute_device=CPU, store_device=CPU, capacity=32)
    store = FrameStore(64, 2**28)
    segment = shm.FrameSegment()
    try:
        for index, inputs in enumerate(windows):
            flat = inputs.images.reshape(-1, *inputs.images.shape[2:])
            slots = list(range(len(flat))) if index == 0 else [2, 5]  # then each camera's new frame
            where = wire.ShmFrames(name=segment.write([flat[slot] for slot in slots]), offset=0, dtype="uint8",
                                   shape=[len(slots), *flat.shape[1:]])
            body = wire.encode_request(inputs, SETTINGS, session="once", sent_slots=slots, shm=(where, size))
            parsed, _, pending = parse_plan_request(body, Limits(), store, cache, allow_shm=True)
            assert parsed.frame_keys is None  # its new frames' pixels are not in the window yet
            planned = pending.resize_into(cache, store, parsed)
            misses = cache.misses
            window = cache.preprocess(planned.images.reshape(-1, *size, 3), frame_keys(planned)).frames
            assert cache.misses == misses  # the plan resized nothing
            expected = F.interpolate(torch.from_numpy(flat).permute(0, 3, 1, 2).contiguous(), size=size,
                                     mode="bicubic", align_corners=False, antialias=True)
            assert torch.equal(window, expected)
            # the keys it carries are the hashes of its pixels: the plan hashes nothing, and is not misled
            assert list(planned.frame_keys) == frame_keys(dataclasses.replace(planned, images=planned.images.copy()))
            held, missing = store.take(pending.keys)
            assert not missing and all(np.array_equal(held[key].image, planned.images.reshape(-1, *size, 3)[slot])
                                       for key, slot in zip(pending.keys, pending.slots))
    finally:
        segment.close()


def test_an_inline_delta_carries_the_keys_of_its_pixels(make_driving_input: Callable[..., DrivingInput]) -> None:
    """Inline deltas: the frame store holds each frame with its key, so the parsed window carries
    every frame's key (the plan hashes none) and they are the hashes of its pixels."""
    geometry = VisionGeometry(min_pixels=128 * 192, max_pixels=128 * 192)  # the stream's frames are resized already
    cache = FrameCache(geometry, compute_device=CPU, store_device=CPU, capacity=0)
    store = FrameStore(64, 2**28)
    for index, inputs in enumerate(stream(make_driving_input, 3, seed=9)):
        slots = list(range(6)) if index == 0 else [2, 5]
        body = wire.encode_request(inputs, SETTINGS, session="inline", sent_slots=slots)
        planned, _, pending = parse_plan_request(body, Limits(), store, cache, allow_shm=False)
        assert pending is None and not planned.images.flags.writeable
        assert list(planned.frame_keys) == frame_keys(inputs)  # inputs is writable: hashed afresh here


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    checkpoint = small_frames_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("resize_once") / "ckpt")
    process = hf_server(checkpoint, tmp_path_factory.mktemp("resize_once_log") / "server.log").start()
    yield process, checkpoint
    process.stop()


def test_a_shm_stream_plans_like_the_pipeline_with_no_cache_misses_in_the_plan(
    server: tuple[ServerProcess, Path], make_driving_input: Callable[..., DrivingInput]
) -> None:
    process, checkpoint = server
    pipeline = Pipeline.from_checkpoint(checkpoint, backend="hf", device="cpu")
    planner = RemotePlanner(process.url, timeout_s=120, frame_transport="shm")
    settings = SamplingSettings(num_samples=1, temperature=0.0, max_reasoning_tokens=4, flow_steps=2)

    def cache_counts() -> tuple[int, int]:
        counts = httpx.get(process.url + "/v1/metadata", timeout=30).json()["frame_cache"]
        return counts["hits"], counts["misses"]

    try:
        for inputs in stream(make_driving_input, 3, seed=8):
            before = cache_counts()
            plan = planner.plan(inputs, settings)
            assert_same_plan(plan, pipeline.plan(inputs, settings))
            hits, misses = cache_counts()
            assert (hits - before[0], misses - before[1]) == (inputs.images.shape[0] * inputs.images.shape[1], 0)
            assert 0 < plan.timings_ms["serve.shm_read"] <= plan.timings_ms["serve.parse"]
            assert plan.timings_ms["serve.parse_wait"] >= 0
    finally:
        planner.close()
