"""Strict safetensors loading: upstream names in, every tensor accounted for, errors name them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from alpamayo_ros.core.checkpoint import (
    CheckpointError,
    load_backbone,
    load_expert,
    tensor_files,
)
from alpamayo_ros.core.config import AlpamayoConfig
from alpamayo_ros.core.tiny_checkpoint import save_tensors, tensor_shapes, write_checkpoint


@pytest.fixture(scope="module")
def tensors(tiny_checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_checkpoint / "model.safetensors"))


def copy_with(tiny_checkpoint: Path, target: Path, tensors: dict[str, torch.Tensor]) -> AlpamayoConfig:
    """A checkpoint with tiny_checkpoint's config and tokenizer but the given tensors."""
    shutil.copytree(tiny_checkpoint, target, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(target / "model.safetensors"))
    return AlpamayoConfig.from_checkpoint(target)


def test_upstream_names_map_onto_both_modules(tiny_checkpoint: Path, tensors: dict[str, torch.Tensor]) -> None:
    config = AlpamayoConfig.from_checkpoint(tiny_checkpoint)
    backbone = load_backbone(config, dtype=torch.float32, device="cpu")
    expert = load_expert(config, dtype=torch.float32, device="cpu")
    assert torch.equal(backbone.lm_head.weight, tensors["vlm.lm_head.weight"])
    assert torch.equal(
        backbone.model.visual.patch_embed.proj.weight, tensors["vlm.model.visual.patch_embed.proj.weight"]
    )
    layer = backbone.model.language_model.layers[3].self_attn.k_norm.weight
    assert torch.equal(layer, tensors["vlm.model.language_model.layers.3.self_attn.k_norm.weight"])
    assert torch.equal(expert.expert.layers[2].mlp.down_proj.weight, tensors["expert.layers.2.mlp.down_proj.weight"])
    assert torch.equal(expert.action_in_proj.encoder.trunk[12].bias, tensors["action_in_proj.encoder.trunk.12.bias"])
    assert torch.equal(expert.action_out_proj.weight, tensors["action_out_proj.weight"])
    loaded = len(backbone.state_dict()) + len(expert.state_dict())
    assert loaded == len(tensors)
    assert not torch.equal(backbone.lm_head.weight, backbone.model.language_model.embed_tokens.weight)  # untied


