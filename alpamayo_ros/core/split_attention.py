"""The expert's attention over a paged prefix and its own keys in one Triton launch.

A 1-row plan attends 64 action queries x 32 heads to ~3,200 prefix keys in each of 360
layer-steps: too little work per kv head to fill the SMs, so the call is bound by fixed costs.
FA3 (expert_attention.block_table_attention) spends two calls on it (the paged prefix, then
the action tokens' own keys), a scheduling kernel and a merge. Here one launch does it all:

- the query heads that share a kv head are packed along a tile's rows (GQA), so each key tile
  is loaded once for all of them;
- the prefix is cut into `splits` chunks attended by separate programs, and the own keys make
  one chunk more;
- every program leaves its chunk's unnormalised output, running maximum and sum (base 2) in a
  workspace; the last program of a (row, kv head, query tile) to finish (an atomic ticket)
  merges them and writes the output, then resets the ticket, so a CUDA graph can replay it.

On the CPU the kernel runs only under Triton's interpreter (TRITON_INTERPRET=1, set before
Triton is imported), which the tests use; expert_attention's CPU path stays the exact one.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

#: query rows (packed query x group pairs) and keys per tile, and warps per program: with 8
#: warps ptxas (Triton 3.6, sm_90) compiles the 64 x 64 tiles without spilling registers
BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 8

_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@triton.jit
def _attend_tile(q, k, v, valid, acc, running_max, running_sum, scale_log2, IEEE: tl.constexpr):
    """One key tile into the running softmax state, in base 2 (scores scaled by scale*log2(e))."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    alpha = tl.exp2(running_max - new_max)
    p = tl.exp2(scores - new_max[:, None])
    running_sum = running_sum * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, new_max, running_sum


