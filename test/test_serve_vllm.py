"""One smoke of alpamayo-serve on the vLLM backend (CPU): it warms up, reports ready, and plans
through the binary endpoint with the same results as the in-process vLLM pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from serve_helpers import small_frames_checkpoint

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import DrivingInput, SamplingSettings
from alpamayo_ros.serve.client import RemotePlanner
from alpamayo_ros.serve.process import ServerProcess

ENGINE_FLAGS = ["--enforce-eager", "--kv-cache-gib", "1", "--max-model-len", "4096"]
SETTINGS = SamplingSettings(temperature=0.0, max_reasoning_tokens=6, flow_steps=3)


@pytest.mark.timeout(900)
def test_vllm_backend_serves_plans(tiny_checkpoint: Path, tmp_path: Path,
                                   make_driving_input: Callable[..., DrivingInput]) -> None:
    checkpoint = small_frames_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    inputs = make_driving_input(camera_indices=(1, 6), frames=2, height=64, width=96)
    server = ServerProcess(["--checkpoint", str(checkpoint), "--backend", "vllm", "--device", "cpu",
                            "--log-level", "warning", *ENGINE_FLAGS], tmp_path / "server.log").start()
    try:
        planner = RemotePlanner(server.url, timeout_s=300)
        remote = planner.plan(inputs, SETTINGS)
        planner.close()
    finally:
        server.stop()
    assert planner.backend == "remote:vllm"
    pipeline = Pipeline.from_checkpoint(checkpoint, backend="vllm", device="cpu", backend_options={
        "enforce_eager": True, "kv_cache_gib": 1, "max_model_len": 4096, "cache_dir": tmp_path / "vllm"})
    local = pipeline.plan(inputs, SETTINGS)
    pipeline.close()
    assert remote.generated_ids == local.generated_ids  # greedy: the same reasoning
    np.testing.assert_allclose(remote.xyz, local.xyz, atol=1e-5, rtol=0)
