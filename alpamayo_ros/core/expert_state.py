"""The per-plan states the action expert's fast path attends over: paged K/V and a block table.

Two kinds: ExpertState holds a copy of a plain (contiguous) prefix cache in blocks of its own;
BlockTableState holds only block tables into K/V a paged engine keeps (PrefixCache.paged,
vLLM's cache), read in place, and the action tokens' K/V stay apart (BlockTableKV).

ExpertState:

`ActionExpertModel.prepare(cache)` (or a sampler's persistent state, refilled per plan by
`load_state`) copies a prefix cache once into blocks of PAGE tokens per layer, each row owning
`own_blocks` consecutive blocks; each flow step then writes only the W action tokens' K/V into
their slots and attends through PagedKV (expert_attention.py), with no mask: a row's keys are
its blocks in order, of which the first `lengths[n]` count: its kept prefix columns, then its
W action tokens. Columns no action token may attend (a stop gap, padding, invalid columns) are
simply not copied, so nothing needs masking, and the capacity beyond a row's length is never
read: one state (and one CUDA graph) serves every plan that fits it, whatever its prefix length.

The states' tensors keep their addresses across loads (a captured graph holds them); load_*
rewrites their contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from alpamayo_ros.core.expert_attention import PAGE, BlockTableKV, PagedKV, block_table_schedule, fa3_varlen


@dataclass
class ExpertState:
    """Paged K/V of one plan's rows (see the module docstring).

    k_blocks/v_blocks: per expert layer (N * own_blocks, PAGE, Hkv, D), row n's blocks
        n * own_blocks .. (n + 1) * own_blocks - 1.
    lengths: (N,) int32 keys per row (action tokens included); slots: (N*W,) int64, the
        action tokens' flat slots. cu_seqlens_q: (N+1,) int32, W queries per row.
    cos/sin: (N, W, 1, D) action-token RoPE.
    capacity: key columns each row may use (its kept columns, the W action tokens, padding).
    """

    k_blocks: list[torch.Tensor]
    v_blocks: list[torch.Tensor]
    lengths: torch.Tensor
    slots: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    capacity: int

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
        like: torch.Tensor,
    ) -> ExpertState:
        """Zeroed buffers for `rows` rows of `capacity` key columns.

        Zeros, not empty memory: the attention never reads past a row's length, but a NaN
        left in a block would still surface in a gathered fallback's masked product.
        """
        if rows < 1:
            raise ValueError(f"rows: must be >= 1, got {rows}")
        if capacity <= n_tokens:
            raise ValueError(f"capacity: must exceed {n_tokens} action tokens, got {capacity}")
        if like.is_cuda:
            fa3_varlen()  # looked up (and logged) once, outside any compiled region
        factory = {"device": like.device, "dtype": like.dtype}
        shape = (rows * -(-capacity // PAGE), PAGE, num_kv_heads, head_dim)
        ints = {"device": like.device, "dtype": torch.int32}
        return cls(
            k_blocks=[torch.zeros(shape, **factory) for _ in range(num_layers)],
            v_blocks=[torch.zeros(shape, **factory) for _ in range(num_layers)],
            lengths=torch.zeros(rows, **ints),
            slots=torch.zeros(rows * n_tokens, device=like.device, dtype=torch.long),
            cu_seqlens_q=torch.arange(0, rows * n_tokens + 1, n_tokens, **ints),
            cos=torch.zeros(rows, n_tokens, 1, head_dim, **factory),
            sin=torch.zeros(rows, n_tokens, 1, head_dim, **factory),
            capacity=capacity,
        )

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.cos.shape[1]

    @property
    def own_blocks(self) -> int:
        return self.k_blocks[0].shape[0] // self.rows

    def layers(self) -> list[PagedKV]:
        """Per expert layer, the K/V source ExpertAttention attends through."""
        meta = (self.own_blocks, self.lengths, self.slots, self.cu_seqlens_q)
        return [PagedKV(k, v, *meta) for k, v in zip(self.k_blocks, self.v_blocks)]

    def _own_columns(self, rows_at: slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, rows_at's blocks as flat (rows, own_blocks*PAGE, Hkv, D) views."""
        first, last = rows_at.start * self.own_blocks, rows_at.stop * self.own_blocks
        views = []
        for k_blocks, v_blocks in zip(self.k_blocks, self.v_blocks):
            _, _, kv_heads, head_dim = k_blocks.shape
            flat = (-1, self.own_blocks * PAGE, kv_heads, head_dim)
            views.append((k_blocks[first:last].view(flat), v_blocks[first:last].view(flat)))
        return views

    def load(
        self,
        start: int,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        keep: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Write one cache into rows [start, start + N): its kept columns, lengths and RoPE.

        keys/values: per layer (N, Hkv, T, D) (extra layers ignored); keep: (N, T) bool on the
        host, the columns action tokens attend; rope: cos, sin (N, W, 1, D). Host-side
        bookkeeping only decides where columns go; the copies are one per layer unless a row
        keeps columns with gaps between them.
        """
        n_rows, _, length, _ = keys[0].shape
        if start + n_rows > self.rows:
            raise ValueError(f"cache: rows {start}..{start + n_rows - 1} beyond the state's {self.rows} rows")
        kept = keep.sum(dim=1)
        if int(kept.max()) + self.n_tokens > self.capacity:
            raise ValueError(
                f"cache: {int(kept.max())} kept columns + {self.n_tokens} action tokens exceed the"
                f" state's capacity {self.capacity}"
            )
        rows_at = slice(start, start + n_rows)
        # One copy per layer when every row keeps a leading run of columns (the stop gap and
        # padding are trailing) and all of them fit; else row by row, kept columns only.
        contiguous = length <= self.own_blocks * PAGE and bool(
            (keep == (torch.arange(length)[None, :] < kept[:, None])).all()
        )
        for layer, (k_own, v_own) in enumerate(self._own_columns(rows_at)):
            for flat, source in ((k_own, keys[layer]), (v_own, values[layer])):
                columns = source.transpose(1, 2)  # (N, T, Hkv, D)
                if contiguous:
                    flat[:, :length] = columns
                    continue
                for row in range(n_rows):
                    index = keep[row].nonzero()[:, 0].to(columns.device)
                    flat[row, : index.numel()] = columns[row].index_select(0, index)
        own_start = torch.arange(start, start + n_rows) * self.own_blocks
        slots = (own_start * PAGE + kept)[:, None] + torch.arange(self.n_tokens)
        device = self.lengths.device
        self.lengths[rows_at] = (kept + self.n_tokens).to(device=device, dtype=torch.int32)
        self.slots[start * self.n_tokens : (start + n_rows) * self.n_tokens] = slots.reshape(-1).to(device)
        self.cos[rows_at], self.sin[rows_at] = rope


@dataclass
class BlockTableState:
    """Block tables into a paged engine's K/V for one plan's rows (see the module docstring).

    key_blocks/value_blocks: per expert layer, the engine's (blocks, block_size, Hkv, D) views;
    block_table: (N, W) int32, each row's blocks in order; lengths: (N,) int32, the prefix keys
    each row attends (its kept columns, a leading run); cu_seqlens_q: (N+1,) int32, L queries
    per row (the action tokens); cos/sin: (N, L, 1, D) their RoPE; query_heads: the expert's;
    schedule: FA3's schedule of the loaded rows (schedule_attention), None without FA3.
    """

    key_blocks: list[torch.Tensor]
    value_blocks: list[torch.Tensor]
    block_table: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    query_heads: int
    schedule: torch.Tensor | None = None

    @classmethod
    def zeros(
        cls,
        *,
        rows: int,
        width: int,
        n_tokens: int,
        key_blocks: Sequence[torch.Tensor],
        value_blocks: Sequence[torch.Tensor],
        dtype: torch.dtype,
        query_heads: int,
    ) -> BlockTableState:
        """A state of `rows` rows of up to `width` blocks each over these layers' blocks."""
        if rows < 1 or width < 1:
            raise ValueError(f"rows/width: must be >= 1, got {rows}/{width}")
        device = key_blocks[0].device
        if device.type == "cuda":
            fa3_varlen()  # looked up (and logged) once, outside any compiled region
        ints = {"device": device, "dtype": torch.int32}
        head_dim = key_blocks[0].shape[-1]
        return cls(
            key_blocks=list(key_blocks),
            value_blocks=list(value_blocks),
            block_table=torch.zeros(rows, width, **ints),
            lengths=torch.zeros(rows, **ints),
            cu_seqlens_q=torch.arange(0, rows * n_tokens + 1, n_tokens, **ints),
            cos=torch.zeros(rows, n_tokens, 1, head_dim, device=device, dtype=dtype),
            sin=torch.zeros(rows, n_tokens, 1, head_dim, device=device, dtype=dtype),
            query_heads=query_heads,
        )

    @property
    def rows(self) -> int:
        return self.block_table.shape[0]

    @property
    def width(self) -> int:
        return self.block_table.shape[1]

    def reads(self, key_blocks: Sequence[torch.Tensor]) -> bool:
        """Whether these are the blocks the state reads (the same engine cache)."""
        return len(key_blocks) >= len(self.key_blocks) and all(
            a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            for a, b in zip(self.key_blocks, key_blocks)
        )

    def layers(self) -> list[BlockTableKV]:
        """Per expert layer, the K/V source ExpertAttention attends through."""
        meta = (self.block_table, self.lengths, self.cu_seqlens_q, self.schedule)
        return [BlockTableKV(k, v, *meta) for k, v in zip(self.key_blocks, self.value_blocks)]

    def schedule_attention(self) -> None:
        """Make FA3's schedule of the rows as loaded now, once for every layer and flow step; after
        every load of all rows. Written into the same tensor each time (a captured graph reads it)."""
        queries = self.cos.shape[1]
        fresh = block_table_schedule(self.block_table, self.lengths, self.cu_seqlens_q, queries=queries,
                                     query_heads=self.query_heads, key_blocks=self.key_blocks[0])
        if fresh is None:
            return
        if self.schedule is None:
            self.schedule = fresh
        else:
            self.schedule.copy_(fresh)

    def load(
        self, start: int, block_table: torch.Tensor, kept: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """Point rows [start, start + n) at their blocks: block_table (n, w) int32, kept (n,)
        prefix keys per row, rope: cos, sin (n, L, 1, D)."""
        n_rows, width = block_table.shape
        if start + n_rows > self.rows:
            raise ValueError(f"cache: rows {start}..{start + n_rows - 1} beyond the state's {self.rows} rows")
        if width > self.width:
            raise ValueError(f"cache: {width} blocks per row exceed the state's {self.width}")
        rows_at = slice(start, start + n_rows)
        self.block_table[rows_at, :width] = block_table.to(self.block_table.device)
        self.lengths[rows_at] = kept.to(device=self.lengths.device, dtype=torch.int32)
        self.cos[rows_at], self.sin[rows_at] = rope
