"""Where an expert layer's queries find their keys: the three K/V sources of ExpertAttention.

ExpertAttention projects and rotates q, k, v once and hands them to a K/V source, which stores
the action tokens' K/V where it keeps the prefix and attends:

- `ConcatKV`, the reference (upstream's append-then-crop): the backbone cache layer is
  concatenated with the action K/V on every call and masked by an additive 4D mask, in the
  plainest SDPA call; the tests' and benches' oracle.
- `PagedKV`, the fast path over a copied cache: one layer of an ExpertState (expert_state.py),
  each row's K/V in blocks of PAGE tokens of its own, and each row's used length given; the
  action K/V are written into their slots in place. On an H100/H200 with vLLM's
  FlashAttention-3 at hand, one varlen FA3 call reads the blocks where they lie (no mask: a
  row's length cuts its padding, stop gap and spare columns off); elsewhere the rows are
  attended with a length mask (same numbers, slower).
- `BlockTableKV`, the fast path over K/V a paged engine holds (vLLM's cache, read where it
  lies, never written): the prefix through the engine's own block table, the action tokens'
  K/V as they come. With FA3, two calls (the paged prefix, then the action tokens) joined
  through their log-sum-exps, as vLLM's cascade attention joins its two parts; elsewhere each
  row's prefix blocks are gathered, the action K/V appended, and attended exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: Tokens per K/V block of an ExpertState (FA3 reads paged K/V in blocks of this size).
PAGE = 16

_FA3: Any = None  # vllm_flash_attn's varlen entry point, once looked up
_FA3_SCHEDULE: Any = None  # ... and its scheduler-metadata function
_FA3_CHECKED = False


def fa3_varlen() -> Any:
    """vLLM's FlashAttention-3 varlen function, or None where it cannot run (logged once)."""
    global _FA3, _FA3_SCHEDULE, _FA3_CHECKED
    if not _FA3_CHECKED:
        _FA3_CHECKED = True
        reason = None
        try:
            from vllm.vllm_flash_attn.flash_attn_interface import (
                flash_attn_varlen_func,
                fa_version_unsupported_reason,
                get_scheduler_metadata,
                is_fa_version_supported,
            )

            if torch.cuda.is_available() and is_fa_version_supported(3):
                _FA3, _FA3_SCHEDULE = flash_attn_varlen_func, get_scheduler_metadata
            else:
                reason = fa_version_unsupported_reason(3) if torch.cuda.is_available() else "no CUDA device"
        except ImportError as error:
            reason = f"vllm.vllm_flash_attn not importable ({error})"
        if reason is not None:
            logger.info(f"expert attention: FlashAttention-3 unavailable ({reason}); gathered K/V + SDPA")
    return _FA3


def fa3_splits(queries: int) -> int:
    """FA3's num_splits for a call over this many query rows: one split per tile from 512 on
    (16 rows' 1,024 queries fill the SMs), else FA3's own heuristic (bench/EXPERT.md: 93.7
    against 100.2 us at 16 rows, 19.7 either way at 1 row)."""
    return 1 if queries >= 512 else 0


