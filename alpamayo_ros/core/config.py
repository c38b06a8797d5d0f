"""Read an upstream Alpamayo 1.5 `config.json` into our typed configs, strictly.

Upstream's `*_cfg` entries are hydra specs (`_target_` + constructor kwargs). We never import
or instantiate a `_target_` (a config file must not be able to run code): each field accepts
one known upstream class, identified by its class name, and only that class's constructor
keys. Anything else, and any field that contradicts another, is a ValueError naming the field.

The backbone (Qwen3-VL) architecture is not in `config.json`; upstream rebuilds it from
`vlm_name_or_path`. We read `<ckpt>/<vlm_name_or_path>/config.json` when that file exists
(tiny test checkpoints, local copies), else the packaged config of a known backbone name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .action_space import ActionSpaceConfig
from .expert import ExpertConfig
from .history_tokens import DeltaHistoryTokenizer
from .preprocess import VisionGeometry
from .tokenizer import BASE_TOKEN_IDS, QWEN3_VOCAB_SIZE, extended_vocab_size, traj_token_ids

CONFIG_FILE = "config.json"
_DATA_DIR = Path(__file__).parent / "data"

#: Backbone names whose architecture we ship (Cosmos-Reason2-8B has Qwen3-VL-8B's layout).
KNOWN_BACKBONES: dict[str, str] = {
    "nvidia/Cosmos-Reason2-8B": "qwen3_vl_8b_config.json",
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl_8b_config.json",
}
# field -> (accepted upstream class name, constructor keys we accept)
_TARGETS: dict[str, tuple[str, frozenset[str]]] = {
    "action_space_cfg": ("UnicycleAccelCurvatureActionSpace", frozenset(ActionSpaceConfig.__dataclass_fields__)),
    "diffusion_cfg": (
        "FlowMatching",
        frozenset({"int_method", "num_inference_steps", "inference_guidance_weight", "use_classifier_free_guidance"}),
    ),
    "action_in_proj_cfg": (
        "PerWaypointActionInProjV2",
        frozenset({"hidden_size", "num_enc_layers", "max_freq", "num_fourier_feats"}),
    ),
    "action_out_proj_cfg": ("Linear", frozenset({"bias"})),
    "hist_traj_tokenizer_cfg": (
        "DeltaTrajectoryTokenizer",
        frozenset(
            {"ego_xyz_min", "ego_xyz_max", "ego_yaw_min", "ego_yaw_max", "num_bins", "predict_yaw", "load_weights"}
        ),
    ),
    "traj_tokenizer_cfg": (
        "DiscreteTrajectoryTokenizer",
        frozenset({"_recursive_", "action_space_cfg", "dims_min", "dims_max", "num_bins", "load_weights"}),
    ),
}
_HYDRA_KEYS = frozenset({"_target_", "_recursive_", "_convert_", "_partial_"})

# expert_cfg key -> ExpertConfig field; plus text-config keys that do not change inference.
_EXPERT_KEYS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "attention_bias": "attention_bias",
}
_EXPERT_INERT_KEYS = frozenset({
    "attn_implementation", "_attn_implementation", "dtype", "torch_dtype", "use_cache",
    "attention_dropout", "initializer_range", "max_position_embeddings",
})  # fmt: skip


@dataclass(frozen=True)
class BackboneConfig:
    """The Qwen3-VL backbone's config.json (HF layout) plus the numbers the pipeline checks."""

    source: str  # file it was read from, for messages
    raw: dict[str, Any] = field(repr=False)

    @property
    def text(self) -> dict[str, Any]:
        return self.raw["text_config"]

    @property
    def vision(self) -> dict[str, Any]:
        return self.raw["vision_config"]

    @property
    def num_layers(self) -> int:
        return int(self.text["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.text["num_key_value_heads"])

    @property
    def head_dim(self) -> int:
        text = self.text
        return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])

    @property
    def rope(self) -> dict[str, Any]:
        """rope_parameters (transformers 5 layout) or rope_scaling + rope_theta (4.x layout)."""
        text = self.text
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope.setdefault("rope_theta", text.get("rope_theta"))
        return rope

    def vision_geometry(self, min_pixels: int, max_pixels: int) -> VisionGeometry:
        """Preprocessing geometry from the vision tower's patching and the pixel bounds."""
        vision = self.vision
        return VisionGeometry(
            patch_size=int(vision.get("patch_size", 16)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            merge_size=int(vision.get("spatial_merge_size", 2)),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )

    def hf_config(self, vocab_size: int, dtype: torch.dtype):
        """Build transformers' Qwen3VLConfig with the vocabulary extended to vocab_size (as upstream)."""
        from transformers import Qwen3VLConfig

        raw = {key: value for key, value in self.raw.items() if not key.startswith("_")}
        config = Qwen3VLConfig(**raw)
        config.text_config.vocab_size = vocab_size
        config.vocab_size = vocab_size
        config.text_config.dtype = dtype
        config.dtype = dtype
        return config


@dataclass(frozen=True)
class AlpamayoConfig:
    """Everything a checkpoint's config.json (and its backbone config) says, validated."""

    checkpoint_dir: Path
    vlm_name_or_path: str
    backbone: BackboneConfig
    expert: ExpertConfig
    action_space: ActionSpaceConfig
    vision: VisionGeometry
    traj_vocab_size: int
    traj_token_start_idx: int  # id of <i0>
    hist_token_start_idx: int  # id of history bin 0
    vocab_size: int
    hist_num_bins: int
    hist_xyz_min: tuple[float, float, float]
    hist_xyz_max: tuple[float, float, float]
    tokens_per_history_traj: int
    tokens_per_future_traj: int  # upstream's default max reasoning tokens
    flow_steps: int  # diffusion_cfg.num_inference_steps
    model_dtype: str
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> AlpamayoConfig:
        """Read and validate `<checkpoint_dir>/config.json`."""
        directory = Path(checkpoint_dir)
        path = directory / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint_dir: no {CONFIG_FILE} in {directory}")
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
        return cls.from_dict(raw, directory)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], checkpoint_dir: Path) -> AlpamayoConfig:
        """Validate a parsed config.json (see from_checkpoint)."""
        model_type = raw.get("model_type")
        if model_type != "alpamayo1_5":
            raise ValueError(f"model_type: expected 'alpamayo1_5', got {model_type!r}")
        if raw.get("add_special_tokens") is not True:
            raise ValueError("add_special_tokens: must be true (Alpamayo 1.5's token layout)")
        if raw.get("expert_non_causal_attention", True) is not True:
            raise ValueError("expert_non_causal_attention: only true (bidirectional action tokens) is supported")
        vlm_name = _require(raw, "vlm_name_or_path", str)
        backbone = load_backbone_config(checkpoint_dir, vlm_name)

        traj_vocab_size = _require(raw, "traj_vocab_size", int)
        traj_start = _integer(raw.get("traj_token_start_idx", QWEN3_VOCAB_SIZE), "traj_token_start_idx")
        if traj_start != QWEN3_VOCAB_SIZE:
            raise ValueError(f"traj_token_start_idx: expected {QWEN3_VOCAB_SIZE}, got {traj_start}")
        vocab_size = _require(raw, "vocab_size", int)
        expected_vocab = extended_vocab_size(traj_vocab_size)
        if vocab_size != expected_vocab:
            raise ValueError(
                f"vocab_size: {vocab_size} != {QWEN3_VOCAB_SIZE} + traj_vocab_size {traj_vocab_size} + "
                f"{expected_vocab - QWEN3_VOCAB_SIZE - traj_vocab_size} specials = {expected_vocab}"
            )
        _check_traj_token_ids(raw.get("traj_token_ids"), traj_vocab_size)

        action_space = _action_space(_spec(raw, "action_space_cfg"))
        if action_space.n_waypoints != 64:
            raise ValueError(f"action_space_cfg.n_waypoints: only 64 is supported, got {action_space.n_waypoints}")
        flow_steps = _diffusion_steps(_spec(raw, "diffusion_cfg"))
        _check_out_proj(_spec(raw, "action_out_proj_cfg"))
        hist = _spec(raw, "hist_traj_tokenizer_cfg")
        if hist.get("predict_yaw", False):
            raise ValueError("hist_traj_tokenizer_cfg.predict_yaw: only false is supported")
        hist_bins = _integer(hist.get("num_bins", 1000), "hist_traj_tokenizer_cfg.num_bins")
        hist_min = _triple(hist.get("ego_xyz_min", (-4, -4, -10)), "hist_traj_tokenizer_cfg.ego_xyz_min")
        hist_max = _triple(hist.get("ego_xyz_max", (4, 4, 10)), "hist_traj_tokenizer_cfg.ego_xyz_max")
        # Upstream offsets history bins by the discrete future tokenizer's vocabulary, if any.
        future_bins = (
            _integer(_spec(raw, "traj_tokenizer_cfg").get("num_bins", 0), "traj_tokenizer_cfg.num_bins")
            if raw.get("traj_tokenizer_cfg")
            else 0
        )
        hist_start = traj_start + future_bins
        if hist_start + hist_bins > traj_start + traj_vocab_size:
            raise ValueError(
                f"hist_traj_tokenizer_cfg.num_bins: bins [{hist_start}, {hist_start + hist_bins}) overflow the "
                f"<i*> range ending at {traj_start + traj_vocab_size} (traj_vocab_size {traj_vocab_size})"
            )
        tokens_per_history = _integer(raw.get("tokens_per_history_traj", 48), "tokens_per_history_traj")
        if tokens_per_history != 48:
            raise ValueError(f"tokens_per_history_traj: expected 48 (16 poses x 3), got {tokens_per_history}")

        min_pixels = _require(raw, "min_pixels", int)
        max_pixels = _require(raw, "max_pixels", int)
        return cls(
            checkpoint_dir=checkpoint_dir,
            vlm_name_or_path=vlm_name,
            backbone=backbone,
            expert=_expert_config(raw, backbone),
            action_space=action_space,
            vision=backbone.vision_geometry(min_pixels, max_pixels),
            traj_vocab_size=traj_vocab_size,
            traj_token_start_idx=traj_start,
            hist_token_start_idx=hist_start,
            vocab_size=vocab_size,
            hist_num_bins=hist_bins,
            hist_xyz_min=hist_min,
            hist_xyz_max=hist_max,
            tokens_per_history_traj=tokens_per_history,
            tokens_per_future_traj=_integer(raw.get("tokens_per_future_traj", 128), "tokens_per_future_traj"),
            flow_steps=flow_steps,
            model_dtype=str(raw.get("model_dtype", "bfloat16")),
            raw=raw,
        )

    def history_tokenizer(self) -> DeltaHistoryTokenizer:
        """The ego-history tokenizer this checkpoint was trained with (bins, not ids)."""
        return DeltaHistoryTokenizer(self.hist_num_bins, self.hist_xyz_min, self.hist_xyz_max)


