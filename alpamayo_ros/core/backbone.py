"""The one small interface every VLM backend (HF reference, vLLM) implements.

A backend turns a rendered prompt into reasoning tokens plus the per-layer K/V cache the
action expert attends to. Everything model-agnostic (prompt layout, expert, flow matching,
action space) lives outside the backends, so both produce plans through the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from .preprocess import PreprocessedImages


@dataclass
class PromptInputs:
    """A fully rendered single-scene prompt.

    input_ids: (T,) int64; image placeholders already expanded to one <|image_pad|> per
        merged patch and the 48 history placeholders already replaced by history tokens.
    images: the resized uint8 frames, same order as the image blocks in input_ids, on any
        device; the backend makes their patches where its vision tower runs. Their keys name
        the images: equal names mean equal pixels, so a backend may reuse per-image work
        (vLLM's encoder cache).
    position_ids: (3, T) int64 M-RoPE positions of the prompt.
    rope_delta: next M-RoPE position minus T (negative with images).
    """

    input_ids: torch.Tensor
    images: PreprocessedImages
    position_ids: torch.Tensor
    rope_delta: int


@dataclass
class PagedPrefix:
    """Backbone K/V left where a paged engine keeps it: which blocks hold each row.

    key_blocks/value_blocks: per backbone layer, (num_blocks, block_size, H_kv, head_dim)
        views of the engine's cache (only the last dim need be contiguous); never copied.
    block_table: (N, W) int32 on the cache's device: row n's blocks in position order; the
        entries past its length are never read.
    lengths: per row, the positions [0, length) its blocks hold.
    release: hands the blocks back to the engine (idempotent); until then it keeps them.
    """

    key_blocks: list[torch.Tensor]
    value_blocks: list[torch.Tensor]
    block_table: torch.Tensor
    lengths: list[int]
    release: Callable[[], None]

    @property
    def block_size(self) -> int:
        return self.key_blocks[0].shape[1]

    def gather(self, width: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer K and V copied to (N, H_kv, width, head_dim), zeros past each row's length
        (width <= the block table's W * block_size)."""
        table = self.block_table.long()
        lengths = torch.tensor(self.lengths, device=table.device)
        valid = (torch.arange(width, device=table.device)[None, :] < lengths[:, None])[:, :, None, None]

        def rows(layer: torch.Tensor) -> torch.Tensor:
            columns = layer[table].flatten(1, 2)[:, :width]  # (N, width, H, D)
            return torch.where(valid, columns, 0).transpose(1, 2).contiguous()

        return [rows(k) for k in self.key_blocks], [rows(v) for v in self.value_blocks]


@dataclass
class PrefixCache:
    """Backbone K/V for prompt + reasoning, the prefix the expert's diffusion tokens attend to.

    keys/values: one tensor per backbone decoder layer, (N, H_kv, T, head_dim), already
        k-normed and M-RoPE-rotated (exactly what an HF forward stores in its cache).
    offsets: (N,) int64, index just after the first <|traj_future_start|>; columns >= offset
        are masked (tokens generated after the stop token by other rows' longer rollouts).
    rope_deltas: (N,) int64, M-RoPE delta of each row; expert token j sits at position
        j + offset + rope_delta on all three M-RoPE axes.
    valid: (N, T) bool or None; False marks padding columns (never attended).
    paged: None, or the K/V left in a paged engine's blocks (keys/values are then empty and
        T is the longest row); release() it once the expert is done.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    offsets: torch.Tensor
    rope_deltas: torch.Tensor
    valid: torch.Tensor | None = None
    paged: PagedPrefix | None = None

    def __post_init__(self) -> None:
        if self.paged is not None and (self.keys or self.values):
            raise ValueError("paged: a paged cache holds no keys/values of its own")

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0] if self.paged is None else self.paged.block_table.shape[0]

    @property
    def device(self) -> torch.device:
        return (self.keys[0] if self.paged is None else self.paged.key_blocks[0]).device

    @property
    def length(self) -> int:
        if self.paged is not None:
            return max(self.paged.lengths)
        return self.keys[0].shape[2]

    def release(self) -> None:
        """Hand a paged cache's blocks back to its engine (nothing to do for the others)."""
        if self.paged is not None:
            self.paged.release()

    def materialized(self) -> PrefixCache:
        """The same cache with every row's columns in its own tensors (a paged one gathered).

        For consumers of the plain (N, H_kv, T, D) layout: the reference expert path, tests.
        """
        if self.paged is None:
            return self
        keys, values = self.paged.gather(self.length)
        return PrefixCache(keys, values, self.offsets, self.rope_deltas, self.valid)


@dataclass
class Rollout:
    """Reasoning rollout for N samples of one prompt.

    generated_ids: per sample, generated token ids up to and including the first
        <|traj_future_start|> (or all of them if it never came).
    cache: K/V of prompt + generated tokens with upstream length semantics: the cache holds
        every token fed to the model, i.e. all generated tokens except the last sampled one.
    timings_ms: see the field comment.
    """

    generated_ids: list[list[int]]
    cache: PrefixCache
    # backend sub-stages in ms where the backend can tell them apart: "prefill" (vision
    # encoder + prompt prefill, up to the first token), "decode", "kv_handoff" (cache to
    # PrefixCache); vLLM adds "frontend" (its request/input processing)
    timings_ms: dict[str, float] = field(default_factory=dict)
    # speculative decoding, over all rows: draft tokens the model verified, and accepted
    drafted_tokens: int = 0
    accepted_tokens: int = 0


class Backbone(Protocol):
    """A Qwen3-VL backbone with Alpamayo's extended vocabulary."""

    name: str
    #: where the backend wants the preprocessed (resized uint8) frames: its compute device,
    #: or the host for a backend that uploads only the images it has to encode (vLLM)
    pixel_device: torch.device

    def rollout(
        self,
        prompt: PromptInputs,
        *,
        num_samples: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        generator: torch.Generator,
        forced_ids: Sequence[int] | None = None,
        min_new_tokens: int = 0,
    ) -> Rollout:
        """Generate reasoning for num_samples rows and return their K/V.

        Sampling masks every <i*> token and stops one step after all rows produced
        <|traj_future_start|> (upstream's rule). temperature <= 0 means greedy.
        forced_ids teacher-forces the generated tokens (tests, parity work): it is every
        row's complete generated sequence; nothing is sampled and all but its last token are fed.
        """
        ...

    def prefill(self, prompt: PromptInputs, generated_ids: Sequence[Sequence[int]]) -> PrefixCache:
        """K/V of prompt + each row's generated tokens in one forward (no sampling).

        Used for the route-free nav-CFG cache and as the parity oracle.
        """
        ...

    def generate(
        self,
        prompt: PromptInputs,
        *,
        num_samples: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        generator: torch.Generator,
    ) -> list[list[int]]:
        """Plain sampling for VQA (upstream's generate_text): no <i*> mask, no trajectory stop
        rule; a row ends with <|im_end|> (included) or at max_new_tokens. No K/V returned.
        """
        ...


def check_sampling_args(
    num_samples: int, temperature: float, top_p: float, max_new_tokens: int, min_new_tokens: int = 0
) -> None:
    """Reject sampling arguments every backend would mishandle, naming the argument."""
    if min_new_tokens < 0:
        raise ValueError(f"min_new_tokens: must be >= 0, got {min_new_tokens}")
    if num_samples < 1:
        raise ValueError(f"num_samples: must be >= 1, got {num_samples}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if temperature != temperature:
        raise ValueError("temperature: NaN")


def cut_after_stop(row: Sequence[int], stop_id: int) -> list[int]:
    """A row's ids up to and including its first stop id (all of them if there is none)."""
    row = list(row)
    return row[: row.index(stop_id) + 1] if stop_id in row else row


def forced_row(forced_ids: Sequence[int]) -> list[int]:
    """A teacher-forced rollout row as plain ints; it must hold at least one token."""
    forced = [int(token) for token in forced_ids]
    if not forced:
        raise ValueError("forced_ids: empty")
    return forced
