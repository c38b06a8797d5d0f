"""The action expert: a Qwen3-VL text decoder that denoises 64 action tokens.

It has no token embeddings: the noisy action is projected to 64 input embeddings, and every
expert layer i attends to backbone cache layer i (prompt + reasoning) plus the 64 action
tokens, bidirectionally. Module names mirror upstream's checkpoint keys (`expert.*`,
`action_in_proj.*`, `action_out_proj.*`) so its state_dict loads 1:1.

Two ways to run it, equal within float rounding: `velocity(x, t, cache)` concatenates the
cache and the action K/V on every call (upstream's append-then-crop, the reference), while
`prepare(cache)` copies the cache once into an ExpertState (expert_state.py) with spare
columns for the action tokens and `velocity_prepared(x, t, state)` then writes only those
columns per step. The cache itself is never mutated.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from alpamayo_ros.core.backbone import PrefixCache
from alpamayo_ros.core.expert_state import (
    PREPARED_ATTENTION,
    ExpertState,
    LayerStep,
    prepared_layer_step,
    shared_layer_step,
)

logger = logging.getLogger(__name__)

ACTION_DIM = 2  # normalised (acceleration, curvature) per waypoint
_ACTION_RMS_EPS = 1e-5  # fixed in upstream's action_in_proj encoder


@dataclass(frozen=True)
class ExpertConfig:
    """Sizes of the expert: the backbone text config with upstream's expert_cfg overrides."""

    hidden_size: int
    intermediate_size: int
    num_layers: int  # <= backbone layers: expert layer i reads backbone cache layer i
    num_heads: int  # query heads
    num_kv_heads: int  # must equal the backbone's, to read its cache
    head_dim: int  # must equal the backbone's
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)  # (t, h, w) frequency counts
    mrope_interleaved: bool = True  # Qwen3-VL layout; the chunked Qwen2-VL one is unsupported
    attention_bias: bool = False
    action_hidden_size: int = 1024  # width of the action_in_proj MLP
    num_fourier_feats: int = 20  # per encoded scalar (half sin, half cos)
    max_freq: float = 100.0  # highest Fourier frequency, cycles per unit input
    num_enc_layers: int = 4
    n_waypoints: int = 64

    def __post_init__(self) -> None:
        for name in (
            "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
            "head_dim", "action_hidden_size", "num_fourier_feats", "num_enc_layers",
            "n_waypoints",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads: {self.num_heads} is not a multiple of num_kv_heads"
                f" {self.num_kv_heads}"
            )
        if self.head_dim % 2 or self.num_fourier_feats % 2:
            raise ValueError(
                f"head_dim/num_fourier_feats: must be even, got {self.head_dim}/"
                f"{self.num_fourier_feats}"
            )
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(
                f"mrope_section: expected 3 sizes summing to head_dim/2 = {self.head_dim // 2},"
                f" got {self.mrope_section}"
            )
        if not self.mrope_interleaved:
            raise ValueError("mrope_interleaved: only Qwen3-VL's interleaved layout is supported")


class RMSNorm(nn.Module):
    """RMS norm computed in fp32 and cast back, as both Qwen3 and upstream's encoder do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm upcasts half inputs to fp32 and casts the result back: the same math as
        # the spelled-out version, in one fused kernel on CUDA.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


class FourierFeatures(nn.Module):
    """sqrt(2) [sin, cos](2 pi x f) for log-spaced f in [1, max_freq]; no weights.

    The frequencies are an unsaved buffer, so casting the module to bf16 rounds them (1.6681
    becomes 1.671875), exactly as upstream's bf16 load does; the product is still fp32.
    """

    def __init__(self, *, num_feats: int, max_freq: float) -> None:
        super().__init__()
        freqs = torch.logspace(0.0, math.log10(max_freq), num_feats // 2)
        self.freqs = nn.Buffer(freqs, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Encode x (...) in fp32 -> (..., num_feats)."""
        angle = x.float()[..., None] * self.freqs.float() * 2 * math.pi
        return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1) * math.sqrt(2)


