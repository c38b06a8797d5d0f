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


def read_blocks(
    cache: torch.Tensor, layout: CacheLayout, kernel_block_ids: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each (num_tokens, H, D), of the tokens stored in these blocks, in order.

    The results never alias the paged cache (the blocks are reused once freed).
    """
    n, H, bs, D = kernel_block_ids.numel(), layout.num_kv_heads, layout.block_size, layout.head_dim
    if layout.kind == "packed":
        blocks = cache.index_select(0, kernel_block_ids)  # (n, H, bs, 2D)
        tokens = blocks.permute(0, 2, 1, 3).reshape(n * bs, H, 2 * D)[:num_tokens]  # a copy
        return tokens[..., :D], tokens[..., D:]
    if layout.kind == "cpu_kt":
        flat = cache.reshape(cache.shape[0], H, 2 * bs * D).index_select(0, kernel_block_ids)
        k = flat[..., : bs * D].reshape(n, H, D, bs).permute(0, 3, 1, 2)  # (n, bs, H, D)
        v = flat[..., bs * D :].reshape(n, H, bs, D).permute(0, 2, 1, 3)
        return k.reshape(n * bs, H, D)[:num_tokens], v.reshape(n * bs, H, D)[:num_tokens]  # copies
    raise ValueError(f"layout.kind: unknown {layout.kind!r}")
