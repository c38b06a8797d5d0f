"""FP8 weight-quantized linear layers, for the action expert's skinny (M = 64) GEMMs.

With 64 rows a GEMM is bound by reading its weight (bench/EXPERT.md), so storing the weight
as float8_e4m3fn halves the bytes it moves. Weights get one fp32 scale per output channel,
activations one per token, computed on the fly (dynamic); `torch._scaled_mm` multiplies the
FP8 operands with both scale vectors (rowwise scaling) and writes the activation's dtype.

Scales map a row's largest magnitude to e4m3's largest finite value, 448; an all-zero row
gets a tiny floor instead of 0 so that it quantizes to zeros, not NaN. Everything is free of
host syncs, so it runs under torch.compile(fullgraph=True) and inside CUDA graphs.

Shapes: CUDA's FP8 GEMMs need in_features and out_features to be multiples of 16 (any number
of rows); nothing is padded: an Fp8Linear of another shape is refused when it is built,
naming the layer. The bias is added after the GEMM in the output dtype, which every backend
accepts (CUDA's kernel takes no bias with fp32 outputs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
#: Floor of a row's amax before it becomes a scale: keeps an all-zero row finite.
_AMAX_FLOOR = 1e-12
#: Activation (and so output) dtypes torch._scaled_mm writes.
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: in_features and out_features must be multiples of this (torch._scaled_mm on CUDA).
ALIGNMENT = 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split x (R, K) into FP8 values (R, K) and fp32 scales (R, 1), x ~ values * scales.

    Each row's amax maps to 448; the clamp guards the rounding of that one division.
    """
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight * weight_scale.T, bias) over FP8 operands; out in x's dtype.

    x (..., K) is quantized per token here; weight (N, K) float8_e4m3fn and weight_scale
    (1, N) fp32 are quantize_rows' values and scales (transposed) of the weight (Fp8Linear).
    """
    if weight.dtype != FP8 or weight.dim() != 2:
        raise TypeError(f"weight: expected a 2D {FP8} tensor, got {weight.dim()}D {weight.dtype}")
    out_features, in_features = weight.shape
    if tuple(weight_scale.shape) != (1, out_features) or weight_scale.dtype != torch.float32:
        raise ValueError(
            f"weight_scale: expected (1, {out_features}) float32, got"
            f" {tuple(weight_scale.shape)} {weight_scale.dtype}"
        )
    if x.shape[-1] != in_features:
        raise ValueError(f"x: last dimension {x.shape[-1]}, the weight takes {in_features}")
    if x.dtype not in OUT_DTYPES:
        raise TypeError(f"x: expected one of {OUT_DTYPES} (the output's dtype), got {x.dtype}")
    values, scale = quantize_rows(x.reshape(-1, in_features))
    # weight.t() is column-major, the layout the CUDA kernel wants for its second operand.
    out = torch._scaled_mm(
        values, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=x.dtype
    )
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out_features)


class Fp8Linear(nn.Module):
    """An FP8 copy of one linear weight (N, K) with its per-output-channel scales.

    Holds no bias (the caller passes the full-precision layer's) and no gradient. Its
    buffers are unsaved, so a state_dict stays the full-precision one. `load_` re-quantizes
    in place: captured CUDA graphs hold the buffers' addresses. Memory: 1 byte per weight
    plus 4 per output channel.
    """

    def __init__(self, weight: torch.Tensor, *, name: str) -> None:
        """Quantize weight; name (the layer's) is what a shape error reports."""
        super().__init__()
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"{name}: expected a 2D floating weight, got {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        if out_features % ALIGNMENT or in_features % ALIGNMENT:
            raise ValueError(
                f"{name}: FP8 GEMMs need out/in features that are multiples of {ALIGNMENT},"
                f" got weight {tuple(weight.shape)}"
            )
        self.name = name
        factory = {"device": weight.device}
        self.weight = nn.Buffer(torch.empty(weight.shape, dtype=FP8, **factory), persistent=False)
        self.scale = nn.Buffer(
            torch.empty(1, out_features, dtype=torch.float32, **factory), persistent=False
        )
        self.load_(weight)

    @torch.no_grad()
    def load_(self, weight: torch.Tensor) -> None:
        """Re-quantize weight (same shape) into the existing buffers."""
        if weight.shape != self.weight.shape:
            raise ValueError(
                f"{self.name}: weight {tuple(weight.shape)}, built for {tuple(self.weight.shape)}"
            )
        values, scale = quantize_rows(weight)
        self.weight.copy_(values)
        self.scale.copy_(scale.view(1, -1))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, bias)

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> nn.Module:
        # Follow device moves but never dtype casts: expert.to(bf16) or .double() must not
        # widen the FP8 copy (nor round its fp32 scales). fn on the small scale buffer tells
        # where the module goes.
        device = fn(self.scale).device
        self.weight, self.scale = self.weight.to(device), self.scale.to(device)
        return self

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        return f"{self.name}: in_features={in_features}, out_features={out_features}, {FP8}"