def load_backbone_config(checkpoint_dir: Path, vlm_name_or_path: str) -> BackboneConfig:
    """Backbone config from the checkpoint directory, else from the packaged known configs."""
    local = Path(checkpoint_dir) / vlm_name_or_path / CONFIG_FILE
    if local.is_file():
        path = local
    elif vlm_name_or_path in KNOWN_BACKBONES:
        path = _DATA_DIR / KNOWN_BACKBONES[vlm_name_or_path]
    else:
        raise ValueError(
            f"vlm_name_or_path: {vlm_name_or_path!r} has no {local} and is not a known backbone "
            f"({sorted(KNOWN_BACKBONES)}); put its Qwen3-VL config.json there"
        )
    with open(path, encoding="utf-8") as handle:
        raw = json.load(handle)
    for key in ("text_config", "vision_config"):
        if not isinstance(raw.get(key), dict):
            raise ValueError(f"vlm_name_or_path: {path} lacks {key}")
    text = raw["text_config"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        if not isinstance(text.get(key), int):
            raise ValueError(f"vlm_name_or_path: {path} text_config.{key} missing or not an int")
    for key, token in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>")):
        if raw.get(key, BASE_TOKEN_IDS[token]) != BASE_TOKEN_IDS[token]:
            raise ValueError(f"vlm_name_or_path: {path} {key} {raw[key]} != {BASE_TOKEN_IDS[token]} ({token})")
    return BackboneConfig(source=str(path), raw=raw)


def _expert_config(raw: dict[str, Any], backbone: BackboneConfig) -> ExpertConfig:
    """Backbone text config + expert_cfg overrides + action_in_proj sizes -> ExpertConfig."""
    overrides = raw.get("expert_cfg") or {}
    if not isinstance(overrides, dict):
        raise ValueError(f"expert_cfg: expected an object, got {type(overrides).__name__}")
    text = dict(backbone.text)
    for key, value in overrides.items():
        if key not in _EXPERT_KEYS and key not in _EXPERT_INERT_KEYS and key != "hidden_act":
            raise ValueError(f"expert_cfg.{key}: not supported (known: {sorted(_EXPERT_KEYS)})")
        text[key] = value
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"expert_cfg.hidden_act: only 'silu' is supported, got {text['hidden_act']!r}")
    values = {ours: text[theirs] for theirs, ours in _EXPERT_KEYS.items() if theirs in text}
    values.setdefault("head_dim", text["hidden_size"] // text["num_attention_heads"])
    if values["num_kv_heads"] != backbone.num_kv_heads:
        raise ValueError(
            f"expert_cfg.num_key_value_heads: {values['num_kv_heads']} != backbone's {backbone.num_kv_heads} "
            "(the expert reads the backbone's K/V cache)"
        )
    if values["head_dim"] != backbone.head_dim:
        raise ValueError(f"expert_cfg.head_dim: {values['head_dim']} != backbone's {backbone.head_dim}")
    if values["num_layers"] > backbone.num_layers:
        raise ValueError(
            f"expert_cfg.num_hidden_layers: {values['num_layers']} > backbone's {backbone.num_layers} cache layers"
        )
    rope = backbone.rope
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"vlm_name_or_path: rope_type {rope.get('rope_type')!r} is not supported")
    proj = _spec(raw, "action_in_proj_cfg")
    return ExpertConfig(
        **values,
        rope_theta=float(rope["rope_theta"]),
        mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))),
        mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        action_hidden_size=_integer(proj.get("hidden_size", 1024), "action_in_proj_cfg.hidden_size"),
        num_fourier_feats=_integer(proj.get("num_fourier_feats", 20), "action_in_proj_cfg.num_fourier_feats"),
        max_freq=float(proj.get("max_freq", 100.0)),
        num_enc_layers=_integer(proj.get("num_enc_layers", 4), "action_in_proj_cfg.num_enc_layers"),
        n_waypoints=_integer(_spec(raw, "action_space_cfg").get("n_waypoints", 64), "action_space_cfg.n_waypoints"),
    )


