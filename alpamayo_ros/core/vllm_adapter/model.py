"""The Alpamayo VLM as a vLLM model: an out-of-tree Qwen3-VL architecture.

It reads the VLM straight out of an Alpamayo checkpoint (a weight-name mapper, no conversion
step) and accepts our own resized uint8 frames ({FRAMES_FIELD, "image_grid_thw"}), so vLLM's
image processor never runs: the model patchifies them on its device, before the vision
tower. It also holds the engine-wide <i*> logits mask (set_token_mask / compute_logits),
the default way of masking because it keeps vLLM's async scheduling overlap.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from transformers import BatchFeature
from vllm import ModelRegistry
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

from ..preprocess import PreprocessedImages, VisionGeometry, frames_to_patches
from .mask import MaskSpec

ARCHITECTURE = "AlpamayoQwen3VLForConditionalGeneration"
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


def vision_graph_config(model_dir: Path, max_images: int) -> dict[str, Any]:
    """vLLM's compilation settings for CUDA graphs of the vision tower (cudagraph_mm_encoder).

    Eager, the tower is launch-bound: about 1,000 small launches per encoder step, whatever its
    frame count (a W16 plan's 4 new frames: 40 ms of host time against 5 ms of vision kernels on
    an H100, profiled). One graph per power-of-two count of full-size
    frames up to max_images, so an encoder step that meets only the new frames of a window
    (the others come from vLLM's encoder cache) pads to the next count, not to all of them.
    """
    processor = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    side = processor["patch_size"] * processor["merge_size"]
    per_frame = processor["size"]["longest_edge"] // side**2  # tokens of the largest frame
    counts = sorted({min(2**k, max_images) for k in range(max_images.bit_length() + 1)})
    return {
        "cudagraph_mm_encoder": True,
        "encoder_cudagraph_token_budgets": [count * per_frame for count in counts],
        "encoder_cudagraph_max_vision_items_per_batch": max_images,
    }


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

    def _patches(self, frames: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """The vision tower's input patches of an encoder step's frames, in its dtype.

        vLLM batches the step's frames (one tensor, or a list when sizes differ) and moves them
        to this device itself (the .to() below is then a no-op), so only uint8 frames cross the
        bus; patches are made as the HF backend makes them.
        """
        geometry = _vision_geometry(self.config.vision_config)
        batches = [frames] if isinstance(frames, torch.Tensor) else [frame[None] for frame in frames]
        return torch.cat(
            [
                frames_to_patches(batch.to(self.visual.device, non_blocking=True), geometry, self.visual.dtype)
                for batch in batches
            ]
        )

    def embed_multimodal(self, **kwargs: object) -> Any:
        """Qwen3-VL's eager image path, fed with patches made from our uint8 frames."""
        frames = kwargs.pop(FRAMES_FIELD, None)
        if frames is not None:
            kwargs["pixel_values"] = self._patches(frames)
        return super().embed_multimodal(**kwargs)

    def _get_pixel_values_by_modality(self, mm_kwargs: dict[str, Any]) -> torch.Tensor:
        """Where vLLM's encoder CUDA graphs read an image batch's patches: ours come as frames."""
        frames = mm_kwargs.get(FRAMES_FIELD)
        if frames is not None:
            return self._patches(frames)
        return super()._get_pixel_values_by_modality(mm_kwargs)

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
