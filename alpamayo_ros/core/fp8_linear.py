"""FP8 copies of the action expert's linear weights, for its skinny GEMMs.

A flow step multiplies 64 action tokens per sample by every layer weight, so its GEMMs are
bound by reading the weights (bench/EXPERT.md): storing them as float8_e4m3fn halves the bytes.
Each weight (N, K) gets one fp32 scale per output channel (its row's largest magnitude maps to
e4m3's 448; an all-zero row gets a tiny floor, so it quantises to zeros, not NaN).

Kernels (one per layer, chosen when it is built):
- "scaled_mm": activations quantised per token on the fly (inductor fuses that into the
  kernels before), torch._scaled_mm with both scale vectors (CUDA, compute capability 8.9+);
- "cutlass": activations quantised per token as for scaled_mm, vLLM's cutlass_scaled_mm
  (vllm_adapter/fp8_kernels.py; CUDA, compute capability 8.9+), which has small-M tiles;
- "marlin": weight-only, bf16 activations, through vLLM's Marlin kernel (vllm_adapter/fp8_kernels.py);
- "dequant": the weight dequantised to the activations' dtype, then F.linear: any device, and
  exactly a full-precision layer holding the dequantised weight (the tests' and CPU's kernel).
"auto" takes "cutlass/scaled_mm" where both run (cutlass up to CUTLASS_MAX_ROWS rows, scaled_mm
above), else scaled_mm, else marlin, else dequant. On an H100, against bf16 in the same run
(bench/EXPERT.md): 1 sample (64 rows) cutlass -4.4 ms, scaled_mm -2.0; 16 samples (1,024 rows)
cutlass -1 to -6 ms, scaled_mm -22; Marlin lost at both sizes. (Those cutlass figures had its
activations quantised by vLLM's own op, one kernel more per GEMM than the fused quantisation
both kernels use here.)

All of them are free of host syncs, so they run under torch.compile and inside CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .types import EXPERT_QUANTIZATIONS

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
KERNELS = ("auto", "cutlass", "marlin", "scaled_mm", "dequant")
#: "auto"'s pair where both run: cutlass_scaled_mm for inputs of up to CUTLASS_MAX_ROWS rows
#: (a sample's 64 action tokens: it has small-M tiles), torch._scaled_mm above (16 samples'
#: 1,024 rows: its activation quantisation fuses with the kernels before it).
BY_ROWS = "cutlass/scaled_mm"
CUTLASS_MAX_ROWS = 256
#: Floor of a row's amax before it becomes a scale: keeps an all-zero row finite.
_AMAX_FLOOR = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split x (R, K) into FP8 values (R, K) and fp32 scales (R, 1), x ~ values * scales."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_kernel(quantization: str) -> str | None:
    """The kernel a types.EXPERT_QUANTIZATIONS choice asks for (None: full precision)."""
    if quantization not in EXPERT_QUANTIZATIONS:
        raise ValueError(f"expert_quantization: expected one of {EXPERT_QUANTIZATIONS}, got {quantization!r}")
    if quantization == "none":
        return None
    return "auto" if quantization == "fp8" else quantization.removeprefix("fp8_")


def pick_kernel(kernel: str, device: torch.device) -> str:
    """The kernel an Fp8Linear on device runs for `kernel` (resolving "auto"); a named kernel
    that cannot run there is refused with the reason."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        if _scaled_mm_unavailable(device) is None:
            return BY_ROWS if _vllm_kernel_unavailable("cutlass", device) is None else "scaled_mm"
        return "marlin" if _vllm_kernel_unavailable("marlin", device) is None else "dequant"
    if kernel in ("marlin", "cutlass"):
        reason = _vllm_kernel_unavailable(kernel, device)
    else:
        reason = _scaled_mm_unavailable(device) if kernel == "scaled_mm" else None
    if reason is not None:
        raise ValueError(f"kernel: {kernel} cannot run here: {reason}")
    return kernel