def _spec(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Return a hydra spec's kwargs, after checking that its `_target_` names the expected class."""
    spec = raw.get(name)
    if not isinstance(spec, dict):
        raise ValueError(f"{name}: missing or not an object")
    target = spec.get("_target_")
    expected, keys = _TARGETS[name]
    if not isinstance(target, str) or target.rsplit(".", 1)[-1] != expected:
        raise ValueError(f"{name}._target_: unknown target {target!r} (supported: a class named {expected})")
    unknown = sorted(set(spec) - keys - _HYDRA_KEYS)
    if unknown:
        raise ValueError(f"{name}: unsupported keys {unknown} for {expected}")
    return {key: value for key, value in spec.items() if key not in _HYDRA_KEYS}


def _action_space(kwargs: dict[str, Any]) -> ActionSpaceConfig:
    values = dict(kwargs)
    try:
        for key in ("accel_bounds", "curvature_bounds"):
            if key in values:
                values[key] = tuple(float(v) for v in values[key])
        return ActionSpaceConfig(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"action_space_cfg: {error}") from error


def _diffusion_steps(kwargs: dict[str, Any]) -> int:
    method = kwargs.get("int_method", "euler")
    if method != "euler":
        raise ValueError(f"diffusion_cfg.int_method: only 'euler' is supported, got {method!r}")
    steps = kwargs.get("num_inference_steps", 10)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"diffusion_cfg.num_inference_steps: must be an int >= 1, got {steps!r}")
    return steps


def _check_out_proj(kwargs: dict[str, Any]) -> None:
    if kwargs.get("bias", True) is not True:
        raise ValueError("action_out_proj_cfg.bias: only true is supported")


def _check_traj_token_ids(table: Any, traj_vocab_size: int) -> None:
    """Check that traj_token_ids holds the ids the special-token order implies."""
    if table is None:
        return
    if not isinstance(table, dict):
        raise ValueError("traj_token_ids: expected an object")
    for name, expected in traj_token_ids(traj_vocab_size).items():
        if table.get(name) != expected:
            raise ValueError(f"traj_token_ids.{name}: expected {expected}, got {table.get(name)!r}")


def _require(raw: dict[str, Any], name: str, kind: type) -> Any:
    value = raw.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{name}: missing or not a {kind.__name__} (got {value!r})")
    return value


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    numbers = isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    )
    if not numbers or len(value) != 3:
        raise ValueError(f"{name}: expected 3 numbers, got {value!r}")
    return tuple(float(v) for v in value)


def _integer(value: Any, name: str) -> int:
    """An int field of config.json (an integral float is accepted); the error names the field."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    return value