class ActionEncoder(nn.Module):
    """MLP: Linear, SiLU, (num_layers - 1) x [RMSNorm, Linear, SiLU], RMSNorm, Linear."""

    def __init__(self, *, in_dim: int, hidden: int, out_dim: int, num_layers: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(in_dim, hidden), nn.SiLU()]
        for _ in range(num_layers - 1):
            layers += [RMSNorm(hidden, _ACTION_RMS_EPS), nn.Linear(hidden, hidden), nn.SiLU()]
        layers += [RMSNorm(hidden, _ACTION_RMS_EPS), nn.Linear(hidden, out_dim)]
        self.trunk = nn.Sequential(*layers)  # indices match upstream's trunk.{0..12} keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)


class ActionInProjection(nn.Module):
    """Embed a noisy action and its flow time as one expert input token per waypoint."""

    def __init__(self, config: ExpertConfig) -> None:
        super().__init__()
        self.fourier = FourierFeatures(
            num_feats=config.num_fourier_feats, max_freq=config.max_freq
        )
        in_dim = (ACTION_DIM + 1) * config.num_fourier_feats  # accel, curvature, t
        self.encoder = ActionEncoder(
            in_dim=in_dim,
            hidden=config.action_hidden_size,
            out_dim=config.hidden_size,
            num_layers=config.num_enc_layers,
        )
        self.norm = nn.LayerNorm(config.hidden_size)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Map x (N, W, 2) and t (N,) to embeddings (N, W, hidden) in the weights' dtype."""
        n_rows, n_waypoints, _ = x.shape
        time_feats = self.fourier(t)[:, None, :].expand(n_rows, n_waypoints, -1)
        feats = torch.cat([self.fourier(x[..., 0]), self.fourier(x[..., 1]), time_feats], dim=-1)
        weight = self.encoder.trunk[0].weight
        return self.norm(self.encoder(feats.to(weight.dtype)))


