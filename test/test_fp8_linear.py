"""FP8 weight-quantized linear (alpamayo_ros/core/fp8_linear.py): exact against a spelled-out
dequantize-and-matmul, within e4m3's rounding bound of the full-precision linear, finite on
all-zero rows, and clear about bad inputs. Runs torch._scaled_mm's CPU kernel; the CUDA kernel
is exercised by bench/expert_loop_bench.py on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from alpamayo_ros.core.fp8_linear import Fp8Linear, fp8_linear

FP8 = torch.float8_e4m3fn
#: e4m3 keeps 3 mantissa bits: a normal value is off by at most half an ulp, 2^-4 of itself;
#: below the smallest normal (2^-6) values are spaced 2^-9 apart, so off by at most 2^-10.
#: Both in units of the row's scale (amax / 448).
RELATIVE, ABSOLUTE = 2.0**-4, 2.0**-10


def operands(seed: int, rows: int = 24, k: int = 64, n: int = 48) -> tuple[torch.Tensor, ...]:
    """x (2, rows/2, K) and weight (N, K) with rows of very different magnitudes, so per-row
    scales matter and small entries land among e4m3's subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, rows)[:, None]
    weight = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    x[3, 5] = 40.0 * x[3].abs().max()  # an outlier token entry
    return x.view(2, rows // 2, k), weight


def fake_quantized(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 round trip in fp32, spelled out: (values as fp32 * scale, scale)."""
    scale = t.float().abs().amax(dim=-1, keepdim=True) / 448.0
    return (t.float() / scale).to(FP8).float() * scale, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_dequantize_then_matmul(dtype: torch.dtype, with_bias: bool) -> None:
    x, weight = operands(seed=0)
    bias = torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(1)).to(dtype)
    x = x.to(dtype)
    got = Fp8Linear(weight, name="layer")(x, bias if with_bias else None)
    x_q, _ = fake_quantized(x.reshape(-1, x.shape[-1]))
    w_q, _ = fake_quantized(weight)
    expected = (x_q @ w_q.T).to(dtype)  # the GEMM writes x's dtype; the bias comes after
    if with_bias:
        expected = expected + bias
    expected = expected.view(2, -1, weight.shape[0])
    assert got.shape == expected.shape and got.dtype == dtype
    # Only rounding differs: fp32 accumulation order (K * 2^-24 < 1e-5 of the summed
    # magnitudes); in bf16 also the output and the bias sum, 2^-9 each.
    magnitude = (x_q.abs() @ w_q.abs().T + bias.float().abs()).view_as(expected)
    tolerance = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert ((got.float() - expected.float()).abs() <= tolerance * magnitude).all()


def test_within_the_rounding_bound_of_the_full_precision_linear() -> None:
    x, weight = operands(seed=2)
    x = x.reshape(-1, x.shape[-1])
    got = Fp8Linear(weight, name="layer")(x)
    exact = F.linear(x.double(), weight.double())
    # Each operand entry e moves by at most RELATIVE*|e| + ABSOLUTE*scale(row), so every
    # product x*w moves by at most err(x)*(|w| + err(w)) + |x|*err(w).
    x_err = RELATIVE * x.abs() + ABSOLUTE * x.abs().amax(-1, keepdim=True) / 448
    w_err = RELATIVE * weight.abs() + ABSOLUTE * weight.abs().amax(-1, keepdim=True) / 448
    bound = x_err.double() @ (weight.abs() + w_err).double().T + x.abs().double() @ w_err.double().T
    error = (got.double() - exact).abs()
    assert (error <= bound * (1 + 1e-4) + 1e-6).all()  # + fp32 accumulation
    assert error.norm() / exact.norm() > 1e-3  # FP8 really rounds (3.7% here, the outlier)


def test_all_zero_rows_give_zeros_not_nan() -> None:
    x, weight = operands(seed=3)
    x, weight = x.reshape(-1, x.shape[-1]), weight.clone()
    x[0], weight[5] = 0.0, 0.0
    layer = Fp8Linear(weight, name="layer")
    assert torch.isfinite(layer.scale).all() and (layer.scale > 0).all()
    got = layer(x)
    assert torch.isfinite(got).all()
    assert (got[0] == 0).all() and (got[:, 5] == 0).all()


def test_copy_is_one_byte_per_weight_unsaved_and_ignores_dtype_casts() -> None:
    _, weight = operands(seed=4)
    module = torch.nn.Module()
    module.copy = Fp8Linear(weight, name="layer")
    assert module.copy.weight.dtype == FP8 and module.copy.weight.nbytes == weight.numel()
    assert module.copy.scale.shape == (1, weight.shape[0])
    assert module.copy.scale.dtype == torch.float32
    assert module.state_dict() == {}  # the full-precision layer's keys are the checkpoint's
    before = module.copy.weight.clone(), module.copy.scale.clone()
    module.to(torch.bfloat16).double()
    assert module.copy.weight.dtype == FP8 and module.copy.scale.dtype == torch.float32
    assert torch.equal(module.copy.weight.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(module.copy.scale, before[1])


def test_load_requantizes_in_place() -> None:
    _, weight = operands(seed=5)
    layer = Fp8Linear(weight, name="layer")
    address, x = layer.weight.data_ptr(), torch.randn(16, weight.shape[1])
    layer.load_(2 * weight)
    assert layer.weight.data_ptr() == address  # captured CUDA graphs keep reading it
    torch.testing.assert_close(layer(x), 2 * Fp8Linear(weight, name="layer")(x))
    with pytest.raises(ValueError, match=r"layer: weight \(16, 64\), built for \(48, 64\)"):
        layer.load_(weight[:16])


def test_bad_shapes_and_dtypes_are_named() -> None:
    x, weight = operands(seed=6)
    layer = Fp8Linear(weight, name="layer")
    with pytest.raises(ValueError, match=r"layers.3.mlp.gate_proj: .*multiples of 16.*\(40, 64\)"):
        Fp8Linear(weight[:40], name="layers.3.mlp.gate_proj")
    with pytest.raises(ValueError, match=r"o_proj: .*multiples of 16.*\(48, 56\)"):
        Fp8Linear(weight[:, :56], name="o_proj")
    with pytest.raises(ValueError, match="q_proj: expected a 2D floating weight"):
        Fp8Linear(weight[0], name="q_proj")
    with pytest.raises(TypeError, match="weight: expected a 2D torch.float8_e4m3fn"):
        fp8_linear(x, weight, layer.scale)
    with pytest.raises(ValueError, match=r"weight_scale: expected \(1, 48\) float32"):
        fp8_linear(x, layer.weight, layer.scale.T)
    with pytest.raises(ValueError, match="x: last dimension 32, the weight takes 64"):
        layer(x[..., :32])
    with pytest.raises(TypeError, match="x: expected one of"):
        layer(x.double())
