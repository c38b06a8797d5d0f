"""Strict loading of upstream Alpamayo safetensors into our modules.

Tensor names map to modules through declared prefix tables, never through name guessing:
`vlm.*` goes to transformers' Qwen3VLForConditionalGeneration, `expert.*`,
`action_in_proj.*`, `action_out_proj.*` to the ActionExpertModel. A tensor the model does
not expect, a tensor it expects but the files lack, or a shape mismatch is an error listing
the names. Only safetensors are read (no pickle). The expert can be loaded alone, so the vLLM
backend (which loads the VLM itself) never holds the backbone weights twice.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

import torch
from safetensors import safe_open
from torch import nn

from .config import AlpamayoConfig
from .expert import ActionExpertModel

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
SHARD_INDEX_FILE = "model.safetensors.index.json"

#: checkpoint prefix -> name prefix inside transformers' Qwen3VLForConditionalGeneration
BACKBONE_PREFIX_MAP: dict[str, str] = {
    "vlm.model.visual.": "model.visual.",
    "vlm.model.language_model.": "model.language_model.",
    "vlm.lm_head.": "lm_head.",
}
#: checkpoint prefix -> name prefix inside ActionExpertModel (identical by design)
EXPERT_PREFIX_MAP: dict[str, str] = {
    "expert.": "expert.",
    "action_in_proj.": "action_in_proj.",
    "action_out_proj.": "action_out_proj.",
}
_MAX_NAMES_IN_ERROR = 20


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model (missing, unexpected, wrong shape)."""


def tensor_files(checkpoint_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it (single file or shards + index)."""
    directory = Path(checkpoint_dir)
    index_path = directory / SHARD_INDEX_FILE
    if index_path.is_file():
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
        missing_files = sorted({name for name in weight_map.values() if not (directory / name).is_file()})
        if missing_files:
            raise CheckpointError(f"{index_path}: shard files missing: {missing_files}")
        return {tensor: directory / file_name for tensor, file_name in weight_map.items()}
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"checkpoint_dir: neither {SINGLE_FILE} nor {SHARD_INDEX_FILE} in {directory}")
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def read_tensors(
    files: Mapping[str, Path],
    prefix_map: Mapping[str, str],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Read the tensors under prefix_map's checkpoint prefixes, renamed to module names."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, path in files.items():
        if _rename(name, prefix_map) is not None:
            by_file[path].append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            for name in names:
                tensors[_rename(name, prefix_map)] = handle.get_tensor(name).to(dtype)
    return tensors


def load_strict(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], what: str, prefix_map: Mapping[str, str]
) -> None:
    """Copy tensors into module's state, failing on any missing/unexpected name or shape.

    Names in the error are checkpoint names (prefix_map maps them to module names).
    """
    expected = module.state_dict()
    to_checkpoint = {module_prefix: ckpt_prefix for ckpt_prefix, module_prefix in prefix_map.items()}
    missing = sorted(_rename(name, to_checkpoint) or name for name in set(expected) - set(tensors))
    unexpected = sorted(_rename(name, to_checkpoint) or name for name in set(tensors) - set(expected))
    wrong_shape = [
        f"{_rename(name, to_checkpoint)} {tuple(tensors[name].shape)} != {tuple(expected[name].shape)}"
        for name in sorted(set(expected) & set(tensors))
        if tensors[name].shape != expected[name].shape
    ]
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape)):
        if names:
            shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
            more = f" (+{len(names) - _MAX_NAMES_IN_ERROR} more)" if len(names) > _MAX_NAMES_IN_ERROR else ""
            problems.append(f"{len(names)} {label}: {shown}{more}")
    if problems:
        raise CheckpointError(f"{what} tensors do not match the model: " + "; ".join(problems))
    module.load_state_dict(tensors, strict=True)


def check_no_stray_tensors(files: Mapping[str, Path]) -> None:
    """Every checkpoint tensor must belong to the backbone or the expert."""
    known = (*BACKBONE_PREFIX_MAP, *EXPERT_PREFIX_MAP)
    stray = sorted(name for name in files if not name.startswith(known))
    if stray:
        shown = ", ".join(stray[:_MAX_NAMES_IN_ERROR])
        raise CheckpointError(f"{len(stray)} unexpected tensors (neither backbone nor expert): {shown}")


def load_expert(
    config: AlpamayoConfig, *, dtype: torch.dtype, device: torch.device | str, files: Mapping[str, Path] | None = None
) -> ActionExpertModel:
    """Build the ActionExpertModel and load only the expert tensors (backbone tensors are not read).

    Built under `dtype` as the default dtype, as upstream's from_pretrained does: besides the
    weights, that rounds the (unsaved) Fourier frequencies to dtype, like the release's.
    """
    files = tensor_files(config.checkpoint_dir) if files is None else files
    check_no_stray_tensors(files)
    with torch.device(device), _default_dtype(dtype):
        model = ActionExpertModel(config.expert)
    load_strict(model, read_tensors(files, EXPERT_PREFIX_MAP, dtype=dtype, device=device), "expert", EXPERT_PREFIX_MAP)
    return model.eval()


def load_backbone(
    config: AlpamayoConfig, *, dtype: torch.dtype, device: torch.device | str, files: Mapping[str, Path] | None = None
):
    """Build transformers' Qwen3VLForConditionalGeneration (SDPA) and load the `vlm.*` tensors."""
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.initialization import no_init_weights

    files = tensor_files(config.checkpoint_dir) if files is None else files
    check_no_stray_tensors(files)
    hf_config = config.backbone.hf_config(config.vocab_size, dtype)
    with torch.device(device), no_init_weights():  # every parameter is overwritten below
        model = Qwen3VLForConditionalGeneration._from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    tensors = read_tensors(files, BACKBONE_PREFIX_MAP, dtype=dtype, device=device)
    load_strict(model, tensors, "backbone", BACKBONE_PREFIX_MAP)
    return model.eval()


def _rename(name: str, prefix_map: Mapping[str, str]) -> str | None:
    for checkpoint_prefix, module_prefix in prefix_map.items():
        if name.startswith(checkpoint_prefix):
            return module_prefix + name[len(checkpoint_prefix) :]
    return None


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
