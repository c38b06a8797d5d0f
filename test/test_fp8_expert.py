"""The FP8 expert: its layers multiply with exactly the dequantised FP8 weights (the CPU kernel
is ActionExpertModel.dequantized(), a full-precision expert holding them, through the reference
and the fast path), the error
is FP8's and not more, nothing of the checkpoint's layout changes, and the pipeline, the node's
parameters and the server take the setting with errors naming it."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from alpamayo_ros.core.backbone import PrefixCache
from alpamayo_ros.core.expert import ActionExpertModel, ExpertConfig
from alpamayo_ros.core.flow_matching import ExpertSampler, sample
from alpamayo_ros.core.fp8_linear import FP8, Fp8Linear, fp8_kernel, pick_kernel, quantize_rows
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import EXPERT_QUANTIZATIONS, SamplingSettings
from alpamayo_ros.settings import SPECS, ParameterError, parse_settings

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def tiny_expert() -> ActionExpertModel:
    torch.manual_seed(0)
    config = ExpertConfig(
        hidden_size=64, intermediate_size=96, num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, rope_theta=10_000.0, mrope_section=(2, 3, 3), action_hidden_size=32, max_freq=1.0,
    )  # fmt: skip
    return ActionExpertModel(config).eval()


def cache_of(rows: int, length: int, seed: int) -> PrefixCache:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, KV_HEADS, length, HEAD_DIM)
    return PrefixCache(
        keys=[torch.randn(shape, generator=g) for _ in range(LAYERS)],
        values=[torch.randn(shape, generator=g) for _ in range(LAYERS)],
        offsets=torch.full((rows,), length), rope_deltas=torch.arange(rows) - 4,
    )


def test_rows_quantise_to_fp8_within_its_rounding_and_zero_rows_stay_zero() -> None:
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)) * torch.tensor([1e-3, 1, 30, 500, 0])[:, None]
    values, scale = quantize_rows(x)
    assert values.dtype == FP8 and scale.shape == (5, 1)
    back = values.float() * scale
    normal = x.abs() >= scale * 2**-6  # e4m3's normal range below its 448 top
    # 3 mantissa bits: a round-to-nearest error of at most 2^-4 of the value
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-30)[normal].all()
    assert (back.abs().amax(dim=1)[:4] / x.abs().amax(dim=1)[:4] - 1).abs().max() < 1e-6  # amax maps to 448 exactly
    assert torch.equal(back[4], torch.zeros(256)) and torch.isfinite(back).all()


def test_the_fp8_expert_is_the_full_precision_expert_over_dequantised_weights() -> None:
    original = tiny_expert()
    quantized = copy.deepcopy(original)
    quantized.quantize_fp8()
    assert quantized.fp8_kernel == "dequant" and original.fp8_kernel is None  # the CPU kernel
    twin = quantized.dequantized()
    assert twin.fp8_kernel is None
    cache = cache_of(3, 24, seed=2)
    x, t = torch.randn(3, 64, 2, generator=torch.Generator().manual_seed(3)), torch.rand(3)
    with torch.no_grad():
        fp8, exact, full = (m.velocity(x, t, cache) for m in (quantized, twin, original))
    # the only difference from the twin: gate and up in one GEMM, not two
    assert (fp8 - exact).abs().max() < 1e-5
    relative = ((fp8 - full).norm() / full.norm()).item()
    assert 1e-4 < relative < 0.1, relative  # really quantised, and by FP8's rounding only
    noise = torch.randn(3, 64, 2, generator=torch.Generator().manual_seed(4))
    fast = ExpertSampler(quantized, bucket=1).sample(cache, steps=3, init_noise=noise)
    with torch.no_grad():
        slow = sample(lambda x, t: twin.velocity(x, t, cache), batch=3, init_noise=noise, steps=3)
    assert (fast - slow).abs().max() < 1e-5 and (slow - noise).abs().max() > 0.1


def test_fp8_copies_leave_the_checkpoint_layout_and_ignore_dtype_casts() -> None:
    original = tiny_expert()
    quantized = copy.deepcopy(original)
    quantized.quantize_fp8("dequant")
    assert quantized.state_dict().keys() == original.state_dict().keys()
    for name, tensor in quantized.state_dict().items():
        assert torch.equal(tensor, original.state_dict()[name]), name  # the full-precision weights stay
    cache = cache_of(1, 16, seed=5)
    x, t = torch.randn(1, 64, 2, generator=torch.Generator().manual_seed(6)), torch.rand(1)
    with torch.no_grad():
        fp32 = quantized.velocity(x, t, cache)
    quantized.to(torch.bfloat16)  # in place, as a pipeline casts its expert
    layer = quantized.expert.layers[1].mlp.down_fp8
    assert layer.values.dtype == FP8 and layer.scale.dtype == torch.float32
    halved = PrefixCache([k.bfloat16() for k in cache.keys], [v.bfloat16() for v in cache.values], cache.offsets,
                         cache.rope_deltas)  # fmt: skip
    with torch.no_grad():
        bf16 = quantized.velocity(x, t, halved).float()
    assert ((bf16 - fp32).norm() / fp32.norm()).item() < 0.05  # the same FP8 weights, bf16 activations


def test_kernel_choices_are_named_and_refused_where_they_cannot_run() -> None:
    cpu = torch.device("cpu")
    assert pick_kernel("auto", cpu) == "dequant" == pick_kernel("dequant", cpu)
    for kernel, reason in (("marlin", "vLLM's marlin kernel runs on CUDA devices"), ("scaled_mm", "FP8 on CUDA devices"),
                           ("cutlass", "vLLM's cutlass kernel runs on CUDA devices")):
        with pytest.raises(ValueError, match=f"kernel: {kernel} cannot run here: .*{reason}"):
            pick_kernel(kernel, cpu)
    with pytest.raises(ValueError, match="kernel: expected one of"):
        pick_kernel("fp4", cpu)
    with pytest.raises(RuntimeError, match="dequantized: this expert has no FP8 copies"):
        tiny_expert().dequantized()
    assert [fp8_kernel(choice) for choice in EXPERT_QUANTIZATIONS] == [
        None, "auto", "cutlass", "marlin", "scaled_mm", "dequant"]
    with pytest.raises(ValueError, match="expert_quantization: expected one of"):
        fp8_kernel("int8")
    with pytest.raises(ValueError, match="expert.layers.0.mlp.down_proj: expected a 2D floating weight"):
        Fp8Linear(torch.zeros(4, 4, dtype=torch.int32), None, name="expert.layers.0.mlp.down_proj")
    layer = Fp8Linear(torch.randn(8, 32), torch.randn(8), name="probe")
    with pytest.raises(ValueError, match="probe: input's last dimension 16, the weight takes 32"):
        layer(torch.randn(2, 16))


def test_the_pipeline_plans_with_the_fp8_expert(tiny_checkpoint: Path, make_driving_input) -> None:
    settings = SamplingSettings(temperature=0.0, max_reasoning_tokens=6, flow_steps=3)
    inputs = make_driving_input(camera_indices=(0, 1), frames=2, height=64, width=96)
    full = Pipeline.from_checkpoint(tiny_checkpoint, backend="hf", device="cpu")
    fp8 = Pipeline.from_checkpoint(tiny_checkpoint, backend="hf", device="cpu", expert_quantization="fp8")
    assert fp8.expert.fp8_kernel == "dequant" and full.expert.fp8_kernel is None
    planned, reference = fp8.plan(inputs, settings), full.plan(inputs, settings)
    assert planned.generated_ids == reference.generated_ids  # the backbone is untouched
    assert np.isfinite(planned.xyz).all() and not np.array_equal(planned.xyz, reference.xyz)
    with pytest.raises(ValueError, match="expert_quantization: expected one of"):
        Pipeline.from_checkpoint(tiny_checkpoint, backend="hf", device="cpu", expert_quantization="fp16")
    with pytest.raises(ValueError, match="expert_quantization: not with tensor_parallel_size > 1"):
        Pipeline.from_checkpoint(tiny_checkpoint, backend="vllm", device="cpu", expert_quantization="fp8",
                                 backend_options={"tensor_parallel_size": 2})


def _values(**overrides: object) -> dict:
    values = {name: spec.default for name, spec in SPECS.items()}
    values.update({"model.checkpoint_path": "/unused", "cameras.topics": ["/front"], "cameras.indices": [1],
                   "cameras.transports": ["raw"], **overrides})  # fmt: skip
    return values


def test_the_parameter_reaches_the_settings_and_bad_uses_name_it() -> None:
    assert parse_settings(_values(), check_paths=False).expert_quantization == "none"
    chosen = parse_settings(_values(**{"model.expert_quantization": "fp8_marlin"}), check_paths=False)
    assert chosen.expert_quantization == "fp8_marlin"
    for overrides, needle in (
        ({"model.expert_quantization": "int4"}, "is not one of none, fp8"),
        ({"model.expert_quantization": "fp8", "model.backend": "remote", "remote.url": "http://127.0.0.1:1"},
         "needs an in-process backend"),
        ({"model.expert_quantization": "fp8", "model.backend": "vllm", "vllm.tensor_parallel_size": 2},
         "not with vllm.tensor_parallel_size > 1"),
    ):  # fmt: skip
        with pytest.raises(ParameterError, match=f"^parameter 'model.expert_quantization'.*{needle}"):
            parse_settings(_values(**overrides), check_paths=False)


def test_the_vllm_kernels_say_why_they_cannot_run_here() -> None:
    """The adapter's own checks (what pick_kernel reports on a GPU machine), on this vLLM build."""
    from alpamayo_ros.core.vllm_adapter.fp8_kernels import cutlass_unavailable, marlin_unavailable

    cpu = torch.device("cpu")
    assert cutlass_unavailable(cpu) == "cutlass_scaled_mm FP8 runs on CUDA devices, not cpu"
    assert marlin_unavailable(cpu) == "Marlin runs on CUDA devices, not cpu"
