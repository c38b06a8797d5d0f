"""The per-plan state the action expert's fast path writes into.

`ActionExpertModel.prepare(cache)` copies a prefix cache once into an ExpertState: K/V buffers
with spare columns for the W action tokens, plus the action tokens' RoPE. Each flow step then
rewrites only those W columns (`velocity_prepared`). This module owns the buffers' layout
(prefix, padding, action columns, mask channels); the model only projects and attends.

It imports nothing from expert.py, so the model can build and fill states without an
import cycle; the layer type below is for annotations only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

if TYPE_CHECKING:
    from alpamayo_ros.core.expert import ExpertLayer

#: Extra query/key channels that carry the mask of a masked ExpertState. Flash attention takes
#: no mask, but q.k over [q, 1, 0, ...] and [k, bias, 0, ...] adds `bias` to every score of
#: that key: 0 where attended, the dtype's minimum where blocked. 8 keeps the head size a
#: multiple of 8, as flash kernels need.
MASK_CHANNELS = 8

#: SDPA backends of the prepared path, in order of preference. Flash first: its split-KV
#: kernel spreads 8 kv heads x 256 folded queries over all SMs; the cuDNN kernel PyTorch
#: prefers on Hopper took twice as long on an H200 (bench/EXPERT.md: 23 vs 46 us a layer).
PREPARED_ATTENTION = [
    SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


@dataclass
class ExpertState:
    """Attention inputs of one plan, in buffers of which each step rewrites only W columns.

    keys/values: per expert layer (N, Hkv, C, Dk). Columns [0, T) hold the prefix cache,
        [C - W, C) the current step's action tokens, [T, C - W) padding; C (capacity) may
        exceed T + W, so one state (and one CUDA graph) serves plans of many lengths.
    cos/sin: (N, 1, W, D) RoPE of the action tokens, in the model dtype.
    query_pad: None if nothing is masked (Dk = D). Else the row [1, 0, ...] of MASK_CHANNELS
        appended to every query; Dk = D + MASK_CHANNELS and keys[..., D] is the mask bias.

    A shared state (samples of one prompt, see PrefixCache.shared_keys) keeps the common
    prefix once: shared_keys/shared_values per layer (1, Hkv, S, D), exactly S columns, so
    nothing there needs a mask (query_pad is None). keys/values are then (N, Hkv, C, D),
    each row's own columns, padding and action columns, masked by own_bias (N, 1, 1, C) in
    the model dtype (0 = attended, else the dtype's minimum).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    query_pad: torch.Tensor | None
    shared_keys: list[torch.Tensor] | None = None
    shared_values: list[torch.Tensor] | None = None
    own_bias: torch.Tensor | None = None

    @classmethod
    def zeros(
        cls,
        *,
        rows: int,
        capacity: int,
        n_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        masked: bool,
        like: torch.Tensor,
    ) -> ExpertState:
        """Zeroed buffers for `rows` rows and `capacity` key columns, on like's device/dtype.

        Zeros, not empty memory: padding columns get zero attention weight, and 0 * NaN would
        still poison the output.
        """
        if rows < 1:
            raise ValueError(f"rows: must be >= 1, got {rows}")
        if capacity <= n_tokens:
            raise ValueError(f"capacity: must exceed {n_tokens} action tokens, got {capacity}")
        factory = {"device": like.device, "dtype": like.dtype}
        width = head_dim + (MASK_CHANNELS if masked else 0)
        shape = (rows, num_kv_heads, capacity, width)
        rope_shape = (rows, 1, n_tokens, head_dim)
        query_pad = None
        if masked:
            query_pad = torch.zeros(MASK_CHANNELS, **factory)
            query_pad[0] = 1.0
        return cls(
            keys=[torch.zeros(shape, **factory) for _ in range(num_layers)],
            values=[torch.zeros(shape, **factory) for _ in range(num_layers)],
            cos=torch.zeros(rope_shape, **factory),
            sin=torch.zeros(rope_shape, **factory),
            query_pad=query_pad,
        )

    @classmethod
    def zeros_shared(
        cls,
        *,
        rows: int,
        shared: int,
        capacity: int,
        n_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        like: torch.Tensor,
    ) -> ExpertState:
        """Zeroed buffers of a shared state (see the class doc) for a prefix of `shared` columns."""
        if shared < 1:
            raise ValueError(f"shared: must be >= 1, got {shared}")
        state = cls.zeros(
            rows=rows, capacity=capacity, n_tokens=n_tokens, num_layers=num_layers,
            num_kv_heads=num_kv_heads, head_dim=head_dim, masked=False, like=like,
        )
        factory = {"device": like.device, "dtype": like.dtype}
        shape = (1, num_kv_heads, shared, head_dim)
        state.shared_keys = [torch.zeros(shape, **factory) for _ in range(num_layers)]
        state.shared_values = [torch.zeros(shape, **factory) for _ in range(num_layers)]
        state.own_bias = torch.zeros(rows, 1, 1, capacity, **factory)
        return state

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def shared_length(self) -> int:
        return 0 if self.shared_keys is None else self.shared_keys[0].shape[2]

    def load_shared(
        self,
        shared_keys: Sequence[torch.Tensor],
        shared_values: Sequence[torch.Tensor],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        blocked: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Write a shared-prefix cache: its S common columns once, each row's own columns.

        shared_*: per layer (1, Hkv, S, D); keys/values: per layer (N, Hkv, T - S, D);
        blocked: (N, T) bool as in load_rows, which must leave the common columns open.
        """
        if self.shared_keys is None:
            raise ValueError("state: not a shared state; allocate it with new_state(..., shared=...)")
        shared = shared_keys[0].shape[2]
        n_rows, _, length, _ = keys[0].shape
        n_tokens = self.cos.shape[2]
        spare = self.capacity - n_tokens
        if shared != self.shared_length or length > spare:
            raise ValueError(
                f"cache: {shared} shared + {length} own tokens do not fit the state's"
                f" {self.shared_length} shared + {spare} own columns"
            )
        if n_rows != self.rows:
            raise ValueError(f"cache: {n_rows} rows for a state of {self.rows} rows")
        if bool(blocked[:, :shared].any()):
            raise ValueError("cache: a shared column is blocked for some row (offset or valid inside the shared part)")
        own_blocked = F.pad(blocked[:, shared:], (0, self.capacity - length))
        own_blocked[:, length:spare] = True  # padding
        self.own_bias.zero_().masked_fill_(own_blocked[:, None, None, :], torch.finfo(self.own_bias.dtype).min)
        layers = zip(self.shared_keys, self.shared_values, self.keys, self.values, shared_keys, shared_values, keys, values)
        for state_sk, state_sv, state_k, state_v, sk, sv, k, v in layers:
            state_sk.copy_(sk)
            state_sv.copy_(sv)
            state_k[:, :, :length] = k
            state_v[:, :, :length] = v
        self.cos[:], self.sin[:] = rope

    def load_rows(
        self,
        start: int,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        blocked: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Write one cache into rows [start, start + N): its prefix, mask and action RoPE.

        keys/values: per layer (N, Hkv, T, D), extra layers ignored; blocked: (N, T) bool,
        True on prefix columns no action token may attend; rope: cos, sin (N, 1, W, D).
        Rewrites every prefix column and the whole mask channel, so what an earlier, longer
        plan left in the padding is masked out.
        """
        n_rows, _, length, head_dim = keys[0].shape
        n_tokens = self.cos.shape[2]
        spare = self.capacity - n_tokens  # prefix columns + padding
        if length > spare:
            raise ValueError(
                f"cache: {length} tokens + {n_tokens} action tokens exceed the state's"
                f" capacity {self.capacity}"
            )
        rows_at = slice(start, start + n_rows)
        bias = None
        if self.query_pad is not None:
            dtype = self.cos.dtype
            blocked = F.pad(blocked, (0, self.capacity - length))
            blocked[:, length:spare] = True  # padding
            bias = torch.zeros(n_rows, 1, self.capacity, dtype=dtype, device=blocked.device)
            bias = bias.masked_fill(blocked[:, None, :], torch.finfo(dtype).min)
        elif length != spare or bool(blocked.any()):
            raise ValueError(
                "state: unmasked, but this cache needs a mask (padding, stop gap or invalid"
                " columns); allocate it with new_state(..., masked=True)"
            )
        for state_keys, state_values, cache_keys, cache_values in zip(
            self.keys, self.values, keys, values
        ):
            state_keys[rows_at, :, :length, :head_dim] = cache_keys
            state_values[rows_at, :, :length, :head_dim] = cache_values
            if bias is not None:
                state_keys[rows_at, :, :, head_dim] = bias
        self.cos[rows_at], self.sin[rows_at] = rope


def prepared_layer_step(
    layer: ExpertLayer,
    h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    keys: torch.Tensor,
    values: torch.Tensor,
    query_pad: torch.Tensor | None,
) -> torch.Tensor:
    """One layer over one ExpertState layer.

    A plain function of the layer, so that one torch.compile of it serves every layer (they
    differ only in weights); see ExpertModel.forward_prepared.
    """
    return layer.forward_prepared(h, rope, keys, values, query_pad)


def shared_layer_step(
    layer: ExpertLayer,
    h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    shared_keys: torch.Tensor,
    shared_values: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    own_bias: torch.Tensor,
) -> torch.Tensor:
    """One layer over one shared ExpertState layer (see prepared_layer_step)."""
    return layer.forward_shared(h, rope, shared_keys, shared_values, keys, values, own_bias)


#: prepared_layer_step or a compiled twin of it (same arguments).
LayerStep = Callable[..., torch.Tensor]
