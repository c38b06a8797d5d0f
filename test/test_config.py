"""config.json -> typed configs: upstream field names, strict validation, backbone lookup."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from alpamayo_ros.core.config import AlpamayoConfig
from alpamayo_ros.core.tiny_checkpoint import write_checkpoint


def variant(source: Path, target: Path, edit: Callable[[dict[str, Any]], None], backbone_edit=None) -> Path:
    """Copy a checkpoint's config files (not its weights) and edit config.json."""
    raw = json.loads((source / "config.json").read_text())
    edit(raw)
    (target / "config.json").write_text(json.dumps(raw))
    if (source / "backbone").is_dir():
        shutil.copytree(source / "backbone", target / "backbone")
        if backbone_edit is not None:
            backbone = json.loads((target / "backbone" / "config.json").read_text())
            backbone_edit(backbone)
            (target / "backbone" / "config.json").write_text(json.dumps(backbone))
    return target


def test_tiny_checkpoint_config(tiny_checkpoint: Path) -> None:
    config = AlpamayoConfig.from_checkpoint(tiny_checkpoint)
    assert config.vlm_name_or_path == "backbone"
    assert config.backbone.source == str(tiny_checkpoint / "backbone" / "config.json")
    assert (config.vocab_size, config.traj_vocab_size) == (155697, 4000)
    assert (config.traj_token_start_idx, config.hist_token_start_idx) == (151669, 154669)
    assert (config.hist_num_bins, config.hist_xyz_min, config.hist_xyz_max) == (1000, (-4, -4, -10), (4, 4, 10))
    assert (config.tokens_per_history_traj, config.tokens_per_future_traj, config.flow_steps) == (48, 128, 10)
    expert = config.expert
    assert (expert.hidden_size, expert.intermediate_size, expert.num_layers) == (96, 192, 4)
    assert (expert.num_heads, expert.num_kv_heads, expert.head_dim) == (4, 2, 32)
    assert (expert.mrope_section, expert.rope_theta, expert.action_hidden_size) == ((6, 5, 5), 5e6, 64)
    assert config.action_space.accel_std == 0.6796875
    assert config.action_space.curvature_mean == 0.0002689361572265625
    assert (config.vision.min_pixels, config.vision.max_pixels, config.vision.patch_size) == (163840, 196608, 16)
    assert config.history_tokenizer().num_bins == 1000


def test_released_backbone_name_uses_the_packaged_config(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, full_size=True, weights=False)
    config = AlpamayoConfig.from_checkpoint(tmp_path)
    assert config.vlm_name_or_path == "nvidia/Cosmos-Reason2-8B"
    assert config.backbone.source.endswith("qwen3_vl_8b_config.json")
    assert (config.backbone.num_layers, config.backbone.num_kv_heads, config.backbone.head_dim) == (36, 8, 128)
    assert (config.expert.hidden_size, config.expert.num_layers, config.expert.mrope_section) == (
        2048,
        36,
        (24, 20, 20),
    )
    hf = config.backbone.hf_config(config.vocab_size, torch.bfloat16)
    assert hf.text_config.vocab_size == hf.vocab_size == 155697
    assert hf.text_config.rope_parameters["mrope_section"] == [24, 20, 20]
    assert hf.vision_config.deepstack_visual_indexes == [8, 16, 24]
    assert not list(tmp_path.glob("*.safetensors"))