class MRotaryEmbedding(nn.Module):
    """Qwen3-VL interleaved M-RoPE: frequency j follows axis t, h or w by j mod 3."""

    def __init__(self, *, head_dim: int, theta: float, section: Sequence[int]) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.inv_freq = nn.Buffer(1.0 / (theta**exponent), persistent=False)
        self._inv_freq_fp32 = self.inv_freq.clone()  # master copy, see _apply
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        for dim in (1, 2):  # h on j = 1, 4, 7, ...; w on j = 2, 5, 8, ... (within 3 * section)
            stop = 3 * section[dim]
            axis[dim:stop:3] = dim
        self.axis_of_freq = nn.Buffer(axis, persistent=False)

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> nn.Module:
        # Follow device moves but not dtype casts: bf16 frequencies would shift every angle
        # (a transformers model loaded in bf16 also keeps them fp32).
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Return cos, sin (N, L, head_dim) in dtype for positions (3, N, L)."""
        picked = positions[self.axis_of_freq].permute(1, 2, 0)  # (N, L, half)
        angle = picked.float() * self.inv_freq
        angle = torch.cat([angle, angle], dim=-1)
        return angle.cos().to(dtype), angle.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _one_tensor_under(parts: Sequence[nn.Parameter], fused: torch.Tensor | None) -> torch.Tensor:
    """Return a tensor whose consecutive row slices the parameters `parts` are.

    That is `fused` if they already are its slices, else their concatenation, which the
    parameters are then re-pointed to (their old storage is freed: one copy, not two).
    """
    rows = [part.shape[0] for part in parts]
    if fused is not None:
        pieces = fused.split(rows)
        if all(part.data_ptr() == piece.data_ptr() for part, piece in zip(parts, pieces)):
            return fused
    fused = torch.cat([part.detach() for part in parts])
    for part, piece in zip(parts, fused.split(rows)):
        part.data = piece
    return fused


class ExpertAttention(nn.Module):
    """GQA self-attention whose keys are [backbone cache layer ; own tokens].

    The reference path (forward) projects with q_proj, k_proj and v_proj as upstream does;
    the fast path (forward_prepared) with one GEMM over their fused weight, of which their
    weights are views.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        bias: bool,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(head_dim, rms_norm_eps)
        self._qkv_rows = (q_dim, kv_dim, kv_dim)
        # Unsaved: the checkpoint keeps upstream's q/k/v_proj keys, whose tensors are slices.
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self._fuse_qkv()
        self.register_load_state_dict_post_hook(ExpertAttention._fuse_after_load)

    def _fuse_qkv(self) -> None:
        """Make the q/k/v_proj weights (and biases) row slices of one tensor, if not already.

        The fast path then projects with one GEMM instead of three (bench/EXPERT.md: 7.2 vs
        15.8 us a layer at full size) without a second copy of the weights, while module
        names, state_dict keys and load_state_dict (which copies into the slices) stay
        upstream's. Slices that are already tied keep their addresses, which captured CUDA
        graphs hold.
        """
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = _one_tensor_under([p.weight for p in projections], self.qkv_weight)
        if self.q_proj.bias is not None:
            self.qkv_bias = _one_tensor_under([p.bias for p in projections], self.qkv_bias)

    @staticmethod
    def _fuse_after_load(module: ExpertAttention, _keys: object) -> None:
        # load_state_dict(assign=True) replaces the parameters instead of copying into them.
        module._fuse_qkv()

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> nn.Module:
        # Casts and moves convert each parameter apart from the fused tensor: tie them again.
        super()._apply(fn, recurse)
        self._fuse_qkv()
        return self

    def __setstate__(self, state: dict) -> None:
        # deepcopy clones each parameter on its own.
        super().__setstate__(state)
        self._fuse_qkv()

    def _heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split projections (N, L, heads*D) into q (N, H, L, D), k, v (N, Hkv, L, D).

        q and k are normed and rotated; rope: cos, sin (N, 1, L, D).
        """
        n_rows, length, _ = q.shape
        q = self.q_norm(q.view(n_rows, length, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(n_rows, length, -1, self.head_dim)).transpose(1, 2)
        v = v.view(n_rows, length, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        folded_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attend q (N, H, L, Dk) to keys/values (N, Hkv, S, Dk); project (N, L, E) out."""
        n_rows, _, length, width = q.shape
        # GQA without copying K/V per query head: query heads sharing a kv head are stacked
        # along the query axis (N, Hkv, groups*L, Dk); a mask is shared by all heads.
        q = q.reshape(n_rows, self.num_kv_heads, -1, width)
        scale = self.head_dim**-0.5
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=folded_mask, scale=scale)
        out = out[..., : self.head_dim].reshape(n_rows, self.num_heads, length, self.head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(n_rows, length, -1))

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        past_key: torch.Tensor,
        past_value: torch.Tensor,
        folded_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Attend h (N, L, E) to the cache (N, Hkv, T, D) and to itself.

        folded_mask: (N, 1, groups*L, T+L) additive mask in h's dtype, the (N, 1, L, T+L)
        mask repeated once per query head sharing a kv head.
        """
        q, k, v = self._heads(self.q_proj(h), self.k_proj(h), self.v_proj(h), rope)
        k = torch.cat([past_key.to(k.dtype), k], dim=2)  # (N, Hkv, T+L, D)
        v = torch.cat([past_value.to(v.dtype), v], dim=2)
        return self._attend(q, k, v, folded_mask)

    def _fused_heads(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v heads of h from one GEMM over the fused weight (see _fuse_qkv)."""
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias).split(self._qkv_rows, dim=-1)
        return self._heads(*qkv, rope)

    def forward_prepared(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        keys: torch.Tensor,
        values: torch.Tensor,
        query_pad: torch.Tensor | None,
    ) -> torch.Tensor:
        """Write h's K/V into the last L columns of one ExpertState layer, then attend to it."""
        q, k, v = self._fused_heads(h, rope)
        length = h.shape[1]
        keys[:, :, -length:, : self.head_dim] = k
        values[:, :, -length:, : self.head_dim] = v
        if query_pad is not None:
            q = torch.cat([q, query_pad.expand(*q.shape[:-1], -1)], dim=-1)
        with sdpa_kernel(PREPARED_ATTENTION, set_priority=True):
            return self._attend(q, keys, values, None)


    def forward_shared(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        shared_keys: torch.Tensor,
        shared_values: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        own_bias: torch.Tensor,
    ) -> torch.Tensor:
        """forward_prepared over a shared ExpertState layer: every row attends to the one
        shared prefix (1, Hkv, S, D) and to its own columns (N, Hkv, C, D).

        The shared part runs as one attention call with all rows' queries stacked along
        the query axis, so the prefix is read once per layer, not once per row; the own part
        (reasoning + action columns, masked by own_bias) is small. The two softmaxes are
        joined exactly through their log-sum-exps.
        """
        q, k, v = self._fused_heads(h, rope)
        n_rows, _, length, head_dim = q.shape
        keys[:, :, -length:] = k
        values[:, :, -length:] = v
        scale = head_dim**-0.5
        q = q.reshape(n_rows, self.num_kv_heads, -1, head_dim)  # GQA folding, see _attend
        folded = q.shape[2]
        stacked = q.transpose(0, 1).reshape(1, self.num_kv_heads, n_rows * folded, head_dim)
        shared_out, shared_lse = attention_with_lse(stacked, shared_keys, shared_values, scale)
        shared_out = shared_out.reshape(self.num_kv_heads, n_rows, folded, head_dim).transpose(0, 1)
        shared_lse = shared_lse.reshape(self.num_kv_heads, n_rows, folded).transpose(0, 1)
        bias = own_bias.expand(n_rows, self.num_kv_heads, folded, -1)
        own_out, own_lse = attention_with_lse(q, keys, values, scale, bias)
        lse = torch.logaddexp(shared_lse, own_lse)
        out = shared_out.float() * torch.exp(shared_lse - lse)[..., None]
        out = out + own_out.float() * torch.exp(own_lse - lse)[..., None]
        out = out.to(h.dtype).reshape(n_rows, self.num_heads, length, head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(n_rows, length, -1))


