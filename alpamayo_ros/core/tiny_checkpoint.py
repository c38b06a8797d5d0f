"""Write random Alpamayo 1.5 checkpoints in exactly the upstream layout (tests, demo, GPU bench).

A checkpoint directory holds `config.json` (upstream field names), the extended tokenizer,
`model.safetensors` (or shards + index) with upstream tensor names, and, for the tiny model,
the backbone's Qwen3-VL config under `backbone/config.json` (named by `vlm_name_or_path`).

The tiny model keeps the real vocabulary (token ids are fixed by the model) and the real
image geometry, with small widths. Its weights are drawn with fan-in scaled normals and a
peaky lm_head, so greedy decoding moves between tokens instead of repeating one.
`--full-size` writes the released architecture (Qwen3-VL-8B backbone + ~2.3B expert) without
weights; add `--dummy-weights` to fill them randomly on a device (GPU benchmark).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .checkpoint import BACKBONE_PREFIX_MAP, SHARD_INDEX_FILE, SINGLE_FILE
from .config import CONFIG_FILE, AlpamayoConfig
from .expert import ActionExpertModel
from .tokenizer import (
    DEFAULT_TRAJ_VOCAB_SIZE,
    QWEN3_VOCAB_SIZE,
    extended_vocab_size,
    save_tokenizer,
    traj_token_ids,
)

logger = logging.getLogger(__name__)

TINY_BACKBONE_DIR = "backbone"
RELEASED_BACKBONE = "nvidia/Cosmos-Reason2-8B"
MAX_SHARD_BYTES = 4 << 30  # larger checkpoints are split into shards of at most this size

#: Tiny Qwen3-VL: real token ids and patch geometry, small widths.
TINY_BACKBONE: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_vl_text",
        "vocab_size": 151936,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000,
        "rope_scaling": {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True},
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "tie_word_embeddings": False,
        "dtype": "float32",
    },
    "vision_config": {
        "model_type": "qwen3_vl",
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [0, 1],
        "in_channels": 3,
    },
}

#: Expert overrides. Released values are unpublished: kv heads and head_dim are forced by
#: the backbone cache; hidden 2048 / MLP 6912 / 32 heads is our estimate of the ~2.3B expert.
TINY_EXPERT = {
    "head_dim": 32,
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
FULL_EXPERT = {
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6912,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}

_ACTION_SPACE = {
    "_target_": "alpamayo1_5.action_space.UnicycleAccelCurvatureActionSpace",
    "a_lambda": 0.0001, "a_ridge": 0.0001, "accel_bounds": [-9.8, 9.8],
    "accel_mean": 0.029052734375, "accel_std": 0.6796875,
    "curvature_bounds": [-0.2, 0.2], "curvature_mean": 0.0002689361572265625,
    "curvature_std": 0.026123046875, "dt": 0.1, "kappa_lambda": 0.0001, "kappa_ridge": 0.0001,
    "n_waypoints": 64, "theta_lambda": 1e-06, "theta_ridge": 1e-08, "v_lambda": 1e-06, "v_ridge": 0.0001,
}  # fmt: skip


def alpamayo_config_json(
    *, vlm_name_or_path: str, expert_cfg: dict[str, Any], action_hidden: int, dtype: str
) -> dict[str, Any]:
    """An Alpamayo 1.5 config.json in upstream's layout (section 11 of the model facts)."""
    traj_vocab = DEFAULT_TRAJ_VOCAB_SIZE
    return {
        "action_in_proj_cfg": {
            "_target_": "alpamayo1_5.models.action_in_proj.PerWaypointActionInProjV2",
            "hidden_size": action_hidden, "max_freq": 100.0, "num_enc_layers": 4, "num_fourier_feats": 20,
        },
        "action_out_proj_cfg": {"_target_": "torch.nn.Linear"},
        "action_space_cfg": dict(_ACTION_SPACE),
        "add_special_tokens": True,
        "architectures": ["Alpamayo1_5"],
        "attn_implementation": "sdpa",
        "diffusion_cfg": {
            "_target_": "alpamayo1_5.diffusion.flow_matching.FlowMatching",
            "inference_guidance_weight": 1.0, "int_method": "euler", "num_inference_steps": 10,
            "use_classifier_free_guidance": False,
        },
        "dtype": dtype,
        "expert_cfg": dict(expert_cfg),
        "expert_non_causal_attention": True,
        "hist_traj_tokenizer_cfg": {
            "_target_": "alpamayo1_5.models.delta_tokenizer.DeltaTrajectoryTokenizer",
            "ego_xyz_max": [4, 4, 10], "ego_xyz_min": [-4, -4, -10], "num_bins": 1000,
        },
        "include_camera_ids": False,
        "include_frame_nums": False,
        "keep_same_dtype": True,
        "max_pixels": 196608,
        "min_pixels": 163840,
        "model_dtype": dtype,
        "model_type": "alpamayo1_5",
        "tokens_per_future_traj": 128,
        "tokens_per_history_traj": 48,
        "traj_token_ids": traj_token_ids(traj_vocab),
        "traj_token_start_idx": QWEN3_VOCAB_SIZE,
        "traj_tokenizer_cfg": {
            "_recursive_": False,
            "_target_": "alpamayo1_5.action_space.discrete_action_space.DiscreteTrajectoryTokenizer",
            "action_space_cfg": dict(_ACTION_SPACE),
            "dims_max": [5.0, 5.0], "dims_min": [-5.0, -5.0], "num_bins": 3000,
        },
        "traj_vocab_size": traj_vocab,
        "transformers_version": "4.57.1",
        "vlm_backend": "qwenvl3",
        "vlm_name_or_path": vlm_name_or_path,
        "vocab_size": extended_vocab_size(traj_vocab),
    }  # fmt: skip