def _vllm_kernel_unavailable(kernel: str, device: torch.device) -> str | None:
    """Why vLLM's `kernel` ("marlin" or "cutlass") cannot run on device (None: it can); vLLM is
    not imported for a CPU expert."""
    if device.type != "cuda":
        return f"vLLM's {kernel} kernel runs on CUDA devices, not {device.type}"
    try:
        from .vllm_adapter import fp8_kernels
    except ImportError as error:
        return f"vLLM is not installed ({error})"
    check = fp8_kernels.marlin_unavailable if kernel == "marlin" else fp8_kernels.cutlass_unavailable
    return check(device)


def _scaled_mm_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"torch._scaled_mm runs FP8 on CUDA devices, not {device.type}"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"FP8 tensor cores need compute capability 8.9 or newer ({torch.cuda.get_device_name(device)})"
    return None


class Fp8Linear(nn.Module):
    """y = x @ (values * scale)^T + bias for a weight (N, K) held as FP8 values and per-row scales.

    Built from a full-precision weight (and bias); the original stays with its owner. Buffers are
    unsaved, so a state_dict stays the full-precision one. Follows device moves, never dtype
    casts (expert.to(bfloat16) must not widen the FP8 copy); a Marlin layer stays on the device
    it was packed on. Memory: 1 byte per weight plus 4 per output channel (Marlin: the same,
    repacked, plus a small workspace).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, name: str, kernel: str = "auto") -> None:
        """name (the layer's) is what errors report; kernel: see the module docstring."""
        super().__init__()
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"{name}: expected a 2D floating weight, got {tuple(weight.shape)} {weight.dtype}")
        self.name = name
        self.kernel = pick_kernel(kernel, weight.device)
        out_features, in_features = weight.shape
        if self.kernel in ("scaled_mm", "cutlass", BY_ROWS) and (out_features % 16 or in_features % 16):
            raise ValueError(f"{name}: the {self.kernel} kernel needs in/out features that are multiples of 16, "
                             f"got {tuple(weight.shape)}")
        with torch.no_grad():
            values, scale = quantize_rows(weight)
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("values", values, persistent=False)
        self.register_buffer("scale", scale.view(1, -1).contiguous(), persistent=False)  # (1, N) fp32
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self._marlin = None
        self._cutlass: Callable[..., torch.Tensor] | None = None
        if self.kernel in ("cutlass", BY_ROWS):
            from .vllm_adapter.fp8_kernels import cutlass_fp8_linear

            self._cutlass = cutlass_fp8_linear
        if self.kernel == "marlin":
            from .vllm_adapter.fp8_kernels import MarlinFp8

            self._marlin = MarlinFp8(values, scale, weight.dtype)
            self.values = None  # repacked: Marlin's copy is the only one kept

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, (N, K) fp32 (not for Marlin, which keeps only
        its repacked copy)."""
        if self.values is None:
            raise RuntimeError(f"{self.name}: a Marlin layer keeps only its repacked weight")
        return self.values.float() * self.scale.view(-1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input's last dimension {x.shape[-1]}, the weight takes {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        kernel = self.kernel
        if kernel == BY_ROWS:  # the row count is fixed per traced shape, so this picks at trace time
            kernel = "cutlass" if rows.shape[0] <= CUTLASS_MAX_ROWS else "scaled_mm"
        if kernel == "marlin":
            out = self._marlin(rows, bias)
        elif kernel == "cutlass":
            values, scale = quantize_rows(rows)
            out = self._cutlass(values, scale, self.values, self.scale, bias, x.dtype)
        elif kernel == "scaled_mm":
            values, scale = quantize_rows(rows)
            # the weight's values.t() is column-major, the layout the kernel wants second
            out = torch._scaled_mm(values, self.values.t(), scale_a=scale, scale_b=self.scale, out_dtype=x.dtype)
            if bias is not None:
                out = out + bias
        else:
            out = F.linear(rows, self.dequantized().to(x.dtype), bias)
        return out.view(*x.shape[:-1], self.out_features)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        device = fn(self.scale).device  # where the module goes; dtype casts are not followed
        if self._marlin is not None and device != self.scale.device:
            raise RuntimeError(f"{self.name}: a Marlin layer cannot move from {self.scale.device} to {device}")
        for name in ("values", "scale", "bias"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.to(device))
        return self

    def extra_repr(self) -> str:
        return f"{self.name}: in_features={self.in_features}, out_features={self.out_features}, {FP8}, {self.kernel}"
