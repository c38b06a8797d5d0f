"""Cascade attention: the samples of one plan attend to their shared prompt in one pass.

The rows of a multi-sample plan are separate requests over the same prompt blocks (prefix
caching), so every decode step reads the ~3,100-token prompt's K/V once per row. vLLM's
FlashAttention backend can split such a step in two (its cascade attention): the shared blocks
attended by all rows' queries at once, then each row's own tokens, joined through their
log-sum-exps. vLLM 0.26 ships it off (ModelConfig.disable_cascade_attn) and, when on, uses it
only where its CTA-count model predicts a gain; for 16 one-token rows over a 3,164-token
prompt on a 132-SM GPU that model predicts a tie, so it never runs. Modes:

* off: vLLM's default, never;
* auto: vLLM's own heuristic decides per step;
* on: whenever at least MIN_ROWS rows share at least vLLM's minimum prefix, with the same
  support checks as vLLM (no ALiBi, sliding window, chunked local attention or decode
  context parallel). A cascaded step runs its attention outside the full CUDA graph (vLLM
  falls back to the piecewise one), which the measurement must pay for. On an H100 it did:
  16 rows decoded 2.3x slower with "on" than "off" (bench/RESULTS.md), hence "off" by default.

Only vLLM's V1 model runner computes cascades: its V2 runner, which vLLM 0.26 picks by default
for dense models, has no cascade attention at all, so neither vLLM's heuristic nor the forced
decision would ever be asked (a run with "on" measured the same 16-row decode as "off"). Modes
other than off therefore start the engine on the V1 runner (environment) and refuse an engine
whose runner cannot cascade (check).

The attention sums the prefix and each row's own part separately, so the K/V and the sampled
ids may differ from a plain step by float rounding only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..types import CASCADE_MODES

#: vLLM's own lower bound for a cascaded prefix (tokens): shorter ones are not worth two kernels.
MIN_PREFIX = 256
#: Rows a step needs before "on" cascades it: one row has nothing to share.
MIN_ROWS = 2
#: The attention backend (its get_name()) whose builders can cascade.
FLASH_ATTN = "FLASH_ATTN"
#: vLLM's switch between its model runners; "0" is V1, the one with cascade attention.
V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


def engine_args(mode: str) -> dict[str, Any]:
    """vllm.LLM arguments for a cascade mode ("on" also needs force_cascade after the start)."""
    if mode not in CASCADE_MODES:
        raise ValueError(f"cascade_attention: expected one of {CASCADE_MODES}, got {mode!r}")
    return {"disable_cascade_attn": mode == "off"}


def environment(mode: str) -> dict[str, str]:
    """The vLLM environment an engine of this mode starts in (environment.vllm_environment)."""
    return {} if mode == "off" else {V2_RUNNER: "0"}


def shared_prefix_cascade(
    common_prefix_len: int,
    query_lens: np.ndarray,
    num_query_heads: int,
    num_kv_heads: int,
    use_alibi: bool,
    use_sliding_window: bool,
    use_local_attention: bool,
    num_sms: int,
    dcp_world_size: int,
) -> bool:
    """vLLM's use_cascade_attention, less its performance model (same arguments)."""
    if use_alibi or use_sliding_window or use_local_attention or dcp_world_size > 1:
        return False
    return common_prefix_len >= MIN_PREFIX and len(query_lens) >= MIN_ROWS


def _force_in_worker(worker: Any) -> tuple[int, list[str]]:
    """In one worker: every FlashAttention metadata builder decides by shared_prefix_cascade.

    Returns how many builders now do, and the names of the other attention backends.
    """
    forced, others = 0, set()
    for groups in worker.model_runner.attn_groups:
        for group in groups:
            if group.backend.get_name() != FLASH_ATTN:
                others.add(group.backend.get_name())
                continue
            for builder in group.metadata_builders:
                builder.use_cascade_attention = shared_prefix_cascade  # called with keywords, no self
                forced += 1
    return forced, sorted(others)


def force_cascade(llm: Any) -> None:
    """Mode "on": in every worker of a started engine, cascade whenever rows share a prefix.

    Raises ValueError naming the attention backends where a worker has no FlashAttention layer
    to cascade (the CPU backend, FlashInfer, ...), so "on" never silently does nothing.
    """
    for forced, others in llm.collective_rpc(_force_in_worker):
        if not forced:
            raise ValueError(f"cascade_attention 'on': needs vLLM's {FLASH_ATTN} attention backend; this engine uses {others}")


def _cascading_runner(worker: Any) -> str:
    """In one worker: the name of its model runner if that runner cannot cascade, else ""."""
    runner = worker.model_runner
    return "" if hasattr(runner, "_compute_cascade_attn_prefix_lens") else type(runner).__module__


def check(llm: Any, mode: str) -> None:
    """Refuse a started engine of mode auto or on whose model runner has no cascade attention."""
    if not environment(mode):  # off: whatever runner vLLM chose
        return
    for runner in llm.collective_rpc(_cascading_runner):
        if runner:
            raise ValueError(
                f"cascade_attention {mode!r}: vLLM's model runner here ({runner}) has no cascade attention; "
                f"{V2_RUNNER}=0 (its V1 runner) was asked for"
            )