def tensor_shapes(config: AlpamayoConfig) -> dict[str, tuple[int, ...]]:
    """Upstream tensor name -> shape for a config, from meta-device modules (no memory)."""
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        backbone = Qwen3VLForConditionalGeneration(config.backbone.hf_config(config.vocab_size, torch.float32))
        expert = ActionExpertModel(config.expert)
    shapes: dict[str, tuple[int, ...]] = {}
    reverse = {module: ckpt for ckpt, module in BACKBONE_PREFIX_MAP.items()}
    for name, tensor in backbone.state_dict().items():
        module_prefix = next(prefix for prefix in reverse if name.startswith(prefix))
        shapes[reverse[module_prefix] + name[len(module_prefix) :]] = tuple(tensor.shape)
    for name, tensor in expert.state_dict().items():
        shapes[name] = tuple(tensor.shape)
    return shapes


def random_state_dict(
    config: AlpamayoConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Random weights under upstream tensor names, deterministic in seed.

    Norm scales are 1 + small noise, biases small, embeddings unit normal, matrices
    N(0, 1/fan_in) and the lm_head 3x that (peaky logits: greedy text is not one token
    repeated). Drawn in fp32 on `device`, then cast.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(tensor_shapes(config).items()):
        values = torch.randn(shape, generator=generator, device=device)
        leaf = name.split(".")[-2]  # module name, e.g. "lm_head"
        if len(shape) == 1 and name.endswith("weight"):  # norm scales
            values = 1.0 + 0.1 * values
        elif name.endswith("bias"):
            values = 0.02 * values
        elif leaf in ("embed_tokens", "pos_embed"):
            pass
        else:
            fan_in = math.prod(shape[1:])
            gain = 3.0 if leaf == "lm_head" else 1.0
            values = values * (gain / math.sqrt(fan_in))
            if name == "action_in_proj.encoder.trunk.0.weight":
                values = values / _fourier_frequencies(config).to(values.device)
        tensors[name] = values.to(dtype).contiguous()
    return tensors


def _fourier_frequencies(config: AlpamayoConfig) -> torch.Tensor:
    """Frequency behind each input column of action_in_proj's first layer.

    Its inputs are [sin, cos](2 pi f x) for f up to 100 cycles per unit. With plain random
    weights the velocity field then changes ~1000x faster than its input, and 10 Euler steps
    turn 1e-5 numeric noise (CPU vs GPU, HF vs vLLM K/V) into different trajectories. Scaling
    each column by 1/f keeps the random flow smooth, so plans stay comparable.
    """
    expert = config.expert
    half = expert.num_fourier_feats // 2
    freqs = torch.logspace(0.0, math.log10(expert.max_freq), half)
    return freqs.repeat(2 * 3)  # (sin, cos) x (accel, curvature, t)


def write_checkpoint(
    out_dir: str | Path,
    *,
    full_size: bool = False,
    weights: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Path:
    """Write a checkpoint directory; returns its path.

    Tiny by default (with weights); full_size writes the released architecture and, only
    when weights is True, random full-size weights in shards.
    """
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    dtype_name = str(dtype).removeprefix("torch.")
    if full_size:
        raw = alpamayo_config_json(
            vlm_name_or_path=RELEASED_BACKBONE, expert_cfg=FULL_EXPERT, action_hidden=1024, dtype=dtype_name
        )
    else:
        backbone_dir = directory / TINY_BACKBONE_DIR
        backbone_dir.mkdir(exist_ok=True)
        backbone = json.loads(json.dumps(TINY_BACKBONE))
        backbone["text_config"]["dtype"] = dtype_name
        (backbone_dir / CONFIG_FILE).write_text(json.dumps(backbone, indent=1))
        raw = alpamayo_config_json(
            vlm_name_or_path=TINY_BACKBONE_DIR, expert_cfg=TINY_EXPERT, action_hidden=64, dtype=dtype_name
        )
    (directory / CONFIG_FILE).write_text(json.dumps(raw, indent=1, sort_keys=True))
    save_tokenizer(directory)
    config = AlpamayoConfig.from_checkpoint(directory)  # the written files must validate
    if weights:
        save_tensors(random_state_dict(config, seed=seed, dtype=dtype, device=device), directory)
    logger.info("wrote %s checkpoint to %s", "full-size" if full_size else "tiny", directory)
    return directory


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write one model.safetensors, or shards + index (HF naming) when larger than one shard."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= max_shard_bytes:
        save_file({k: v.cpu() for k, v in tensors.items()}, str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.cpu() for k, v in shard.items()}, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SHARD_INDEX_FILE).write_text(json.dumps(index_json, indent=1, sort_keys=True))


def main(argv: list[str] | None = None) -> None:
    """Console script `alpamayo-make-checkpoint OUT [--full-size [--dummy-weights]]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--full-size", action="store_true", help="released architecture (config only)")
    parser.add_argument("--dummy-weights", action="store_true", help="with --full-size: also write random weights")
    parser.add_argument("--device", default="cpu", help="where random weights are drawn (e.g. cuda)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="weight dtype (default: float32 tiny, bfloat16 full size)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.dummy_weights and not args.full_size:
        parser.error("--dummy-weights: only with --full-size (tiny checkpoints always have weights)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.full_size else "float32"))
    write_checkpoint(
        args.out_dir,
        full_size=args.full_size,
        weights=not args.full_size or args.dummy_weights,
        seed=args.seed,
        dtype=dtype,
        device=args.device,
    )


if __name__ == "__main__":
    main()