def attention_with_lse(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (B, H, L, D) and the log-sum-exp of its scaled, biased scores (B, H, L) fp32.

    bias: additive, broadcast to (B, H, L, S), in q's dtype. On CUDA in half types, one fused
    kernel (flash without a bias, memory-efficient with one) that returns the log-sum-exp
    anyway; on the CPU flash without a bias; the spelled-out math in fp32 elsewhere.
    """
    half = q.dtype in (torch.float16, torch.bfloat16)
    if q.is_cuda and half and bias is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, False, False, scale=scale)[:2]
        return out, lse
    if q.is_cuda and half:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, keys, values, bias, True, scale=scale)[:2]
        return out, lse[..., : q.shape[2]]
    if q.device.type == "cpu" and bias is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, 0.0, False, scale=scale)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.float()
    return torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(q.dtype), torch.logsumexp(scores, dim=-1)


class ExpertMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, *, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertLayer(nn.Module):
    """Pre-norm decoder layer."""

    def __init__(self, config: ExpertConfig) -> None:
        super().__init__()
        self.self_attn = ExpertAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            rms_norm_eps=config.rms_norm_eps,
            bias=config.attention_bias,
        )
        self.mlp = ExpertMLP(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        past_key: torch.Tensor,
        past_value: torch.Tensor,
        folded_mask: torch.Tensor,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, past_key, past_value, folded_mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_prepared(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        keys: torch.Tensor,
        values: torch.Tensor,
        query_pad: torch.Tensor | None,
    ) -> torch.Tensor:
        attn = self.self_attn.forward_prepared(
            self.input_layernorm(h), rope, keys, values, query_pad
        )
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_shared(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        shared_keys: torch.Tensor,
        shared_values: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        own_bias: torch.Tensor,
    ) -> torch.Tensor:
        attn = self.self_attn.forward_shared(
            self.input_layernorm(h), rope, shared_keys, shared_values, keys, values, own_bias
        )
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class ExpertModel(nn.Module):
    """The decoder stack (upstream's `expert`: a Qwen3VLTextModel without embed_tokens)."""

    def __init__(self, config: ExpertConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(ExpertLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(
            head_dim=config.head_dim, theta=config.rope_theta, section=config.mrope_section
        )

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Run all layers; returns the final-normed hidden states (N, L, E).

        inputs_embeds (N, L, E); positions (3, N, L) M-RoPE ids; mask (N, 1, L, T+L) additive
        float (0 = attend); keys/values: per backbone layer (N, Hkv, T, D), rotated K.
        """
        cfg = self.config
        n_rows, length, _ = inputs_embeds.shape
        _check_cache_layers(cfg, keys, values, n_rows)
        expected = (n_rows, 1, length, keys[0].shape[2] + length)
        if tuple(mask.shape) != expected:
            raise ValueError(f"mask: expected {expected}, got {tuple(mask.shape)}")
        cos, sin = self.rotary_emb(positions, inputs_embeds.dtype)
        rope = (cos[:, None], sin[:, None])
        groups = cfg.num_heads // cfg.num_kv_heads
        folded_mask = mask.to(inputs_embeds.dtype).repeat(1, 1, groups, 1)  # see ExpertAttention
        h = inputs_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, keys[i], values[i], folded_mask)
        return self.norm(h)

    def forward_prepared(
        self,
        inputs_embeds: torch.Tensor,
        state: ExpertState,
        layer_step: LayerStep | None = None,
    ) -> torch.Tensor:
        """forward() over a prepared state: (N, W, E) embeddings -> final-normed hidden states.

        layer_step: prepared_layer_step (or a compiled twin), shared_layer_step for a shared
        state; None picks the plain one that fits the state.
        """
        rope = (state.cos, state.sin)
        h = inputs_embeds
        if state.shared_keys is None:
            step = layer_step or prepared_layer_step
            for layer, keys, values in zip(self.layers, state.keys, state.values):
                h = step(layer, h, rope, keys, values, state.query_pad)
        else:
            step = layer_step or shared_layer_step
            shared = zip(state.shared_keys, state.shared_values, state.keys, state.values)
            for layer, (shared_keys, shared_values, keys, values) in zip(self.layers, shared):
                h = step(layer, h, rope, shared_keys, shared_values, keys, values, state.own_bias)
        return self.norm(h)


def _check_cache_layers(
    config: ExpertConfig,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    n_rows: int,
) -> None:
    if len(keys) < config.num_layers or len(values) < config.num_layers:
        raise ValueError(
            f"keys/values: {len(keys)}/{len(values)} cache layers for {config.num_layers} expert"
            " layers"
        )
    expected = (n_rows, config.num_kv_heads, keys[0].shape[2], config.head_dim)
    if tuple(keys[0].shape) != expected or tuple(values[0].shape) != expected:
        raise ValueError(
            f"keys/values: expected layer shape {expected} (N, Hkv, T, D), got"
            f" {tuple(keys[0].shape)}/{tuple(values[0].shape)}"
        )


def _action_positions(cache: PrefixCache, n_tokens: int) -> torch.Tensor:
    """M-RoPE positions (3, N, n) int64: token j of row i sits at j + offset + rope_delta."""
    n_rows = cache.keys[0].shape[0]
    if tuple(cache.offsets.shape) != (n_rows,) or tuple(cache.rope_deltas.shape) != (n_rows,):
        raise ValueError(
            f"cache.offsets/rope_deltas: expected ({n_rows},), got"
            f" {tuple(cache.offsets.shape)}/{tuple(cache.rope_deltas.shape)}"
        )
    device = cache.keys[0].device
    start = cache.offsets.to(device=device, dtype=torch.long)
    start = start + cache.rope_deltas.to(device=device, dtype=torch.long)
    token = torch.arange(n_tokens, device=device)
    return (token[None, :] + start[:, None]).expand(3, n_rows, n_tokens)


def _blocked_prefix(cache: PrefixCache) -> torch.Tensor:
    """(N, T) bool: True on cache columns no action token may attend.

    Those are the columns [offset, T) (tokens other rows generated past their stop) and
    the ones where cache.valid is False.
    """
    n_rows, length, device = cache.rows, cache.length, cache.keys[0].device
    if tuple(cache.offsets.shape) != (n_rows,):
        raise ValueError(f"cache.offsets: expected ({n_rows},), got {tuple(cache.offsets.shape)}")
    if cache.valid is not None and tuple(cache.valid.shape) != (n_rows, length):
        expected = (n_rows, length)
        raise ValueError(f"cache.valid: expected {expected}, got {tuple(cache.valid.shape)}")
    offsets = cache.offsets.to(device=device, dtype=torch.long)
    blocked = torch.arange(length, device=device)[None, :] >= offsets[:, None]
    if cache.valid is not None:
        blocked |= ~cache.valid.to(device=device, dtype=torch.bool)
    return blocked


def build_positions_and_mask(cache: PrefixCache, n_tokens: int) -> tuple[torch.Tensor, ...]:
    """Return M-RoPE positions (3, N, n) int64 and the additive mask (N, 1, n, T+n) float32.

    Token j of row i sits at j + offsets[i] + rope_deltas[i] on all three axes, right after
    <|traj_future_start|>. The mask is finfo.min on cache columns [offset, T) (tokens other
    rows generated past their stop) and where cache.valid is False, else 0; the n action
    columns are open to every action token (bidirectional).
    """
    positions = _action_positions(cache, n_tokens)
    blocked = F.pad(_blocked_prefix(cache), (0, n_tokens))  # (N, T+n), action columns open
    n_rows, width = blocked.shape
    mask = torch.zeros(n_rows, 1, n_tokens, width, dtype=torch.float32, device=blocked.device)
    mask = mask.masked_fill(blocked[:, None, None, :], torch.finfo(torch.float32).min)
    return positions, mask


class ActionExpertModel(nn.Module):
    """Expert decoder plus the action projections in and out: the flow's velocity field."""

    def __init__(self, config: ExpertConfig) -> None:
        super().__init__()
        self.config = config
        self.expert = ExpertModel(config)
        self.action_in_proj = ActionInProjection(config)
        self.action_out_proj = nn.Linear(config.hidden_size, ACTION_DIM)
        count = sum(p.numel() for p in self.parameters())
        logger.info(f"action expert: {count / 1e6:.2f} M parameters, {config.num_layers} layers")

    def _check_action(self, x: torch.Tensor, t: torch.Tensor, n_rows: int) -> None:
        expected = (n_rows, self.config.n_waypoints, ACTION_DIM)
        if tuple(x.shape) != expected:
            raise ValueError(f"x: expected {expected} (cache rows), got {tuple(x.shape)}")
        if tuple(t.shape) != (n_rows,):
            raise ValueError(f"t: expected ({n_rows},), got {tuple(t.shape)}")

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cache: PrefixCache) -> torch.Tensor:
        """Predict the flow (N, 64, 2) for noisy actions x (N, 64, 2) at flow times t (N,).

        Free of host syncs, so the sampler loop can be captured in a CUDA graph as long as
        the cache tensors (incl. offsets, rope_deltas, valid) already live on the device.
        """
        self._check_action(x, t, cache.keys[0].shape[0])
        cache = cache.materialized()  # the reference reads every row's columns in full
        embeds = self.action_in_proj(x, t)
        positions, mask = build_positions_and_mask(cache, x.shape[1])
        hidden = self.expert(embeds, positions, mask, cache.keys, cache.values)
        return self.action_out_proj(hidden)

    def new_state(
        self, rows: int, capacity: int, *, masked: bool, shared: int | None = None
    ) -> ExpertState:
        """Zeroed ExpertState buffers: `rows` rows, `capacity` key columns (T + padding + W).

        With `shared`, a shared state: that many columns of common prefix, and `capacity` own
        columns per row (own tokens + padding + W), masked exactly (`masked` is not used).
        """
        cfg = self.config
        sizes = dict(
            rows=rows, capacity=capacity, n_tokens=cfg.n_waypoints, num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, like=self.expert.norm.weight,
        )
        if shared is None:
            return ExpertState.zeros(masked=masked, **sizes)
        return ExpertState.zeros_shared(shared=shared, **sizes)

    def load_state(self, state: ExpertState, caches: Sequence[PrefixCache]) -> None:
        """Fill `state` in place from `caches`, stacked along rows (conditional, route-free).

        One state serves any plan that fits: see ExpertState.load_rows.
        """
        cfg = self.config
        if state.shared_keys is not None:
            if len(caches) != 1 or caches[0].shared_keys is None:
                raise ValueError("caches: a shared state takes exactly one cache with a shared part")
            cache = caches[0]
            _check_cache_layers(cfg, cache.keys, cache.values, cache.rows)
            cos, sin = self.expert.rotary_emb(_action_positions(cache, cfg.n_waypoints), state.cos.dtype)
            state.load_shared(
                cache.shared_keys, cache.shared_values, cache.keys, cache.values, _blocked_prefix(cache),
                (cos[:, None], sin[:, None]),
            )
            return
        if any(cache.shared_keys is not None for cache in caches):
            raise ValueError("caches: one has a shared part; load it into a shared state (new_state(shared=...))")
        rows = sum(cache.keys[0].shape[0] for cache in caches)
        if rows != state.rows:
            raise ValueError(f"caches: {rows} rows in all for a state of {state.rows} rows")
        start = 0
        for cache in caches:
            n_rows = cache.keys[0].shape[0]
            _check_cache_layers(cfg, cache.keys, cache.values, n_rows)
            positions = _action_positions(cache, cfg.n_waypoints)
            cos, sin = self.expert.rotary_emb(positions, state.cos.dtype)
            rope = (cos[:, None], sin[:, None])
            state.load_rows(start, cache.keys, cache.values, _blocked_prefix(cache), rope)
            start += n_rows

    def prepare(self, cache: PrefixCache, *, capacity: int | None = None) -> ExpertState:
        """Copy `cache` once into a new ExpertState of `capacity` columns (default T + W).

        The state is masked only where something must be: padding, a stop gap or invalid
        columns. One sample without padding needs none, so attention runs unmasked (flash).
        """
        needed = cache.length + self.config.n_waypoints
        capacity = needed if capacity is None else capacity
        if cache.shared_keys is not None:
            own = capacity - cache.shared_length
            state = self.new_state(cache.rows, own, masked=False, shared=cache.shared_length)
        else:
            masked = capacity != needed or bool(_blocked_prefix(cache).any())
            state = self.new_state(cache.keys[0].shape[0], capacity, masked=masked)
        self.load_state(state, [cache])
        return state

    def velocity_prepared(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        state: ExpertState,
        *,
        layer_step: LayerStep | None = None,
    ) -> torch.Tensor:
        """velocity(x, t, cache) for the cache(s) loaded into `state`.

        Writes this call's action K/V into the state's last W columns; free of host syncs.
        """
        self._check_action(x, t, state.rows)
        embeds = self.action_in_proj(x, t)
        return self.action_out_proj(self.expert.forward_prepared(embeds, state, layer_step))
