"""How a PrefixCache becomes the action expert's inputs: where the action tokens sit (M-RoPE
positions), which prefix columns they may attend, the reference path's 4D mask, and the
checks of its layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from alpamayo_ros.core.backbone import PagedPrefix, PrefixCache


def check_cache_layers(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    *,
    n_rows: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Raise a ValueError naming keys/values unless they are >= num_layers (N, Hkv, T, D) layers."""
    if len(keys) < num_layers or len(values) < num_layers:
        raise ValueError(
            f"keys/values: {len(keys)}/{len(values)} cache layers for {num_layers} expert layers"
        )
    expected = (n_rows, num_kv_heads, keys[0].shape[2], head_dim)
    if tuple(keys[0].shape) != expected or tuple(values[0].shape) != expected:
        raise ValueError(
            f"keys/values: expected layer shape {expected} (N, Hkv, T, D), got"
            f" {tuple(keys[0].shape)}/{tuple(values[0].shape)}"
        )


def check_paged_layers(paged: PagedPrefix, *, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
    """Raise a ValueError naming cache.paged unless it has >= num_layers (blocks, bs, Hkv, D)
    layers (with a contiguous last dim on CUDA, which FlashAttention needs)."""
    if len(paged.key_blocks) < num_layers or len(paged.value_blocks) < num_layers:
        raise ValueError(f"cache.paged: {len(paged.key_blocks)} cache layers for {num_layers} expert layers")
    blocks = paged.key_blocks[0]
    if blocks.ndim != 4 or tuple(blocks.shape[2:]) != (num_kv_heads, head_dim) or (
        blocks.is_cuda and blocks.stride(-1) != 1
    ):
        raise ValueError(
            f"cache.paged: expected blocks (blocks, block_size, {num_kv_heads}, {head_dim}), got"
            f" {tuple(blocks.shape)} strides {blocks.stride()}"
        )


def action_positions(cache: PrefixCache, n_tokens: int) -> torch.Tensor:
    """M-RoPE positions (3, N, n) int64: token j of row i sits at j + offset + rope_delta."""
    n_rows = cache.rows
    if tuple(cache.offsets.shape) != (n_rows,) or tuple(cache.rope_deltas.shape) != (n_rows,):
        raise ValueError(
            f"cache.offsets/rope_deltas: expected ({n_rows},), got"
            f" {tuple(cache.offsets.shape)}/{tuple(cache.rope_deltas.shape)}"
        )
    device = cache.device
    start = cache.offsets.to(device=device, dtype=torch.long)
    start = start + cache.rope_deltas.to(device=device, dtype=torch.long)
    token = torch.arange(n_tokens, device=device)
    return (token[None, :] + start[:, None]).expand(3, n_rows, n_tokens)


def blocked_prefix(cache: PrefixCache) -> torch.Tensor:
    """(N, T) bool: True on cache columns no action token may attend.

    Those are the columns [offset, T) (tokens other rows generated past their stop) and
    the ones where cache.valid is False.
    """
    n_rows, length, device = cache.rows, cache.length, cache.device
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
    positions = action_positions(cache, n_tokens)
    blocked = F.pad(blocked_prefix(cache), (0, n_tokens))  # (N, T+n), action columns open
    n_rows, width = blocked.shape
    mask = torch.zeros(n_rows, 1, n_tokens, width, dtype=torch.float32, device=blocked.device)
    mask = mask.masked_fill(blocked[:, None, None, :], torch.finfo(torch.float32).min)
    return positions, mask
