"""Readers of vLLM's paged K/V cache, one per attention-backend layout.

vLLM's cache layout differs by backend and CPU ISA and is not a public interface: the
layout is detected by feature (backend name, cache shape, ISA), never by version string,
and an unknown layout raises instead of returning wrong K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Packed logical layout (blocks, kv_heads, block_size, 2*head_dim), K first: every GPU
# backend of vLLM 0.26/0.27 that stores plain (unquantised) K/V this way.
_PACKED_GPU_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER")
# CPU_ATTN ISAs whose block stores K column-major [head_dim, block] then V row-major
# [block, head_dim] (csrc/cpu/cpu_attn_vec.hpp; vec16 inherits it). AMX/NEON/... differ.
_CPU_COLUMN_MAJOR_K_ISAS = ("vec", "vec16")


@dataclass(frozen=True)
class CacheLayout:
    """How one layer's paged cache tensor stores K and V.

    kind: "packed" = logical (blocks, H, block_size, 2*D) with K in [..., :D];
        "cpu_kt" = the same shape but each (block, head) holds K as [D, block_size]
        followed by V as [block_size, D].
    """

    kind: str
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per kernel block (may divide the scheduler's block size)


def detect_layout(
    backend_name: str,
    cpu_isa: str | None,
    cache: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    model_dtype: torch.dtype,
) -> CacheLayout:
    """Pick the reader for one layer, or raise naming what is not supported."""
    if cache.dtype != model_dtype:
        raise ValueError(
            f"kv cache dtype {cache.dtype} != model dtype {model_dtype}: quantised KV caches "
            "are not supported by the capture (leave kv_cache_dtype at 'auto')"
        )
    shape_ok = cache.ndim == 4 and cache.shape[1] == num_kv_heads and cache.shape[3] == 2 * head_dim
    if not shape_ok:
        raise ValueError(
            f"kv cache of backend {backend_name}: shape {tuple(cache.shape)} is not "
            f"(blocks, {num_kv_heads}, block_size, {2 * head_dim}); unknown layout"
        )
    if backend_name == "CPU_ATTN":
        if cpu_isa not in _CPU_COLUMN_MAJOR_K_ISAS:
            raise ValueError(f"CPU_ATTN isa {cpu_isa!r}: cache layout not verified (known: {_CPU_COLUMN_MAJOR_K_ISAS})")
        return CacheLayout("cpu_kt", num_kv_heads, head_dim, cache.shape[2])
    if backend_name in _PACKED_GPU_BACKENDS:
        return CacheLayout("packed", num_kv_heads, head_dim, cache.shape[2])
    known = ", ".join(("CPU_ATTN", *_PACKED_GPU_BACKENDS))
    raise ValueError(f"attention backend {backend_name!r}: no cache layout reader (known: {known})")


def block_views(cache: torch.Tensor, layout: CacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's cache as (num_blocks, block_size, H, D) views: no copy.

    Only the last dim is contiguous in the GPU layout; in the CPU one K's token axis is (each
    block's K is stored [D, block_size]). Readers index blocks through these views, where the
    engine keeps them.
    """
    H, bs, D = layout.num_kv_heads, layout.block_size, layout.head_dim
    if layout.kind == "packed":
        tokens = cache.transpose(1, 2)  # (blocks, bs, H, 2D)
        return tokens[..., :D], tokens[..., D:]
    if layout.kind == "cpu_kt":
        flat = cache.view(cache.shape[0], H, 2 * bs * D)  # a view, never a copy
        k = flat[..., : bs * D].unflatten(-1, (D, bs)).permute(0, 3, 1, 2)  # (blocks, bs, H, D)
        v = flat[..., bs * D :].unflatten(-1, (bs, D)).transpose(1, 2)
        return k, v
    raise ValueError(f"layout.kind: unknown {layout.kind!r}")


def read_blocks(
    cache: torch.Tensor, layout: CacheLayout, kernel_block_ids: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each (num_tokens, H, D), of the tokens stored in these blocks, in order.

    The results never alias the paged cache (the blocks are reused once freed).
    """
    k, v = block_views(cache, layout)
    H, D = layout.num_kv_heads, layout.head_dim
    keys = k.index_select(0, kernel_block_ids).reshape(-1, H, D)[:num_tokens]  # copies
    values = v.index_select(0, kernel_block_ids).reshape(-1, H, D)[:num_tokens]
    return keys, values
