"""The action expert: a Qwen3-VL text decoder that denoises 64 action tokens.

It has no token embeddings: the noisy action is projected to 64 input embeddings, and every
expert layer i attends to backbone cache layer i (prompt + reasoning) plus the 64 action
tokens, bidirectionally. Module names mirror upstream's checkpoint keys (`expert.*`,
`action_in_proj.*`, `action_out_proj.*`) so its state_dict loads 1:1.

One forward per module; where the keys come from is the K/V source's business
(expert_attention.py). `velocity(x, t, cache)` is the reference: the cache and the action K/V
concatenated on every call, masked (upstream's append-then-crop; the tests' and benches'
oracle). The fast path copies a plain cache once into a paged ExpertState (expert_state.py,
`prepare` / `load_state`), and `velocity_prepared(x, t, state)` then writes only the action
tokens' K/V per step; a paged cache (K/V an engine holds) only gets block tables
(BlockTableState) and is read where it lies. They agree within float rounding; the cache is
never mutated.

`quantize_fp8()` gives every layer's projections FP8 copies (fp8_linear.py), which both paths
then multiply with; the full-precision weights stay (state_dict, a later re-quantisation).

Over 400 lines: one class per architectural unit (rope, attention with its fused QKV, MLP,
layer, model, action expert), composed upward in the order of upstream's checkpoint keys, and
the loading of the two fast-path states; the input side and the prefix bookkeeping already
live in expert_action.py and expert_prefix.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from alpamayo_ros.core.backbone import PrefixCache
from alpamayo_ros.core.expert_action import ACTION_DIM, ActionInProjection, RMSNorm
from alpamayo_ros.core.expert_attention import ConcatKV
from alpamayo_ros.core.expert_prefix import (
    action_positions,
    blocked_prefix,
    build_positions_and_mask,
    check_cache_layers,
    check_paged_layers,
)
from alpamayo_ros.core.expert_state import BlockTableState, ExpertState
from alpamayo_ros.core.fp8_linear import Fp8Linear

logger = logging.getLogger(__name__)



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


class _RowTied(nn.Module):
    """A module whose projections in each group of `_tied` are row slices of one tensor.

    One GEMM over the fused tensor then computes the whole group (bench/EXPERT.md: q/k/v in
    7.2 against 15.8 us a layer at full size) without a second copy of the weights, while
    module names, state_dict keys and load_state_dict (which copies into the slices) stay
    upstream's. Slices that are already tied keep their addresses, which captured CUDA graphs
    hold. Subclasses call `_register_ties()` once their projections exist.
    """

    #: (name of the fused tensors, the nn.Linear projections they hold, in row order)
    _tied: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def _register_ties(self) -> None:
        # Unsaved buffers: the checkpoint keeps upstream's keys, whose tensors are slices.
        for fused, _ in self._tied:
            self.register_buffer(f"{fused}_weight", None, persistent=False)
            self.register_buffer(f"{fused}_bias", None, persistent=False)
        self._tie()
        self.register_load_state_dict_post_hook(_RowTied._tie_after_load)

    def _tie(self) -> None:
        """Make each group's weights (and biases) row slices of one tensor, if not already."""
        for fused, names in self._tied:
            projections = [getattr(self, name) for name in names]
            weight = _one_tensor_under([p.weight for p in projections], getattr(self, f"{fused}_weight"))
            setattr(self, f"{fused}_weight", weight)
            if projections[0].bias is not None:
                bias = _one_tensor_under([p.bias for p in projections], getattr(self, f"{fused}_bias"))
                setattr(self, f"{fused}_bias", bias)

    @staticmethod
    def _tie_after_load(module: _RowTied, _keys: object) -> None:
        # load_state_dict(assign=True) replaces the parameters instead of copying into them.
        module._tie()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # Casts and moves convert each parameter apart from the fused tensor: tie them again.
        super()._apply(fn, recurse)
        self._tie()
        return self

    def __setstate__(self, state: dict) -> None:
        # deepcopy clones each parameter on its own.
        super().__setstate__(state)
        self._tie()


