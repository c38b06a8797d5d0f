"""The Qwen3-VL backbone on vLLM, in-process, handing its paged K/V cache to the expert.

Same contract as the HF backend (core.backbone.Backbone): our own prompt ids and
preprocessed patches go in, reasoning ids and a PrefixCache come out. vLLM internals are
touched only through core.vllm_adapter.

Each sample is its own vLLM request (n=1, seed = base seed + row), so rows never wait for
each other: a row stops one step after its own first <|traj_future_start|> (we abort it once
the token after that one is sampled), which gives upstream's cache for that row. Upstream
keeps early rows decoding until the last row stops, but those extra tokens sit at columns
>= offset, which the expert masks, so the plans are the same.
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from .backbone import PrefixCache, PromptInputs, Rollout
from .config import AlpamayoConfig
from .tokenizer import TokenIds

logger = logging.getLogger(__name__)

_DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "alpamayo_ros"


@dataclass(frozen=True)
class EngineOptions:
    """vLLM engine settings (see vllm.LLM); defaults suit one H200 and 16-image prompts."""

    dtype: str = "bfloat16"
    max_model_len: int = 8192
    max_num_seqs: int = 16  # most samples one rollout may ask for
    max_images: int = 16
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    quantization: str | None = None  # e.g. "fp8" (online weight quantisation)
    kv_cache_gib: float | None = None  # None: vLLM sizes it (GPU) / default space (CPU)
    enable_prefix_caching: bool = True  # samples of one prompt share its blocks
    seed: int = 0
    cache_dir: Path = _DEFAULT_CACHE_DIR  # where the small vLLM model folder is written

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            # NOTE: with TP > 1 the workers are separate processes and the captured K/V
            # (per-rank head shards) cannot reach this process through the in-process sink.
            raise ValueError(f"tensor_parallel_size: only 1 is supported (K/V capture is in-process), got {self.tensor_parallel_size}")
        for name in ("max_model_len", "max_num_seqs", "max_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")


class VLLMBackbone:
    """Backbone protocol on a vLLM engine in this process (one engine per instance)."""

    name = "vllm"

    def __init__(self, config: AlpamayoConfig, token_ids: TokenIds, options: EngineOptions = EngineOptions()) -> None:
        # The engine must live in this process: the K/V capture reads its cache tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from . import vllm_adapter

        self._adapter = vllm_adapter
        self._ids = token_ids
        self._vocab_size = config.vocab_size
        self._merge_size = config.vision.merge_size
        traj_end = token_ids.traj_start + token_ids.traj_vocab_size
        # every id except the <i*> trajectory bins (upstream's logits mask)
        self._allowed_ids = [i for i in range(config.vocab_size) if not token_ids.traj_start <= i < traj_end]
        self._image_uuids: dict[int, tuple[weakref.ref, str]] = {}  # id(pixel_values) -> (ref, uuid)

        model_dir = vllm_adapter.materialize_model_dir(
            config.checkpoint_dir,
            {k: v for k, v in config.backbone.raw.items() if not k.startswith("_")},
            config.vocab_size,
            config.vision.min_pixels,
            config.vision.max_pixels,
            options.cache_dir,
        )
        self._sink = vllm_adapter.open_sink()
        self._llm = vllm_adapter.create_engine(model_dir, self._sink, options)
        self.options = options

    def close(self) -> None:
        """Shut the engine down and free its memory (the instance is unusable afterwards)."""
        if self._llm is not None:
            self._adapter.shutdown_engine(self._llm)
            self._adapter.close_sink(self._sink)
            self._llm = None

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
    ) -> Rollout:
        """Sample reasoning for num_samples rows (see Backbone.rollout)."""
        if num_samples < 1:
            raise ValueError(f"num_samples: must be >= 1, got {num_samples}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
        prompt_len = int(prompt.input_ids.shape[0])
        if forced_ids is not None:
            forced = [int(i) for i in forced_ids]
            if not forced:
                raise ValueError("forced_ids: empty")
            # Teacher forcing: every forced token but the last is fed, as in a real rollout.
            fed = self._run_fed(prompt, [forced[:-1]]) * num_samples
            sampled = [forced] * num_samples
        else:
            base_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
            fed, sampled = self._run_sampled(prompt, num_samples, temperature, top_p, max_new_tokens, base_seed)
        generated = [self._cut_at_stop(ids) for ids in sampled]
        # Upstream cache length: everything fed, i.e. all sampled ids but the last one. A row
        # aborted after its stop token may hold one more (async scheduling); it is cut here.
        lengths = [prompt_len + len(ids) - 1 for ids in sampled]
        cache = self._prefix_cache(prompt, fed, lengths, generated)
        return Rollout(generated_ids=generated, cache=cache)

    def prefill(self, prompt: PromptInputs, generated_ids: Sequence[Sequence[int]]) -> PrefixCache:
        """K/V of prompt + each row's generated tokens, every token fed (see Backbone.prefill)."""
        if not generated_ids:
            raise ValueError("generated_ids: need at least one row")
        rows = [[int(i) for i in row] for row in generated_ids]
        prompt_len = int(prompt.input_ids.shape[0])
        fed = self._run_fed(prompt, rows)
        return self._prefix_cache(prompt, fed, [prompt_len + len(r) for r in rows], rows)

    # -- engine calls -----------------------------------------------------------------

    def _vllm_prompt(self, prompt: PromptInputs, extra_ids: Sequence[int]) -> dict[str, Any]:
        """vLLM request input: our ids with each image block collapsed back to one pad.

        vLLM's Qwen3-VL processor re-expands each <|image_pad|> from the grid it is given,
        and the expanded ids are checked against ours after the run. The images go in as
        our own patches, so vLLM's image processor never runs.
        """
        ids = prompt.input_ids.tolist()
        pad = self._ids.image_pad
        collapsed = [tok for i, tok in enumerate(ids) if tok != pad or i == 0 or ids[i - 1] != pad]
        if pad in extra_ids:
            raise ValueError("generated_ids: contain <|image_pad|>, which vLLM would treat as an image")
        grid = prompt.image_grid_thw
        pixel_values = prompt.pixel_values
        ref, key = self._image_uuids.get(id(pixel_values), (None, ""))
        if ref is None or ref() is not pixel_values:
            # NOTE: one id per patches tensor (not a content hash, which costs a device copy
            # and a pass over ~70 MB): rollout and nav-CFG prefill of the same frames then
            # share vLLM's vision-encoder and prefix caches. Tensors must not be edited in place.
            key = uuid.uuid4().hex
            self._image_uuids = {k: v for k, v in self._image_uuids.items() if v[0]() is not None}
            self._image_uuids[id(pixel_values)] = (weakref.ref(pixel_values), key)
        return {
            "prompt_token_ids": collapsed + list(extra_ids),
            "multi_modal_data": {"image": {"pixel_values": pixel_values, "image_grid_thw": grid}},
            "multi_modal_uuids": {"image": [f"{key}-{i}" for i in range(int(grid.shape[0]))]},
        }

    def _run_sampled(
        self, prompt: PromptInputs, num_samples: int, temperature: float, top_p: float, max_new_tokens: int, seed: int
    ) -> tuple[list[Any], list[list[int]]]:
        """Decode num_samples rows, each stopped one token after its first stop token."""
        greedy = temperature <= 0
        requests = [
            (
                self._vllm_prompt(prompt, ()),
                self._adapter.sampling_params(
                    temperature=0.0 if greedy else temperature,
                    top_p=1.0 if greedy else top_p,
                    max_tokens=max_new_tokens,
                    seed=seed + row,
                    allowed_token_ids=self._allowed_ids,
                ),
            )
            for row in range(num_samples)
        ]
        results = self._adapter.run_requests(self._llm, self._sink, requests, stop_after=self._ids.traj_future_start)
        self._check_prompt(prompt, [r.prompt_token_ids for r in results], extra=[()] * num_samples)
        return [r.captured for r in results], [r.output_ids for r in results]

    def _run_fed(self, prompt: PromptInputs, rows: Sequence[Sequence[int]]) -> list[Any]:
        """Feed prompt + each row's ids and capture their K/V (one throwaway token sampled)."""
        requests = [
            (
                self._vllm_prompt(prompt, row),
                self._adapter.sampling_params(temperature=0.0, top_p=1.0, max_tokens=1, seed=0, allowed_token_ids=None),
            )
            for row in rows
        ]
        results = self._adapter.run_requests(self._llm, self._sink, requests, stop_after=None)
        self._check_prompt(prompt, [r.prompt_token_ids for r in results], extra=rows)
        return [r.captured for r in results]

    def _check_prompt(self, prompt: PromptInputs, seen: list[list[int]], extra: Sequence[Sequence[int]]) -> None:
        """vLLM's re-expanded prompt must be exactly our ids (same images, same token count)."""
        ours = prompt.input_ids.tolist()
        for row, (ids, tail) in enumerate(zip(seen, extra)):
            if ids != ours + list(tail):
                raise RuntimeError(
                    f"vLLM expanded the prompt of row {row} to {len(ids)} ids, ours has {len(ours) + len(tail)}: "
                    "image grids and <|image_pad|> runs disagree"
                )

    # -- output assembly --------------------------------------------------------------

    def _cut_at_stop(self, ids: Sequence[int]) -> list[int]:
        """Generated ids up to and including the first <|traj_future_start|>."""
        ids = list(ids)
        stop = self._ids.traj_future_start
        return ids[: ids.index(stop) + 1] if stop in ids else ids

    def _prefix_cache(
        self, prompt: PromptInputs, fed: list[Any], lengths: list[int], generated: Sequence[Sequence[int]]
    ) -> PrefixCache:
        """Stack per-row captures into (N, H, T, D) layers, padding short rows (valid=False)."""
        prompt_len = int(prompt.input_ids.shape[0])
        rows = len(fed)
        width = max(lengths)
        for row, (capture, length) in enumerate(zip(fed, lengths)):
            if len(capture.keys[0]) < length:
                raise RuntimeError(f"row {row}: vLLM computed K/V for {len(capture.keys[0])} tokens, need {length}")
        first = fed[0].keys[0]
        valid = torch.zeros(rows, width, dtype=torch.bool, device=first.device)
        keys, values = [], []
        for layer in range(len(fed[0].keys)):
            k = first.new_zeros(rows, width, *first.shape[1:])  # (N, T, H, D)
            v = first.new_zeros(rows, width, *first.shape[1:])
            for row, (capture, length) in enumerate(zip(fed, lengths)):
                k[row, :length] = capture.keys[layer][:length]
                v[row, :length] = capture.values[layer][:length]
            keys.append(k.transpose(1, 2))  # (N, H, T, D)
            values.append(v.transpose(1, 2))
        for row, length in enumerate(lengths):
            valid[row, :length] = True
        stop = self._ids.traj_future_start
        offsets = [prompt_len + (list(g).index(stop) + 1 if stop in g else len(g)) for g in generated]
        return PrefixCache(
            keys=keys,
            values=values,
            offsets=torch.tensor(offsets, dtype=torch.long, device=first.device),
            rope_deltas=torch.full((rows,), prompt.rope_delta, dtype=torch.long, device=first.device),
            valid=valid,
        )