def test_qwen_backbone_name_is_known(tiny_checkpoint: Path, tmp_path: Path) -> None:
    def edit(raw: dict) -> None:
        raw["vlm_name_or_path"] = "Qwen/Qwen3-VL-8B-Instruct"
        raw["expert_cfg"] = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8}

    config = AlpamayoConfig.from_checkpoint(variant(tiny_checkpoint, tmp_path, edit))
    assert (config.expert.num_kv_heads, config.expert.head_dim, config.expert.num_layers) == (8, 128, 36)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw.update(vlm_name_or_path="someone/Unknown-VL"), r"vlm_name_or_path: 'someone/Unknown-VL'"),
        (
            lambda raw: raw["action_space_cfg"].update(_target_="os.system"),
            r"action_space_cfg._target_: unknown target 'os.system'",
        ),
        (lambda raw: raw["diffusion_cfg"].update(_target_="my.Diffusion"), r"diffusion_cfg._target_"),
        (lambda raw: raw["action_in_proj_cfg"].pop("_target_"), r"action_in_proj_cfg._target_: unknown target None"),
        (
            lambda raw: raw["action_in_proj_cfg"].update(dropout=0.1),
            r"action_in_proj_cfg: unsupported keys \['dropout'\]",
        ),
        (lambda raw: raw.update(vocab_size=155696), r"vocab_size: 155696 != 151669 \+ traj_vocab_size 4000"),
        (lambda raw: raw.update(traj_vocab_size=768), r"vocab_size: 155697 != 151669 \+ traj_vocab_size 768"),
        (
            lambda raw: raw["traj_token_ids"].update(future_start=155682),
            r"traj_token_ids.future_start: expected 155681",
        ),
        (
            lambda raw: raw["expert_cfg"].update(num_key_value_heads=4),
            r"expert_cfg.num_key_value_heads: 4 != backbone's 2",
        ),
        (lambda raw: raw["expert_cfg"].update(head_dim=16), r"expert_cfg.head_dim: 16 != backbone's 32"),
        (lambda raw: raw["expert_cfg"].update(num_hidden_layers=5), r"expert_cfg.num_hidden_layers: 5 > backbone's 4"),
        (lambda raw: raw["expert_cfg"].update(sliding_window=8), r"expert_cfg.sliding_window: not supported"),
        (lambda raw: raw.pop("min_pixels"), r"min_pixels: missing"),
        (lambda raw: raw.update(model_type="alpamayo_r1"), r"model_type: expected 'alpamayo1_5'"),
        (lambda raw: raw.update(add_special_tokens=False), r"add_special_tokens: must be true"),
        (lambda raw: raw["diffusion_cfg"].update(int_method="heun"), r"diffusion_cfg.int_method"),
        (lambda raw: raw["hist_traj_tokenizer_cfg"].update(num_bins=1001), r"hist_traj_tokenizer_cfg.num_bins"),
        (lambda raw: raw["hist_traj_tokenizer_cfg"].update(predict_yaw=True), r"hist_traj_tokenizer_cfg.predict_yaw"),
        (lambda raw: raw["action_space_cfg"].update(n_waypoints=32), r"action_space_cfg.n_waypoints"),
        (lambda raw: raw["action_space_cfg"].update(accel_std=0.0), r"action_space_cfg: accel_std"),
        (lambda raw: raw["action_out_proj_cfg"].update(bias=False), r"action_out_proj_cfg.bias"),
    ],
)
def test_bad_fields_are_named(tiny_checkpoint: Path, tmp_path: Path, edit: Callable, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AlpamayoConfig.from_checkpoint(variant(tiny_checkpoint, tmp_path, edit))


def test_history_bins_without_a_future_tokenizer_start_at_i0(tiny_checkpoint: Path, tmp_path: Path) -> None:
    config = AlpamayoConfig.from_checkpoint(
        variant(tiny_checkpoint, tmp_path, lambda raw: raw.pop("traj_tokenizer_cfg"))
    )
    assert config.hist_token_start_idx == 151669


def test_broken_backbone_config_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    target = variant(tiny_checkpoint, tmp_path, lambda raw: None, lambda backbone: backbone.pop("vision_config"))
    with pytest.raises(ValueError, match=r"vlm_name_or_path: .*backbone/config.json lacks vision_config"):
        AlpamayoConfig.from_checkpoint(target)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint_dir: no config.json"):
        AlpamayoConfig.from_checkpoint(tmp_path)