class ExpertAttention(_RowTied):
    """GQA self-attention whose keys are [backbone cache layer ; own tokens].

    q, k and v come from one GEMM over the fused weight, of which upstream's q/k/v_proj
    weights are views; the K/V source (ConcatKV or PagedKV) stores the new K/V and attends.
    """

    _tied = (("qkv", ("q_proj", "k_proj", "v_proj")),)

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
        self.qkv_fp8: Fp8Linear | None = None  # FP8 copies (quantize_fp8), used when set
        self.o_fp8: Fp8Linear | None = None
        self._register_ties()

    def quantize_fp8(self, name: str, kernel: str) -> None:
        """FP8 copies of the fused q/k/v weight (one GEMM) and of o_proj's; name: this module's."""
        self.qkv_fp8 = Fp8Linear(self.qkv_weight, self.qkv_bias, name=f"{name}.qkv_proj", kernel=kernel)
        self.o_fp8 = Fp8Linear(self.o_proj.weight, self.o_proj.bias, name=f"{name}.o_proj", kernel=kernel)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVSource) -> torch.Tensor:
        """Attend h (N, L, E) to kv's keys and to itself; rope: cos, sin (N, L, 1, D)."""
        n_rows, length, _ = h.shape
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias) if self.qkv_fp8 is None else self.qkv_fp8(h)
        q, k, v = qkv.split(self._qkv_rows, dim=-1)
        q = self.q_norm(q.view(n_rows, length, -1, self.head_dim))  # (N, L, H, D)
        k = self.k_norm(k.view(n_rows, length, -1, self.head_dim))
        v = v.view(n_rows, length, -1, self.head_dim)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = kv.attend(q, k, v).reshape(n_rows, length, -1)
        return self.o_proj(out) if self.o_fp8 is None else self.o_fp8(out)


class KVSource(Protocol):
    """Where a layer's keys are: stores the action tokens' K/V and attends (expert_attention.py)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (N, L, H, D), k/v (N, L, Hkv, D) -> (N, L, H, D)."""


#: layer_step(layer, h, rope, kv) -> h: runs one layer; torch.compile of one such function
#: serves every layer (they differ only in weights, which are its inputs).
LayerStep = Callable[["ExpertLayer", torch.Tensor, tuple[torch.Tensor, torch.Tensor], KVSource], torch.Tensor]


def layer_step(layer: ExpertLayer, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVSource) -> torch.Tensor:
    """One layer: the plain step, and what ExpertSampler compiles."""
    return layer(h, rope, kv)


