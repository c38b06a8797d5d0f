"""The per-plan states the action expert's fast path attends over: paged K/V and a block table.

Two kinds: ExpertState holds a copy of a plain (contiguous) prefix cache in blocks of its own;
BlockTableState holds only block tables into K/V a paged engine keeps (PrefixCache.paged,
vLLM's cache), read in place, and the action tokens' K/V stay apart (BlockTableKV).

ExpertState:

`ActionExpertModel.prepare(cache)` (or a sampler's persistent state, refilled per plan by
`load_state`) copies a prefix cache once into blocks of PAGE tokens per layer; each flow step
then writes only the W action tokens' K/V into their slots and attends through PagedKV
(expert_attention.py), with no mask:

- a row's keys are its block-table blocks in order, of which the first `lengths[n]` count:
  its kept prefix columns, then its W action tokens. Columns no action token may attend (a
  stop gap, padding, invalid columns) are simply not copied, so nothing needs masking, and the
  capacity beyond a row's length is never read: one state (and one CUDA graph) serves every
  plan that fits it, whatever its prefix length.
- samples of one prompt (a shared state) point at the same blocks for the prompt's full
  blocks; the prompt's partial last block is copied into each row's own blocks, followed by
  the row's own columns. The prompt is held, and read per layer, once.

The states' tensors keep their addresses across loads (a captured graph holds them); load_*
rewrites their contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from alpamayo_ros.core.expert_attention import PAGE, BlockTableKV, PagedKV, fa3_varlen


def _blocks(columns: int) -> int:
    return -(-columns // PAGE)


@dataclass
class ExpertState:
    """Paged K/V of one plan's rows (see the module docstring).

    k_blocks/v_blocks: per expert layer (blocks, PAGE, Hkv, D). The first `shared // PAGE`
        blocks hold a shared prompt's full blocks (none in a plain state); then each row owns
        `own_blocks` consecutive blocks.
    block_table: (N, shared // PAGE + own_blocks) int32; lengths: (N,) int32 keys per row
        (action tokens included); slots: (N*W,) int64, the action tokens' flat slots.
    cu_seqlens_q: (N+1,) int32, W queries per row. cos/sin: (N, W, 1, D) action-token RoPE.
    capacity: key columns each row may use past the shared blocks (its own columns, the W
        action tokens and padding); shared: prompt columns the shared blocks can hold.
    """

    k_blocks: list[torch.Tensor]
    v_blocks: list[torch.Tensor]
    block_table: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    capacity: int
    shared: int = 0

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
        shared: int = 0,
    ) -> ExpertState:
        """Zeroed buffers for `rows` rows of `capacity` own key columns (+ `shared` shared ones).

        Zeros, not empty memory: the attention never reads past a row's length, but a NaN
        left in a block would still surface in a gathered fallback's masked product.
        """
        if rows < 1:
            raise ValueError(f"rows: must be >= 1, got {rows}")
        if capacity <= n_tokens:
            raise ValueError(f"capacity: must exceed {n_tokens} action tokens, got {capacity}")
        if shared < 0:
            raise ValueError(f"shared: must be >= 0, got {shared}")
        if like.is_cuda:
            fa3_varlen()  # looked up (and logged) once, outside any compiled region
        factory = {"device": like.device, "dtype": like.dtype}
        shared_blocks = shared // PAGE
        # a shared prompt's partial last block (< PAGE columns) rides in each row's own blocks
        own_blocks = _blocks(capacity + (PAGE - 1 if shared else 0))
        shape = (shared_blocks + rows * own_blocks, PAGE, num_kv_heads, head_dim)
        ints = {"device": like.device, "dtype": torch.int32}
        return cls(
            k_blocks=[torch.zeros(shape, **factory) for _ in range(num_layers)],
            v_blocks=[torch.zeros(shape, **factory) for _ in range(num_layers)],
            block_table=torch.zeros(rows, shared_blocks + own_blocks, **ints),
            lengths=torch.zeros(rows, **ints),
            slots=torch.zeros(rows * n_tokens, device=like.device, dtype=torch.long),
            cu_seqlens_q=torch.arange(0, rows * n_tokens + 1, n_tokens, **ints),
            cos=torch.zeros(rows, n_tokens, 1, head_dim, **factory),
            sin=torch.zeros(rows, n_tokens, 1, head_dim, **factory),
            capacity=capacity,
            shared=shared,
        )

    @property
    def rows(self) -> int:
        return self.block_table.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.cos.shape[1]

    @property
    def own_blocks(self) -> int:
        return self.block_table.shape[1] - self.shared // PAGE

    def layers(self) -> list[PagedKV]:
        """Per expert layer, the K/V source ExpertAttention attends through."""
        meta = (self.block_table, self.lengths, self.slots, self.cu_seqlens_q, self.shared > 0)
        return [PagedKV(k, v, *meta) for k, v in zip(self.k_blocks, self.v_blocks)]

    def _own_columns(self, rows_at: slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, rows_at's own blocks as flat (rows, own_blocks*PAGE, Hkv, D) views."""
        first = self.shared // PAGE + rows_at.start * self.own_blocks
        last = first + (rows_at.stop - rows_at.start) * self.own_blocks
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
        shared_keys: Sequence[torch.Tensor] | None = None,
        shared_values: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Write one cache into rows [start, start + N): its kept columns, lengths and RoPE.

        keys/values: per layer (N, Hkv, T', D) (extra layers ignored), a row's columns after
        the shared prompt if shared_keys (per layer (1, Hkv, S, D)) are given, else all T';
        keep: (N, T') bool on the host, the columns action tokens attend; rope: cos, sin
        (N, W, 1, D). Host-side bookkeeping only decides where columns go; the copies are
        one per layer unless a row keeps columns with gaps between them.
        """
        n_rows, _, length, _ = keys[0].shape
        if start + n_rows > self.rows:
            raise ValueError(f"cache: rows {start}..{start + n_rows - 1} beyond the state's {self.rows} rows")
        prompt = 0 if shared_keys is None else shared_keys[0].shape[2]
        if (shared_keys is None) != (self.shared == 0) or prompt > self.shared:
            raise ValueError(
                f"cache: a shared prompt of {prompt} columns for a state whose shared blocks hold"
                f" {self.shared} (a shared state takes exactly one cache with a shared part;"
                " a plain one none)"
            )
        full = prompt // PAGE  # the prompt's full blocks, shared by the rows
        tail = prompt - full * PAGE  # its partial last block, copied into each row
        kept = keep.sum(dim=1)
        if int(kept.max()) + self.n_tokens > self.capacity:
            raise ValueError(
                f"cache: {int(kept.max())} kept columns + {self.n_tokens} action tokens exceed the"
                f" state's capacity {self.capacity}"
            )
        rows_at = slice(start, start + n_rows)
        # One copy per layer when every row keeps a leading run of columns (the stop gap and
        # padding are trailing) and all of them fit; else row by row, kept columns only.
        contiguous = tail + length <= self.own_blocks * PAGE and bool(
            (keep == (torch.arange(length)[None, :] < kept[:, None])).all()
        )
        own = self._own_columns(rows_at)
        for layer, (k_own, v_own) in enumerate(own):
            k_blocks, v_blocks = self.k_blocks[layer], self.v_blocks[layer]
            if shared_keys is not None:
                for blocks, source, flat in ((k_blocks, shared_keys[layer], k_own), (v_blocks, shared_values[layer], v_own)):
                    prompt_columns = source[0].transpose(0, 1)  # (S, Hkv, D)
                    blocks[:full].view(full * PAGE, *blocks.shape[2:]).copy_(prompt_columns[: full * PAGE])
                    flat[:, :tail] = prompt_columns[full * PAGE :]
            for flat, source in ((k_own, keys[layer]), (v_own, values[layer])):
                columns = source.transpose(1, 2)  # (N, T', Hkv, D)
                if contiguous:
                    flat[:, tail : tail + length] = columns
                    continue
                for row in range(n_rows):
                    index = keep[row].nonzero()[:, 0].to(columns.device)
                    flat[row, tail : tail + index.numel()] = columns[row].index_select(0, index)
        used = tail + kept  # own columns before the action tokens
        own_start = self.shared // PAGE + torch.arange(start, start + n_rows) * self.own_blocks
        table = torch.zeros(n_rows, self.block_table.shape[1], dtype=torch.int32)
        table[:, :full] = torch.arange(full)
        table[:, full : full + self.own_blocks] = own_start[:, None] + torch.arange(self.own_blocks)
        slots = (own_start * PAGE + used)[:, None] + torch.arange(self.n_tokens)
        device = self.lengths.device
        self.block_table[rows_at] = table.to(device)
        self.lengths[rows_at] = (full * PAGE + used + self.n_tokens).to(device=device, dtype=torch.int32)
        self.slots[start * self.n_tokens : (start + n_rows) * self.n_tokens] = slots.reshape(-1).to(device)
        self.cos[rows_at], self.sin[rows_at] = rope


@dataclass
class BlockTableState:
    """Block tables into a paged engine's K/V for one plan's rows (see the module docstring).

    key_blocks/value_blocks: per expert layer, the engine's (blocks, block_size, Hkv, D) views;
    block_table: (N, W) int32, each row's blocks in order; lengths: (N,) int32, the prefix keys
    each row attends (its kept columns, a leading run); cu_seqlens_q: (N+1,) int32, L queries
    per row (the action tokens); cos/sin: (N, L, 1, D) their RoPE.
    """

    key_blocks: list[torch.Tensor]
    value_blocks: list[torch.Tensor]
    block_table: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

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
        meta = (self.block_table, self.lengths, self.cu_seqlens_q)
        return [BlockTableKV(k, v, *meta) for k, v in zip(self.key_blocks, self.value_blocks)]

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