@triton.jit
def _split_attention_kernel(
    q_ptr, own_k_ptr, own_v_ptr, key_blocks_ptr, value_blocks_ptr, table_ptr, lengths_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, tickets_ptr,
    scale_log2, chunk,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_ok_t, stride_ok_h, stride_ov_t, stride_ov_h,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_table,
    QUERIES: tl.constexpr, GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SPLITS: tl.constexpr, M_TILES: tl.constexpr, OWN_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)  # (row, kv head, query tile)
    split = tl.program_id(1)  # prefix chunks 0 .. SPLITS-1, then the own keys
    row = tile // (KV_HEADS * M_TILES)
    kv_head = (tile // M_TILES) % KV_HEADS
    packed = (tile % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = packed < QUERIES * GROUP
    token = row * QUERIES + packed // GROUP
    head = kv_head * GROUP + packed % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=in_rows[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    if split < SPLITS:
        start = split * chunk
        end = tl.minimum(start + chunk, tl.load(lengths_ptr + row))
        for first in range(start, end, BLOCK_N):
            cols = first + tl.arange(0, BLOCK_N)
            valid = cols < end
            block = tl.load(table_ptr + row * stride_table + cols // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            slot = cols % PAGE_SIZE
            k = tl.load(key_blocks_ptr + (block * stride_kb + slot * stride_ks + kv_head * stride_kh)[:, None]
                        + dims[None, :] * stride_kd, mask=valid[:, None], other=0.0)
            v = tl.load(value_blocks_ptr + (block * stride_vb + slot * stride_vs + kv_head * stride_vh)[:, None]
                        + dims[None, :] * stride_vd, mask=valid[:, None], other=0.0)
            acc, running_max, running_sum = _attend_tile(q, k, v, valid, acc, running_max, running_sum, scale_log2, IEEE)
    else:
        cols = tl.arange(0, OWN_BLOCK)
        valid = cols < QUERIES
        own = row * QUERIES + cols
        k = tl.load(own_k_ptr + (own * stride_ok_t + kv_head * stride_ok_h)[:, None] + dims[None, :],
                    mask=valid[:, None], other=0.0)
        v = tl.load(own_v_ptr + (own * stride_ov_t + kv_head * stride_ov_h)[:, None] + dims[None, :],
                    mask=valid[:, None], other=0.0)
        acc, running_max, running_sum = _attend_tile(q, k, v, valid, acc, running_max, running_sum, scale_log2, IEEE)

    local = tl.arange(0, BLOCK_M)
    part = tile * (SPLITS + 1) + split
    tl.store(part_acc_ptr + part * BLOCK_M * HEAD_DIM + local[:, None] * HEAD_DIM + dims[None, :], acc)
    tl.store(part_max_ptr + part * BLOCK_M + local, running_max)
    tl.store(part_sum_ptr + part * BLOCK_M + local, running_sum)
    tl.debug_barrier()  # every thread's partial stored before the ticket releases them
    ticket = tl.atomic_add(tickets_ptr + tile, 1, sem="acq_rel")
    if ticket == SPLITS:  # the last program of this tile: merge the chunks
        first_part = tile * (SPLITS + 1)
        # loops, not unrolled: unrolled, every chunk's partial was loaded at once and spilled
        total_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for s in range(SPLITS + 1):
            total_max = tl.maximum(total_max, tl.load(part_max_ptr + (first_part + s) * BLOCK_M + local, cache_modifier=".cg"))
        merged = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        total_sum = tl.zeros([BLOCK_M], tl.float32)
        for s in range(SPLITS + 1):
            part_max = tl.load(part_max_ptr + (first_part + s) * BLOCK_M + local, cache_modifier=".cg")
            weight = tl.exp2(part_max - total_max)  # 0 for an empty chunk (max -inf)
            total_sum += weight * tl.load(part_sum_ptr + (first_part + s) * BLOCK_M + local, cache_modifier=".cg")
            part_acc = tl.load(part_acc_ptr + (first_part + s) * BLOCK_M * HEAD_DIM + local[:, None] * HEAD_DIM
                               + dims[None, :], cache_modifier=".cg")
            merged += weight[:, None] * part_acc
        merged = merged / total_sum[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
                 merged.to(out_ptr.dtype.element_ty), mask=in_rows[:, None])
        tl.atomic_xchg(tickets_ptr + tile, 0)  # ready for the next launch (graph replays)


def default_splits(rows: int, kv_heads: int, m_tiles: int, device: torch.device) -> int:
    """Prefix chunks per tile so that the programs about fill the SMs once (at least one)."""
    programs = rows * kv_heads * m_tiles
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 128
    return max(1, round(sms / programs) - 1)


def _workspace(tiles: int, splits: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The partials and tickets of one launch shape, made once: the tickets start at zero and each
    launch leaves them there, so a captured graph replays without a memset."""
    key = (device, tiles, splits, head_dim)
    if key not in _WORKSPACES:
        parts = tiles * (splits + 1)
        _WORKSPACES[key] = (
            torch.empty(parts, BLOCK_M, head_dim, device=device, dtype=torch.float32),
            torch.empty(parts, BLOCK_M, device=device, dtype=torch.float32),
            torch.empty(parts, BLOCK_M, device=device, dtype=torch.float32),
            torch.zeros(tiles, device=device, dtype=torch.int32),
        )
    return _WORKSPACES[key]


@torch.library.custom_op("alpamayo::split_attention", mutates_args=())
def split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int = 0,
) -> torch.Tensor:
    """Attend q (N*L, H, D), L queries per row, to row n's first lengths[n] paged keys and to
    the row's own L keys k, v (N*L, Hkv, D), as expert_attention.block_table_attention does.

    key_blocks/value_blocks: (blocks, block_size, Hkv, D), any strides; block_table:
    (N, W) int32; lengths: (N,) int32, each at most W * block_size; splits: prefix chunks per
    tile (default_splits when 0). Returns (N*L, H, D) in q's dtype. A custom op: opaque to
    torch.compile, the launch keeps a workspace of its own.
    """
    rows, width = block_table.shape
    tokens, heads, head_dim = q.shape
    page_size, kv_heads = key_blocks.shape[1:3]
    if tokens % rows or heads % kv_heads:
        raise ValueError(f"q: {tokens} tokens x {heads} heads do not divide into {rows} rows x {kv_heads} kv heads")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q/k/v: the head dimension must be contiguous")
    queries, group = tokens // rows, heads // kv_heads
    m_tiles = -(-queries * group // BLOCK_M)
    if splits < 1:
        splits = default_splits(rows, kv_heads, m_tiles, q.device)
    per_split = -(-width * page_size // splits)
    chunk = -(-per_split // BLOCK_N) * BLOCK_N  # whole key tiles; chunks past a row's length do nothing
    tiles = rows * kv_heads * m_tiles
    part_acc, part_max, part_sum, tickets = _workspace(tiles, splits, head_dim, q.device)
    out = torch.empty_like(q)
    _split_attention_kernel[(tiles, splits + 1)](
        q, k, v, key_blocks, value_blocks, block_table, lengths, out, part_acc, part_max, part_sum, tickets,
        scale * math.log2(math.e), chunk,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *key_blocks.stride(), *value_blocks.stride(),
        block_table.stride(0),
        QUERIES=queries, GROUP=group, KV_HEADS=kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size, SPLITS=splits,
        M_TILES=m_tiles, OWN_BLOCK=max(16, triton.next_power_of_2(queries)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


@split_attention.register_fake
def _(q, k, v, key_blocks, value_blocks, block_table, lengths, scale, splits=0):
    return torch.empty_like(q)
