"""vLLM's FP8 GEMM kernels for the FP8 action expert (core/fp8_linear.py).

- Marlin, weight-only (W8A16): bf16 activations, the FP8 weight streamed and dequantised in
  registers; the weight is repacked into Marlin's layout once, where it lives.
- cutlass_scaled_mm (W8A8): activations quantised per token (by the caller), the weight's
  per-output-channel scales applied in the epilogue. On an H100 it was the fastest correct FP8
  GEMM at every expert size timed (64-1,024 rows, bench/RESULTS.md of 2026-12-06).

Both take the expert's weights as fp8_linear keeps them: values (N, K) float8_e4m3fn and fp32
scales, one per output channel.
"""

from __future__ import annotations

import torch


def _has_op(name: str) -> bool:
    """Whether this vLLM build implements torch.ops._C.<name> (CPU builds declare some as
    argument-less stubs)."""
    packet = getattr(torch.ops._C, name, None)
    return packet is not None and bool(packet.default._schema.arguments)


def _cuda_unavailable(device: torch.device, kernel: str, capability: tuple[int, int]) -> str | None:
    if device.type != "cuda":
        return f"{kernel} runs on CUDA devices, not {device.type}"
    if torch.cuda.get_device_capability(device) < capability:
        major, minor = capability
        return f"{kernel} needs compute capability {major}.{minor} or newer, {torch.cuda.get_device_name(device)} has less"
    return None


def marlin_unavailable(device: torch.device) -> str | None:
    """Why Marlin cannot run on device (None: it can): a CUDA device of compute capability
    8.0 or newer, and a vLLM build with the marlin_gemm op."""
    if reason := _cuda_unavailable(device, "Marlin", (8, 0)):
        return reason
    try:
        from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8  # noqa: F401
    except ImportError as error:
        return f"vLLM's Marlin utilities cannot be imported ({error})"
    if not _has_op("marlin_gemm"):
        return "this vLLM build has no marlin_gemm op"
    return None


def cutlass_unavailable(device: torch.device) -> str | None:
    """Why cutlass_scaled_mm cannot run FP8 on device (None: it can): FP8 tensor cores (8.9 or
    newer), and a vLLM build with the op and its FP8 support for this device."""
    if reason := _cuda_unavailable(device, "cutlass_scaled_mm FP8", (8, 9)):
        return reason
    try:
        from vllm import _custom_ops as ops
    except ImportError as error:
        return f"vLLM's custom ops cannot be imported ({error})"
    if not _has_op("cutlass_scaled_mm"):
        return "this vLLM build has no cutlass_scaled_mm op"
    major, minor = torch.cuda.get_device_capability(device)
    if not ops.cutlass_scaled_mm_supports_fp8(major * 10 + minor):
        return f"this vLLM build's cutlass_scaled_mm has no FP8 kernel for compute capability {major}.{minor}"
    return None


class MarlinFp8:
    """One FP8 weight (N, K) with per-output-channel scales, repacked for Marlin.

    Call with activations (M, K) in the dtype given at construction: (M, N) out, bias added.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import prepare_fp8_layer_for_marlin

        n, k = weight.shape
        layer = torch.nn.Module()  # what vLLM's preparation reads and rewrites
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.reshape(-1).float(), requires_grad=False)
        layer.output_size_per_partition, layer.input_size_per_partition = n, k
        layer.orig_dtype, layer.logical_widths = dtype, [n]
        prepare_fp8_layer_for_marlin(layer, size_k_first=False)
        self.n, self.k = n, k
        self.weight: torch.Tensor = layer.weight.data
        self.scale: torch.Tensor = layer.weight_scale.data
        self.workspace: torch.Tensor = layer.workspace

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import apply_fp8_marlin_linear

        return apply_fp8_marlin_linear(x, self.weight, self.scale, self.workspace, self.n, self.k, bias)


def cutlass_fp8_linear(
    x: torch.Tensor, x_scale: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x (M, K) FP8 with per-token scales (M, 1) times FP8 values (N, K) with scales (1, N), + bias
    (N,) in out_dtype: (M, N) in out_dtype.

    The caller quantises x (fp8_linear.quantize_rows), so under torch.compile that fuses into
    the kernels before; vLLM's own quantisation op is a kernel of its own before every GEMM.
    """
    from vllm import _custom_ops as ops

    # values.t(): the (K, N) column-major operand cutlass takes second
    return ops.cutlass_scaled_mm(x, values.t(), x_scale, scale, out_dtype=out_dtype, bias=bias)