def _write_slots(k_blocks: torch.Tensor, v_blocks: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The action tokens' K/V (N*L, Hkv, D) into their slots of the flattened blocks."""
    k_blocks.view(-1, *k_blocks.shape[2:])[slots] = k
    v_blocks.view(-1, *v_blocks.shape[2:])[slots] = v


def _as_rows(blocks: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Blocks of rows that share none, as one (N, width*PAGE, Hkv, D) batch (see paged_attention)."""
    return blocks[: rows * width].view(rows, width * PAGE, *blocks.shape[2:])


@torch.library.custom_op("alpamayo::fa3_paged_attention", mutates_args=("k_blocks", "v_blocks"))
def _fa3_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    slots: torch.Tensor,
    width: int,
    lengths: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    num_splits: int,
) -> torch.Tensor:
    # Opaque to torch.compile, the slot writes included: traced, the writes into the blocks made
    # inductor copy the whole blocks twice per layer (8 ms a 1-row call on an H200), and FA3's
    # own op has no fake implementation to trace with.
    _write_slots(k_blocks, v_blocks, slots, k, v)
    rows = lengths.shape[0]
    return _FA3(
        q, _as_rows(k_blocks, rows, width), _as_rows(v_blocks, rows, width), q.shape[0] // rows, cu_seqlens_q,
        width * PAGE, seqused_k=lengths, softmax_scale=scale, fa_version=3, num_splits=num_splits,
    )


@_fa3_paged_attention.register_fake
def _(q, k, v, k_blocks, v_blocks, slots, width, lengths, cu_seqlens_q, scale, num_splits):
    return torch.empty_like(q)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    slots: torch.Tensor,
    width: int,
    lengths: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write the action K/V k, v (N*L, Hkv, D) into `slots`, then attend q (N*L, H, D), L
    queries per row, to each row's first lengths[n] paged keys.

    k_blocks/v_blocks: (blocks, PAGE, Hkv, D), row n's blocks n*width .. (n+1)*width - 1 in
    order (rows share none), read as one (N, width*PAGE, Hkv, D) batch (FA3 runs faster that
    way than through a block table: bench/EXPERT.md); lengths: (N,) int32. Returns (N*L, H, D).
    """
    rows = lengths.shape[0]
    queries = q.shape[0] // rows
    # _FA3, not fa3_varlen(): this runs inside torch.compile, which must not trace the import;
    # ExpertState.zeros looks FA3 up on a CUDA device before any state is attended.
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _FA3 is not None:
        return _fa3_paged_attention(
            q, k, v, k_blocks, v_blocks, slots, width, lengths, cu_seqlens_q, scale, fa3_splits(q.shape[0])
        )
    _write_slots(k_blocks, v_blocks, slots, k, v)
    kv_heads, head_dim = k_blocks.shape[2:]
    k_blocks, v_blocks = _as_rows(k_blocks, rows, width), _as_rows(v_blocks, rows, width)
    heads = q.shape[1]
    folded = q.view(rows, queries, heads, head_dim).transpose(1, 2).reshape(rows, kv_heads, -1, head_dim)
    keys, values = k_blocks.transpose(1, 2), v_blocks.transpose(1, 2)  # (N, Hkv, width*PAGE, D)
    if q.device.type == "cpu":
        # Never graphed here, so each row attends to exactly its keys: SDPA's CPU kernel rounds
        # differently with trailing masked columns, and without them a row gives the reference's
        # result bit for bit (a chaotic 10-step flow amplifies any rounding ~400x a step).
        out = torch.cat([
            F.scaled_dot_product_attention(folded[n : n + 1], keys[n : n + 1, :, :used], values[n : n + 1, :, :used], scale=scale)
            for n, used in enumerate(lengths.tolist())
        ])
    else:
        blocked = torch.arange(width * PAGE, device=q.device)[None, :] >= lengths[:, None].long()
        bias = torch.zeros(rows, 1, 1, width * PAGE, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(blocked[:, None, None, :], torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(rows, heads, queries, head_dim).transpose(1, 2).reshape(rows * queries, heads, head_dim)


@dataclass
class PagedKV:
    """One layer of an ExpertState as seen by ExpertAttention (see the module docstring).

    width: blocks per row; slots: (N*L,) int64, where the action tokens' K/V go in the
    flattened blocks.
    """

    k_blocks: torch.Tensor
    v_blocks: torch.Tensor
    width: int
    lengths: torch.Tensor
    slots: torch.Tensor
    cu_seqlens_q: torch.Tensor

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (N, L, H, D), k/v (N, L, Hkv, D) of the action tokens -> (N, L, H, D)."""
        rows, length, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        out = paged_attention(
            q.reshape(rows * length, heads, head_dim), k.reshape(-1, kv_heads, head_dim),
            v.reshape(-1, kv_heads, head_dim), self.k_blocks, self.v_blocks, self.slots,
            self.width, self.lengths, self.cu_seqlens_q, head_dim**-0.5,
        )
        return out.view(rows, length, heads, head_dim)


@dataclass
class ConcatKV:
    """One backbone cache layer for the reference path: past K/V (N, Hkv, T, D) and the
    additive mask folded for GQA, (N, 1, groups*L, T+L) in the model dtype."""

    past_key: torch.Tensor
    past_value: torch.Tensor
    folded_mask: torch.Tensor

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (N, L, H, D), k/v (N, L, Hkv, D) -> (N, L, H, D), the action K/V appended."""
        rows, length, heads, head_dim = q.shape
        keys = torch.cat([self.past_key.to(k.dtype), k.transpose(1, 2)], dim=2)  # (N, Hkv, T+L, D)
        values = torch.cat([self.past_value.to(v.dtype), v.transpose(1, 2)], dim=2)
        # GQA without copying K/V per query head: the query heads sharing a kv head are stacked
        # along the query axis, and the mask is shared by all of them.
        folded = q.transpose(1, 2).reshape(rows, keys.shape[1], -1, head_dim)
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=self.folded_mask, scale=head_dim**-0.5)
        return out.reshape(rows, heads, length, head_dim).transpose(1, 2)


@torch.library.custom_op("alpamayo::fa3_block_table_attention", mutates_args=())
def _fa3_block_table_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    num_splits: int,
    schedule: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Opaque to torch.compile (FA3's op has no fake implementation to trace with). The two
    # parts come out unmerged, so inductor fuses the merge into one kernel: run eagerly in
    # here, its dozen elementwise kernels cost 8.5 ms a 1-row call on an H100 (20 ms at 16 rows).
    rows, width = block_table.shape
    queries = q.shape[0] // rows
    prefix, prefix_lse = _FA3(
        q, key_blocks, value_blocks, queries, cu_seqlens_q, width * key_blocks.shape[1], seqused_k=lengths,
        block_table=block_table, softmax_scale=scale, return_softmax_lse=True, fa_version=3, num_splits=num_splits,
        scheduler_metadata=schedule,
    )
    own, own_lse = _FA3(
        q, k, v, queries, cu_seqlens_q, queries, cu_seqlens_k=cu_seqlens_q, softmax_scale=scale,
        return_softmax_lse=True, fa_version=3,
    )
    return prefix, prefix_lse, own, own_lse


@_fa3_block_table_attention.register_fake
def _(q, k, v, key_blocks, value_blocks, block_table, lengths, cu_seqlens_q, scale, num_splits, schedule):
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)  # (H, T), as FA3's varlen
    return torch.empty_like(q), lse, torch.empty_like(q), torch.empty_like(lse)


def _merge(first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor) -> torch.Tensor:
    """Softmax attention over two key sets from each one's output (T, H, D) and log-sum-exp (H, T)."""
    first_lse, second_lse = first_lse.t()[..., None], second_lse.t()[..., None]  # (T, H, 1)
    top = torch.maximum(first_lse, second_lse)
    first_weight, second_weight = (first_lse - top).exp(), (second_lse - top).exp()
    merged = (first.float() * first_weight + second.float() * second_weight) / (first_weight + second_weight)
    return merged.to(first.dtype)


def block_table_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    schedule: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend q (N*L, H, D), L queries per row, to row n's first lengths[n] paged keys and to
    the row's own L action keys k, v (N*L, Hkv, D); the blocks are only read.

    key_blocks/value_blocks: (blocks, block_size, Hkv, D), any strides but the last;
    block_table: (N, W) int32; lengths: (N,) int32; schedule: block_table_schedule's for these
    (FA3 then skips making its own). Returns (N*L, H, D).
    """
    rows, width = block_table.shape
    queries = q.shape[0] // rows
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _FA3 is not None:
        return _merge(*_fa3_block_table_attention(
            q, k, v, key_blocks, value_blocks, block_table, lengths, cu_seqlens_q, scale, fa3_splits(q.shape[0]),
            schedule,
        ))
    block_size, kv_heads, head_dim = key_blocks.shape[1:]
    heads = q.shape[1]
    folded = q.view(rows, queries, heads, head_dim).transpose(1, 2).reshape(rows, kv_heads, -1, head_dim)
    own_k, own_v = k.view(rows, queries, kv_heads, head_dim), v.view(rows, queries, kv_heads, head_dim)
    if q.device.type == "cpu":
        # Each row over exactly its keys, in the reference's order (see paged_attention).
        outs = []
        for n, used in enumerate(lengths.tolist()):
            ids = block_table[n, : -(-used // block_size)].long()
            keys = torch.cat([key_blocks[ids].flatten(0, 1)[:used], own_k[n]])  # (used + L, Hkv, D)
            values = torch.cat([value_blocks[ids].flatten(0, 1)[:used], own_v[n]])
            outs.append(F.scaled_dot_product_attention(
                folded[n : n + 1], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], scale=scale
            ))
        out = torch.cat(outs)
    else:
        table = block_table.long()
        keys = torch.cat([key_blocks[table].flatten(1, 2), own_k], dim=1).transpose(1, 2)  # (N, Hkv, W*bs+L, D)
        values = torch.cat([value_blocks[table].flatten(1, 2), own_v], dim=1).transpose(1, 2)
        columns = torch.arange(keys.shape[2], device=q.device)[None, :]
        blocked = (columns >= lengths[:, None].long()) & (columns < width * block_size)
        bias = torch.zeros(rows, 1, 1, keys.shape[2], dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(blocked[:, None, None, :], torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(rows, heads, queries, head_dim).transpose(1, 2).reshape(rows * queries, heads, head_dim)


def block_table_schedule(
    block_table: torch.Tensor, lengths: torch.Tensor, cu_seqlens_q: torch.Tensor, *, queries: int,
    query_heads: int, key_blocks: torch.Tensor,
) -> torch.Tensor | None:
    """FA3's tile schedule for block_table_attention's paged-prefix call over these rows, made
    once per plan: without it every layer's call of every flow step makes the same one in a
    kernel of its own (720 per 1-row plan). None where that call does not run FA3.

    queries: per row (L); query_heads: H; key_blocks: one layer's (blocks, block_size, Hkv, D).
    """
    dtype = key_blocks.dtype
    if _FA3_SCHEDULE is None or not key_blocks.is_cuda or dtype not in (torch.float16, torch.bfloat16):
        return None
    rows, width = block_table.shape
    block_size, kv_heads, head_dim = key_blocks.shape[1:]
    return _FA3_SCHEDULE(
        batch_size=rows, max_seqlen_q=queries, max_seqlen_k=width * block_size, num_heads_q=query_heads,
        num_heads_kv=kv_heads, headdim=head_dim, cache_seqlens=lengths, qkv_dtype=dtype, cu_seqlens_q=cu_seqlens_q,
        page_size=block_size, causal=False, num_splits=fa3_splits(rows * queries),
    )


@dataclass
class BlockTableKV:
    """One layer of a BlockTableState (expert_state.py) as seen by ExpertAttention."""

    key_blocks: torch.Tensor
    value_blocks: torch.Tensor
    block_table: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens_q: torch.Tensor
    schedule: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (N, L, H, D), k/v (N, L, Hkv, D) of the action tokens -> (N, L, H, D)."""
        rows, length, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        out = block_table_attention(
            q.reshape(rows * length, heads, head_dim), k.reshape(-1, kv_heads, head_dim),
            v.reshape(-1, kv_heads, head_dim), self.key_blocks, self.value_blocks, self.block_table,
            self.lengths, self.cu_seqlens_q, head_dim**-0.5, self.schedule,
        )
        return out.view(rows, length, heads, head_dim)
