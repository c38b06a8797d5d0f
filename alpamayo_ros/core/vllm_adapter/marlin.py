"""FP8 weight-only GEMMs through vLLM's Marlin kernel: bf16 activations, FP8 weights streamed.

Marlin reads each weight once per call and dequantises it in registers, so a GEMM of few rows
(the expert's 64 action tokens) moves half the bytes of bf16 without quantising the
activations; cuBLAS's FP8 GEMMs use 128-row tiles that such a GEMM half fills
(bench/EXPERT.md). The weight is repacked into Marlin's layout once, where it lives.
"""

from __future__ import annotations

import torch


def marlin_unavailable(device: torch.device) -> str | None:
    """Why Marlin cannot run on device (None: it can): a CUDA device of compute capability
    8.0 or newer, and a vLLM build with the marlin_gemm op."""
    if device.type != "cuda":
        return f"Marlin runs on CUDA devices, not {device.type}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"Marlin needs compute capability 8.0 or newer, {torch.cuda.get_device_name(device)} has less"
    try:
        from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8  # noqa: F401
    except ImportError as error:
        return f"vLLM's Marlin utilities cannot be imported ({error})"
    packet = getattr(torch.ops._C, "marlin_gemm", None)
    if packet is None or not packet.default._schema.arguments:
        return "this vLLM build has no marlin_gemm op"
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