class ExpertMLP(_RowTied):
    """SwiGLU feed-forward; gate and up as one GEMM (their weights are views of one tensor)."""

    _tied = (("gate_up", ("gate_proj", "up_proj")),)

    def __init__(self, *, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_fp8: Fp8Linear | None = None
        self.down_fp8: Fp8Linear | None = None
        self._register_ties()

    def quantize_fp8(self, name: str, kernel: str) -> None:
        """FP8 copies of the fused gate+up weight (one GEMM) and of down's; name: this module's."""
        self.gate_up_fp8 = Fp8Linear(self.gate_up_weight, None, name=f"{name}.gate_up_proj", kernel=kernel)
        self.down_fp8 = Fp8Linear(self.down_proj.weight, None, name=f"{name}.down_proj", kernel=kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_fp8 is None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate, up = self.gate_up_fp8(x).chunk(2, dim=-1)
        return self.down_fp8(F.silu(gate) * up)


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

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVSource) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, kv)
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
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_layers: Sequence[KVSource],
        step: LayerStep = layer_step,
    ) -> torch.Tensor:
        """Run all layers; returns the final-normed hidden states (N, L, E).

        inputs_embeds (N, L, E); rope: cos, sin (N, L, 1, D); kv_layers: one K/V source per
        layer; step: layer_step or a compiled twin of it.
        """
        h = inputs_embeds
        for layer, kv in zip(self.layers, kv_layers, strict=True):
            h = step(layer, h, rope, kv)
        return self.norm(h)

    def _check_layers(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], n_rows: int) -> None:
        cfg = self.config
        check_cache_layers(
            keys, values, n_rows=n_rows, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        )

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, L, 1, D) in dtype for M-RoPE positions (3, N, L): broadcast over heads."""
        cos, sin = self.rotary_emb(positions, dtype)
        return cos[:, :, None], sin[:, :, None]

    def reference_inputs(
        self,
        positions: torch.Tensor,
        mask: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        dtype: torch.dtype,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], list[ConcatKV]]:
        """forward()'s rope and K/V sources for upstream's inputs (the reference path).

        positions (3, N, L) M-RoPE ids; mask (N, 1, L, T+L) additive float (0 = attend);
        keys/values: per backbone layer (N, Hkv, T, D), rotated K.
        """
        cfg = self.config
        self._check_layers(keys, values, mask.shape[0])
        expected = (mask.shape[0], 1, positions.shape[2], keys[0].shape[2] + positions.shape[2])
        if tuple(mask.shape) != expected:
            raise ValueError(f"mask: expected {expected}, got {tuple(mask.shape)}")
        folded_mask = mask.to(dtype).repeat(1, 1, cfg.num_heads // cfg.num_kv_heads, 1)  # see ConcatKV
        kv_layers = [ConcatKV(k, v, folded_mask) for k, v in zip(keys[: cfg.num_layers], values[: cfg.num_layers])]
        return self.rope(positions, dtype), kv_layers


class ActionExpertModel(nn.Module):
    """Expert decoder plus the action projections in and out: the flow's velocity field."""

    def __init__(self, config: ExpertConfig) -> None:
        super().__init__()
        self.config = config
        self.expert = ExpertModel(config)
        self.action_in_proj = ActionInProjection(
            num_fourier_feats=config.num_fourier_feats, max_freq=config.max_freq,
            action_hidden_size=config.action_hidden_size, hidden_size=config.hidden_size,
            num_enc_layers=config.num_enc_layers,
        )
        self.action_out_proj = nn.Linear(config.hidden_size, ACTION_DIM)
        count = sum(p.numel() for p in self.parameters())
        logger.info(f"action expert: {count / 1e6:.2f} M parameters, {config.num_layers} layers")

    def _check_action(self, x: torch.Tensor, t: torch.Tensor, n_rows: int) -> None:
        expected = (n_rows, self.config.n_waypoints, ACTION_DIM)
        if tuple(x.shape) != expected:
            raise ValueError(f"x: expected {expected} (cache rows), got {tuple(x.shape)}")
        if tuple(t.shape) != (n_rows,):
            raise ValueError(f"t: expected ({n_rows},), got {tuple(t.shape)}")

    def quantize_fp8(self, kernel: str = "auto") -> None:
        """Give every layer's projections FP8 copies of their weights (fp8_linear.py), which
        every path then multiplies with; kernel: fp8_linear.KERNELS. The action projections stay
        full precision (a fraction of a percent of the weights). The copies are a snapshot of
        the weights on their current device: call again after changing or moving them."""
        for i, layer in enumerate(self.expert.layers):
            layer.self_attn.quantize_fp8(f"expert.layers.{i}.self_attn", kernel)
            layer.mlp.quantize_fp8(f"expert.layers.{i}.mlp", kernel)
        first = self.expert.layers[0].mlp.down_fp8
        logger.info(f"action expert: FP8 layer weights ({first.kernel})")

    @torch.no_grad()
    def dequantized(self) -> ActionExpertModel:
        """A copy without FP8 copies whose projection weights are this expert's FP8 weights,
        dequantised, in float32: the exact reference of the FP8 expert (tests, parity benches).
        Not for Marlin layers, which keep only their repacked weights."""
        if self.fp8_kernel is None:
            raise RuntimeError("dequantized: this expert has no FP8 copies (quantize_fp8)")
        twin = ActionExpertModel(self.config).to(self.expert.norm.weight.device)
        twin.load_state_dict(self.state_dict())
        twin.float().eval()
        for source, target in zip(self.expert.layers, twin.expert.layers):
            attn, mlp = target.self_attn, target.mlp
            for projection, weight in zip((attn.q_proj, attn.k_proj, attn.v_proj),
                                          source.self_attn.qkv_fp8.dequantized().split(attn._qkv_rows)):  # fmt: skip
                projection.weight.copy_(weight)
            attn.o_proj.weight.copy_(source.self_attn.o_fp8.dequantized())
            gate, up = source.mlp.gate_up_fp8.dequantized().chunk(2)
            mlp.gate_proj.weight.copy_(gate)
            mlp.up_proj.weight.copy_(up)
            mlp.down_proj.weight.copy_(source.mlp.down_fp8.dequantized())
        return twin

    @property
    def fp8_kernel(self) -> str | None:
        """The FP8 copies' kernel, None without them."""
        first = self.expert.layers[0].mlp.down_fp8
        return None if first is None else first.kernel

    def _rope(self, cache: PrefixCache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.expert.rope(action_positions(cache, self.config.n_waypoints), dtype)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cache: PrefixCache) -> torch.Tensor:
        """Predict the flow (N, 64, 2) for noisy actions x (N, 64, 2) at flow times t (N,).

        The reference path; free of host syncs.
        """
        n_rows = cache.rows
        self._check_action(x, t, n_rows)
        cache = cache.materialized()  # the reference reads every row's columns in full
        self.expert._check_layers(cache.keys, cache.values, n_rows)
        embeds = self.action_in_proj(x, t)
        positions, mask = build_positions_and_mask(cache, x.shape[1])
        rope, kv_layers = self.expert.reference_inputs(positions, mask, cache.keys, cache.values, embeds.dtype)
        hidden = self.expert(embeds, rope, kv_layers)
        return self.action_out_proj(hidden)

    def new_state(self, rows: int, capacity: int) -> ExpertState:
        """Zeroed ExpertState: `rows` rows of `capacity` key columns (kept prefix columns
        + padding + W action tokens)."""
        cfg = self.config
        return ExpertState.zeros(
            rows=rows, capacity=capacity, n_tokens=cfg.n_waypoints, num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, like=self.expert.norm.weight,
        )

    def new_paged_state(self, rows: int, width: int, cache: PrefixCache) -> BlockTableState:
        """Empty BlockTableState of `rows` rows of up to `width` blocks over a paged cache's blocks."""
        if cache.paged is None:
            raise ValueError("cache: not paged (new_state copies a plain cache)")
        cfg = self.config
        check_paged_layers(cache.paged, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        layers = cfg.num_layers
        return BlockTableState.zeros(
            rows=rows, width=width, n_tokens=cfg.n_waypoints, key_blocks=cache.paged.key_blocks[:layers],
            value_blocks=cache.paged.value_blocks[:layers], dtype=self.expert.norm.weight.dtype,
            query_heads=cfg.num_heads,
        )

    def load_state(self, state: ExpertState | BlockTableState, caches: Sequence[PrefixCache]) -> None:
        """Fill `state` in place from `caches`, stacked along rows (conditional, route-free).

        An ExpertState takes plain caches; a BlockTableState paged caches over its blocks. One
        host sync per cache: which columns each row keeps.
        """
        rows = sum(cache.rows for cache in caches)
        if rows != state.rows:
            raise ValueError(f"caches: {rows} rows in all for a state of {state.rows} rows")
        if isinstance(state, BlockTableState):
            self._load_paged(state, caches)
            return
        if any(cache.paged is not None for cache in caches):
            raise ValueError("caches: one is paged; load it into a new_paged_state")
        start = 0
        for cache in caches:
            self.expert._check_layers(cache.keys, cache.values, cache.rows)
            keep = ~blocked_prefix(cache).cpu()
            state.load(start, cache.keys, cache.values, keep, self._rope(cache, state.cos.dtype))
            start += cache.rows

    def _load_paged(self, state: BlockTableState, caches: Sequence[PrefixCache]) -> None:
        start = 0
        for cache in caches:
            if cache.paged is None or not state.reads(cache.paged.key_blocks):
                raise ValueError("caches: a BlockTableState takes paged caches over its own blocks")
            keep = ~blocked_prefix(cache).cpu()
            kept = keep.sum(dim=1)
            if not bool((keep == (torch.arange(cache.length)[None, :] < kept[:, None])).all()):
                raise ValueError("cache: a paged row must keep a leading run of its columns (offset, valid)")
            state.load(start, cache.paged.block_table, kept, self._rope(cache, state.cos.dtype))
            start += cache.rows
        state.schedule_attention()

    def prepare(self, cache: PrefixCache, *, capacity: int | None = None) -> ExpertState | BlockTableState:
        """The state `cache` is attended through: a paged cache's block tables (BlockTableState,
        capacity ignored), else a copy in a new ExpertState of `capacity` columns per row
        (default the cache's columns + W)."""
        if cache.paged is not None:
            state = self.new_paged_state(cache.rows, cache.paged.block_table.shape[1], cache)
            self.load_state(state, [cache])
            return state
        capacity = cache.length + self.config.n_waypoints if capacity is None else capacity
        state = self.new_state(cache.rows, capacity)
        self.load_state(state, [cache])
        return state

    def velocity_prepared(
        self, x: torch.Tensor, t: torch.Tensor, state: ExpertState | BlockTableState, *, step: LayerStep = layer_step
    ) -> torch.Tensor:
        """velocity(x, t, cache) for the cache(s) loaded into `state`.

        Writes this call's action K/V into the state's slots; free of host syncs.
        """
        self._check_action(x, t, state.rows)
        embeds = self.action_in_proj(x, t)
        hidden = self.expert(embeds, (state.cos, state.sin), state.layers(), step)
        return self.action_out_proj(hidden)
