"""The small HF-style model folder vLLM loads from: JSON files plus symlinks to the weights.

vLLM wants a model folder of its own shape (the VLM's config.json, tokenizer, processor
configs); building it from the checkpoint here means the checkpoint is never converted.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from .model import ARCHITECTURE

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

    from ..tokenizer import save_tokenizer

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