def test_upstream_key_layout(tensors: dict[str, torch.Tensor]) -> None:
    assert tensors["vlm.lm_head.weight"].shape == (155697, 64)
    assert tensors["vlm.model.language_model.embed_tokens.weight"].shape == (155697, 64)
    assert tensors["vlm.model.visual.patch_embed.proj.weight"].shape == (64, 3, 2, 16, 16)
    assert tensors["vlm.model.visual.pos_embed.weight"].shape == (2304, 64)
    assert "vlm.model.visual.deepstack_merger_list.1.linear_fc2.bias" in tensors
    assert tensors["expert.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 96)
    assert tensors["expert.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 96)
    assert tensors["action_in_proj.encoder.trunk.0.weight"].shape == (64, 60)
    assert tensors["action_in_proj.encoder.trunk.11.weight"].shape == (64,)
    assert tensors["action_in_proj.norm.bias"].shape == (96,)
    assert tensors["action_out_proj.weight"].shape == (2, 96)
    assert not any(name.startswith("expert.embed_tokens") for name in tensors)
    assert not any("rotary" in name or "freqs" in name for name in tensors)  # buffers are rebuilt


def test_shards_load_like_one_file(tiny_checkpoint: Path, tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    shutil.copytree(tiny_checkpoint, tmp_path / "sharded", ignore=shutil.ignore_patterns("*.safetensors"))
    save_tensors(tensors, tmp_path / "sharded", max_shard_bytes=30 << 20)
    assert len(list((tmp_path / "sharded").glob("model-0000?-of-0000?.safetensors"))) >= 3
    files = tensor_files(tmp_path / "sharded")
    assert set(files) == set(tensors) and len(set(files.values())) >= 3
    config = AlpamayoConfig.from_checkpoint(tmp_path / "sharded")
    backbone = load_backbone(config, dtype=torch.float32, device="cpu")
    assert torch.equal(
        backbone.model.language_model.embed_tokens.weight, tensors["vlm.model.language_model.embed_tokens.weight"]
    )
    assert torch.equal(backbone.lm_head.weight, tensors["vlm.lm_head.weight"])


def test_bf16_load_rounds_weights_and_fourier_frequencies(tiny_checkpoint: Path, tensors) -> None:
    config = AlpamayoConfig.from_checkpoint(tiny_checkpoint)
    expert = load_expert(config, dtype=torch.bfloat16, device="cpu")
    backbone = load_backbone(config, dtype=torch.bfloat16, device="cpu")
    assert expert.expert.norm.weight.dtype == torch.bfloat16 == backbone.lm_head.weight.dtype
    assert torch.equal(expert.expert.norm.weight, tensors["expert.norm.weight"].bfloat16())
    # upstream rebuilds the unsaved Fourier frequencies under the load dtype
    assert float(expert.action_in_proj.fourier.freqs.flatten()[1]) == 1.671875
    fp32 = load_expert(config, dtype=torch.float32, device="cpu")
    assert float(fp32.action_in_proj.fourier.freqs.flatten()[1]) == pytest.approx(1.6681, abs=1e-4)


def test_missing_tensors_are_listed(tiny_checkpoint: Path, tmp_path: Path, tensors) -> None:
    partial = {k: v for k, v in tensors.items() if k not in ("expert.norm.weight", "vlm.lm_head.weight")}
    config = copy_with(tiny_checkpoint, tmp_path / "ckpt", partial)
    with pytest.raises(CheckpointError, match=r"expert tensors do not match the model: 1 missing: expert.norm.weight"):
        load_expert(config, dtype=torch.float32, device="cpu")
    with pytest.raises(CheckpointError, match=r"backbone tensors .*1 missing: vlm.lm_head.weight"):
        load_backbone(config, dtype=torch.float32, device="cpu")


def test_unexpected_tensors_are_listed(tiny_checkpoint: Path, tmp_path: Path, tensors) -> None:
    extra = dict(tensors)
    extra["expert.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    config = copy_with(tiny_checkpoint, tmp_path / "a", extra)
    with pytest.raises(CheckpointError, match=r"1 unexpected: expert.layers.9.mlp.up_proj.weight"):
        load_expert(config, dtype=torch.float32, device="cpu")
    stray = dict(tensors)
    stray["diffusion.sigma"] = torch.zeros(1)
    config = copy_with(tiny_checkpoint, tmp_path / "b", stray)
    with pytest.raises(CheckpointError, match=r"1 unexpected tensors \(neither backbone nor expert\): diffusion.sigma"):
        load_expert(config, dtype=torch.float32, device="cpu")


def test_wrong_shapes_are_listed(tiny_checkpoint: Path, tmp_path: Path, tensors) -> None:
    bad = dict(tensors)
    bad["vlm.model.language_model.norm.weight"] = torch.ones(65)
    config = copy_with(tiny_checkpoint, tmp_path / "ckpt", bad)
    with pytest.raises(CheckpointError, match=r"wrong shape: vlm.model.language_model.norm.weight \(65,\) != \(64,\)"):
        load_backbone(config, dtype=torch.float32, device="cpu")
    # the expert alone never reads backbone tensors (the vLLM backend loads those itself)
    expert = load_expert(config, dtype=torch.float32, device="cpu")
    assert torch.equal(expert.action_out_proj.bias, tensors["action_out_proj.bias"])


def test_no_weights_file(tiny_checkpoint: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_checkpoint, tmp_path / "ckpt", ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        tensor_files(tmp_path / "ckpt")


def test_full_size_architecture_has_the_published_sizes(tmp_path: Path) -> None:
    config = AlpamayoConfig.from_checkpoint(write_checkpoint(tmp_path, full_size=True, weights=False))
    shapes = tensor_shapes(config)
    count = lambda prefix: sum(torch.Size(s).numel() for name, s in shapes.items() if name.startswith(prefix))  # noqa: E731
    backbone = count("vlm.")
    expert = count("expert.") + count("action_in_proj.") + count("action_out_proj.")
    # Qwen3-VL-8B is 8.767B at vocab 151936; embeddings and lm_head grow by 3761 rows each
    assert backbone == 8_767_123_696 + 2 * 3761 * 4096
    assert 2.2e9 < expert < 2.4e9  # published: ~2.3B
    assert shapes["expert.layers.35.self_attn.k_proj.weight"] == (8 * 128, 2048)
