"""Every parameter of the drive node: one declared table, parsed into typed settings.

ROS-free, so the evaluator, its Ray workers and the server read the same parameters as the node
without rclpy (alpamayo_ros/ros/params.py declares the table on a node). The table is the single
source the node declares from; config/drive.yaml,
config/drive.schema.json and the launch file are checked against it by a static test, so
the four cannot drift. parse_settings() validates everything at start and raises
ParameterError naming the parameter at fault.

Over 400 lines because the table is one declaration: ~60 parameters with their type, default,
range and description, in the order README documents them; split, it would stop being the one
place a parameter is read from.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from alpamayo_ros.core.types import (
    CAMERAS,
    CASCADE_MODES,
    EXPERT_QUANTIZATIONS,
    FRAMES_PER_CAMERA,
    NUM_HISTORY_POSES,
    SPECULATION_METHODS,
    SPECULATION_PROPOSERS,
    SamplingSettings,
)
from alpamayo_ros.inputs.ego_history import EgoHistoryConfig
from alpamayo_ros.inputs.frame_sync import FrameSyncConfig
from alpamayo_ros.inputs.route import DEFAULT_MAX_ROUTE_CHARS
from alpamayo_ros.frame_transport import FRAME_TRANSPORTS

NS_PER_S = 1_000_000_000
RELIABILITIES = ("best_effort", "reliable")
DURABILITIES = ("volatile", "transient_local")
TRANSPORTS = ("raw", "compressed")
SELECTIONS = ("first", "medoid", "all")
OUTPUT_FRAMES = ("ego", "odom")
TRIGGERS = ("timer", "frames")
BACKENDS = ("hf", "vllm", "remote")
DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")


class ParameterError(ValueError):
    """A parameter value the node cannot run with; the message starts with its name."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"parameter '{name}': {problem}")
        self.name = name


@dataclass(frozen=True)
class ParamSpec:
    """One declared parameter. Numbers carry their unit in the name (_s, _hz, _m)."""

    name: str
    default: Any
    description: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    dynamic: bool = False  # may be changed while running (validated in the on-set callback)


PARAMETERS: tuple[ParamSpec, ...] = (
    # model
    ParamSpec(
        "model.checkpoint_path",
        "",
        "Checkpoint directory (config.json, safetensors, tokenizer). Required, except with model.backend remote"
        " (the server has the model).",
    ),
    ParamSpec(
        "model.backend",
        "hf",
        "Backbone backend: hf (transformers reference), vllm (in-process engine) or remote (an alpamayo-serve"
        " server at remote.url; model.device, model.dtype and vllm.* are then the server's business).",
        choices=BACKENDS,
    ),
    ParamSpec("model.device", "cpu", "Torch device: cpu, cuda or cuda:N."),
    ParamSpec(
        "model.dtype",
        "auto",
        "Model weights dtype; auto = the checkpoint's.",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    ParamSpec(
        "model.expert_quantization",
        "none",
        "Action expert weights: fp8 = FP8 copies of its layer weights (kernel chosen for the GPU: on compute capability 8.9+ vLLM's cutlass_scaled_mm up to 256 rows and torch._scaled_mm above, or torch._scaled_mm alone without vLLM's cutlass; else Marlin weight-only where vLLM has it; else dequantised), fp8_<kernel> = that kernel, none = full precision. In-process backends; a remote server has its own --expert-quantization.",
        choices=EXPERT_QUANTIZATIONS,
    ),
    ParamSpec("model.id", "", "Model name reported in Reasoning and diagnostics; empty = checkpoint folder name."),
    ParamSpec(
        "model.stay_up_on_failure",
        False,
        "After a failed model load keep the node up (ERROR diagnostics) instead of exiting with code 1"
        " (the exit lets launch's respawn act).",
    ),
    ParamSpec(
        "remote.url",
        "http://127.0.0.1:8000",
        "alpamayo-serve base URL (http:// or https://), used with model.backend remote.",
    ),
    ParamSpec(
        "remote.timeout_s",
        5.0,
        "Longest one remote plan may take (connect, send, plan, answer); beyond it the tick reports"
        " remote_timeout.",
        minimum=0.1,
        maximum=600.0,
    ),
    ParamSpec("remote.api_key", "", "Bearer key the server was started with (--api-key); empty = none."),
    ParamSpec(
        "remote.frame_transport",
        "auto",
        "How new frames reach the server: resized (resized on this host's CPU, sent in the request), shm (at"
        " capture size through shared memory, resized on the server's device; same host only) or auto (shm"
        " when remote.url's host is loopback, resized if the server cannot read it).",
        choices=FRAME_TRANSPORTS,
    ),
    ParamSpec(
        "vllm.dtype",
        "auto",
        "vLLM engine dtype; auto = model.dtype.",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    ParamSpec(
        "vllm.gpu_memory_utilization",
        0.85,
        "Fraction of GPU memory the vLLM engine may reserve.",
        minimum=0.05,
        maximum=1.0,
    ),
    ParamSpec(
        "vllm.kv_cache_gib",
        2.0,
        "KV cache the vLLM engine allocates (GiB; ~14k tokens at full size: an 8k context, or many "
        "samples sharing one prompt); 0 = size it from gpu_memory_utilization instead.",
        minimum=0.0,
        maximum=512.0,
    ),
    ParamSpec(
        "vllm.max_model_len",
        8192,
        "vLLM context length (tokens); must hold prompt + reasoning.",
        minimum=1024,
        maximum=262144,
    ),
    ParamSpec(
        "vllm.tensor_parallel_size",
        1,
        "GPUs the vLLM backbone is split over (the in-process K/V capture supports 1).",
        minimum=1,
        maximum=8,
    ),
    ParamSpec("vllm.enforce_eager", False, "Disable vLLM's CUDA graphs (decoder and vision tower) and torch.compile (faster start, slower steps)."),
    ParamSpec("vllm.quantization", "", "vLLM quantization method (e.g. fp8); empty = none."),
    ParamSpec(
        "vllm.cascade_attention",
        "off",
        "When the samples of a plan (sampling.num_samples > 1) attend to their shared prompt in one pass per decode step (vLLM's cascade attention, FlashAttention backend): off (vLLM's default), auto (vLLM's heuristic decides) or on (whenever rows share a prompt). auto and on start vLLM's V1 model runner (its V2 runner has no cascade attention). on measured 2.3x slower 16-sample decode than off on an H100 (a cascaded step leaves vLLM's full CUDA graph; README). Sampled ids may differ from off by float rounding only.",
        choices=CASCADE_MODES,
    ),
    # speculative reasoning (core/vllm_adapter/speculation.py; EngineOptions checks the same)
    ParamSpec(
        "vllm.speculation.method",
        "none",
        "Speculative reasoning: plans (draft from the reasoning of the last plans), ngram (vLLM's lookup in the row's own prompt and output) or none. Drafts are verified by the model, so plans are unchanged; model.backend vllm with tensor_parallel_size 1 only.",
        choices=SPECULATION_METHODS,
    ),
    ParamSpec("vllm.speculation.draft_tokens", 4, 'Tokens drafted per decode step when vllm.speculation.method is not none.', minimum=1, maximum=16),
    ParamSpec(
        "vllm.speculation.proposer",
        "auto",
        "Where vllm.speculation.method plans looks its drafts up: host (vLLM then schedules synchronously), device (on the GPU inside vLLM's step, vLLM scheduling ahead; CUDA only) or auto (device on a CUDA GPU, the faster one measured; host elsewhere; README).",
        choices=SPECULATION_PROPOSERS,
    ),
    # cameras
    ParamSpec(
        "cameras.topics",
        [
            "/camera/cross_left/image/compressed",
            "/camera/front_wide/image/compressed",
            "/camera/cross_right/image/compressed",
            "/camera/front_tele/image/compressed",
        ],
        "Camera image topics, one per entry of cameras.indices.",
    ),
    ParamSpec(
        "cameras.indices",
        [0, 1, 2, 6],
        "Upstream camera index of each topic: 0 cross left, 1 front wide, 2 cross right, 3 rear left, "
        "4 rear tele, 5 rear right, 6 front tele. Unique.",
    ),
    ParamSpec(
        "cameras.transports",
        ["compressed", "compressed", "compressed", "compressed"],
        "Per topic: raw (sensor_msgs/Image) or compressed (sensor_msgs/CompressedImage, JPEG/PNG).",
    ),
    ParamSpec(
        "cameras.frames",
        FRAMES_PER_CAMERA,
        "Frames per camera given to the model (t0 - (n-1)*spacing ... t0).",
        minimum=1,
        maximum=8,
    ),
    ParamSpec("cameras.frame_spacing_s", 0.1, "Time between a camera's model frames.", minimum=0.01, maximum=1.0),
    ParamSpec(
        "cameras.max_frame_error_s",
        0.05,
        "Largest allowed distance of a chosen frame from its target time.",
        minimum=0.0,
        maximum=1.0,
    ),
    ParamSpec(
        "cameras.max_skew_s",
        0.05,
        "How much older the slowest camera's newest frame may be than the other cameras' previous frames.",
        minimum=0.0,
        maximum=1.0,
    ),
    ParamSpec(
        "cameras.max_age_s",
        0.3,
        "Largest allowed age of a camera's newest frame (node clock); 0 = no check.",
        minimum=0.0,
        maximum=10.0,
    ),
    ParamSpec(
        "images.width",
        0,
        "Resize every frame to this width (px) on arrival; 0 = keep (needs images.height 0).",
        minimum=0,
        maximum=8192,
    ),
    ParamSpec(
        "images.height",
        0,
        "Resize every frame to this height (px) on arrival; 0 = keep (needs images.width 0).",
        minimum=0,
        maximum=8192,
    ),
    # odometry and history
    ParamSpec("odometry.topic", "/odom", "nav_msgs/Odometry topic; its header.frame_id is the odom output frame."),
    ParamSpec(
        "odometry.max_stale_s",
        0.1,
        "t0 may be at most this far after the newest odometry (bridged by extrapolation).",
        minimum=0.0,
        maximum=1.0,
    ),
    ParamSpec(
        "odometry.max_gap_s",
        0.25,
        "Largest allowed time between the odometry samples a history pose is interpolated from.",
        minimum=0.001,
        maximum=2.0,
    ),
    ParamSpec(
        "history.length",
        NUM_HISTORY_POSES,
        "Ego history poses; fixed by the model (16).",
        minimum=NUM_HISTORY_POSES,
        maximum=NUM_HISTORY_POSES,
    ),
    ParamSpec(
        "history.dt_s",
        0.1,
        "Time between ego history poses (the model was trained with 0.1).",
        minimum=0.01,
        maximum=1.0,
    ),
    # navigation
    ParamSpec(
        "navigation.topic", "/navigation/instruction", "std_msgs/String route instruction (e.g. 'Turn right in 30m')."
    ),
    ParamSpec(
        "navigation.max_chars",
        DEFAULT_MAX_ROUTE_CHARS,
        "Longest route text accepted; a longer one (or one holding model tokens) is refused at arrival"
        " and planning goes on without a route.",
        minimum=1,
        maximum=100_000,
    ),
    ParamSpec(
        "navigation.max_age_s",
        0.0,
        "Forget the route instruction this long after it arrived; 0 = keep it.",
        minimum=0.0,
        maximum=3600.0,
    ),
    ParamSpec(
        "inputs.max_future_s",
        0.5,
        "Largest time a camera or odometry stamp may be ahead of the node clock; beyond it the sensor"
        " is at fault (camera_future / odometry_future) and no plan is made.",
        minimum=0.0,
        maximum=60.0,
    ),
    # output
    ParamSpec(
        "output.frame",
        "ego",
        "Output frame: ego (ego frame at t0) or odom (odometry frame, via the pose at t0).",
        choices=OUTPUT_FRAMES,
    ),
    ParamSpec("output.ego_frame_id", "base_link", "frame_id used when output.frame is ego."),
    # planning and sampling
    ParamSpec(
        "planning.rate_hz",
        10.0,
        "Planning ticks per second; a tick while inference runs is skipped and counted.",
        minimum=0.1,
        maximum=100.0,
    ),
    ParamSpec(
        "planning.trigger",
        "timer",
        "timer: plan on each planning tick. frames: plan as soon as a newer complete frame set"
        " arrives while inference is idle (freshest input); the ticks then only report missing or"
        " stale input.",
        choices=TRIGGERS,
    ),
    ParamSpec("sampling.num_samples", 1, "Trajectory samples per plan.", minimum=1, maximum=64, dynamic=True),
    ParamSpec(
        "sampling.selection",
        "first",
        "Published sample: first, medoid (least summed distance) or all (no Path).",
        choices=SELECTIONS,
        dynamic=True,
    ),
    ParamSpec(
        "sampling.flow_steps", 10, "Euler steps of the flow-matching sampler.", minimum=1, maximum=100, dynamic=True
    ),
    ParamSpec(
        "sampling.max_reasoning_tokens",
        256,
        "Cap on generated reasoning tokens.",
        minimum=1,
        maximum=4096,
        dynamic=True,
    ),
    ParamSpec(
        "sampling.temperature",
        0.6,
        "Reasoning sampling temperature; 0 = greedy.",
        minimum=0.0,
        maximum=2.0,
        dynamic=True,
    ),
    ParamSpec("sampling.top_p", 0.98, "Nucleus sampling mass for reasoning.", minimum=0.01, maximum=1.0, dynamic=True),
    ParamSpec(
        "sampling.cfg_weight",
        0.0,
        "Navigation classifier-free guidance weight (1 = conditional only); 0 = off. Used only with a route.",
        minimum=0.0,
        maximum=10.0,
        dynamic=True,
    ),
    ParamSpec(
        "sampling.seed",
        0,
        "Random seed of every plan (same input -> same plan).",
        minimum=0,
        maximum=2**31 - 1,
        dynamic=True,
    ),
    ParamSpec(
        "gates.max_lateral_accel_mps2",
        12.0,
        "Drop a plan whose speed^2 x curvature, held for 1 s, exceeds this (no car corners above ~1 g);"
        " plans with non-finite values or actions outside the model's action bounds are always dropped.",
        minimum=1.0,
        maximum=100.0,
        dynamic=True,
    ),
    # QoS and diagnostics
    ParamSpec("qos.cameras.reliability", "best_effort", "Camera subscriptions reliability.", choices=RELIABILITIES),
    ParamSpec("qos.cameras.depth", 2, "Camera subscriptions queue depth.", minimum=1, maximum=100),
    ParamSpec("qos.odometry.reliability", "best_effort", "Odometry subscription reliability.", choices=RELIABILITIES),
    ParamSpec("qos.odometry.depth", 50, "Odometry subscription queue depth.", minimum=1, maximum=1000),
    ParamSpec(
        "qos.navigation.durability",
        "volatile",
        "Navigation subscription durability (transient_local for latched routes).",
        choices=DURABILITIES,
    ),
    ParamSpec("qos.outputs.depth", 5, "Output publishers queue depth (reliable, volatile).", minimum=1, maximum=100),
    ParamSpec(
        "diagnostics.rate_hz",
        1.0,
        "Diagnostics publish rate (also published after every plan or failure).",
        minimum=0.1,
        maximum=50.0,
    ),
    ParamSpec(
        "diagnostics.max_plan_silence_s",
        10.0,
        "Once ready, no published plan for this long is a fault (WARN planning_stalled), whatever the inputs"
        " look like.",
        minimum=0.5,
        maximum=3600.0,
    ),
)

SPECS: dict[str, ParamSpec] = {spec.name: spec for spec in PARAMETERS}


@dataclass(frozen=True)
class CameraInput:
    topic: str
    index: int
    transport: str  # raw | compressed


@dataclass(frozen=True)
class RemoteSettings:
    """Where model.backend remote sends its plans (the api key stays out of logs and diagnostics)."""

    url: str
    timeout_s: float
    api_key: str = field(default="", repr=False)
    frame_transport: str = "auto"  # auto | shm | resized


@dataclass(frozen=True)
class DriveSettings:
    """Validated node configuration (times already in ns where the inputs package wants ns)."""

    checkpoint_path: str
    backend: str
    device: str
    dtype: str | None  # None: the checkpoint's dtype
    expert_quantization: str  # core.types.EXPERT_QUANTIZATIONS
    model_id: str
    backend_options: dict[str, Any]
    cameras: tuple[CameraInput, ...]
    frame_sync: FrameSyncConfig
    ego_history: EgoHistoryConfig
    image_size: tuple[int, int] | None  # (width, height)
    odometry_topic: str
    navigation_topic: str
    navigation_max_age_ns: int
    navigation_max_chars: int
    max_future_ns: int
    stay_up_on_failure: bool
    max_plan_silence_ns: int
    output_frame: str
    ego_frame_id: str
    planning_period_s: float
    planning_trigger: str
    sampling: SamplingSettings
    selection: str
    max_lateral_accel_mps2: float
    qos: dict[str, Any] = field(default_factory=dict)
    diagnostics_period_s: float = 1.0
    remote: RemoteSettings | None = None  # model.backend remote only


def check_value(name: str, value: Any) -> None:
    """Type, range and choice check of one value against its spec."""
    spec = SPECS[name]
    default = spec.default
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        item = type(default[0])
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, item) and not isinstance(v, bool) for v in value)
    if not ok:
        raise ParameterError(name, f"expected {type(default).__name__}, got {value!r}")
    if spec.minimum is not None and value < spec.minimum:
        raise ParameterError(name, f"{value} is below the minimum {spec.minimum}")
    if spec.maximum is not None and value > spec.maximum:
        raise ParameterError(name, f"{value} is above the maximum {spec.maximum}")
    if spec.choices and value not in spec.choices:
        raise ParameterError(name, f"{value!r} is not one of {', '.join(spec.choices)}")


def parse_param_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`-p NAME:=VALUE` items (ROS's form; `NAME=VALUE` too) as {name: value}, values read as YAML.

    One parser for every command line that takes the node's parameters, so a misspelled name is
    refused there, naming the closest known one, instead of being dropped. The name ends at the
    first '=', so a value may itself hold '=' or ':='. Values are checked later, with every other
    parameter, by parse_settings.
    """
    overrides: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.removesuffix(":")
        if not sep or not name:
            raise ValueError(f"--param {item!r}: expected NAME:=VALUE")
        if name not in SPECS:
            close = difflib.get_close_matches(name, SPECS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "alpamayo_drive --help lists them"
            raise ValueError(f"--param {item!r}: unknown parameter {name!r}; {hint}")
        try:
            # an empty value is an empty string: YAML's null would read as "not given"
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as error:
            raise ValueError(f"--param {item!r}: the value is not valid YAML") from error
        if isinstance(SPECS[name].default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # ROS parameters are typed: `0` for a double parameter is refused
        overrides[name] = value
    return overrides


def _ns(seconds: float) -> int:
    return int(round(seconds * NS_PER_S))


def parse_settings(values: Mapping[str, Any], *, check_paths: bool = True) -> DriveSettings:
    """Validate a complete name -> value map (as declared) into DriveSettings."""
    for name in SPECS:
        if name not in values:
            raise ParameterError(name, "missing")
        check_value(name, values[name])
    v = values
    checkpoint = v["model.checkpoint_path"]
    remote = _parse_remote(v) if v["model.backend"] == "remote" else None
    if not checkpoint and remote is None:
        raise ParameterError("model.checkpoint_path", "empty; set it to the checkpoint directory")
    if check_paths and remote is None and not os.path.isdir(checkpoint):
        raise ParameterError("model.checkpoint_path", f"no such directory: {checkpoint}")
    if not DEVICE_PATTERN.match(v["model.device"]):
        raise ParameterError("model.device", f"{v['model.device']!r} is not cpu, cuda or cuda:N")
    cameras = _parse_cameras(v["cameras.topics"], v["cameras.indices"], v["cameras.transports"])
    for name in ("odometry.topic", "navigation.topic", "output.ego_frame_id"):
        if not v[name]:
            raise ParameterError(name, "empty")
    width, height = v["images.width"], v["images.height"]
    if (width == 0) != (height == 0):
        raise ParameterError(
            "images.width" if width == 0 else "images.height", "set both images.width and images.height, or neither"
        )
    spacing = v["cameras.frame_spacing_s"]
    if v["cameras.max_frame_error_s"] >= spacing:
        raise ParameterError(
            "cameras.max_frame_error_s", f"must be below cameras.frame_spacing_s ({spacing}) or frames could repeat"
        )
    frame_sync = FrameSyncConfig(
        camera_indices=tuple(sorted(camera.index for camera in cameras)),
        frames_per_camera=v["cameras.frames"],
        frame_spacing_ns=_ns(spacing),
        max_frame_error_ns=_ns(v["cameras.max_frame_error_s"]),
        max_skew_ns=_ns(v["cameras.max_skew_s"]),
        max_age_ns=_ns(v["cameras.max_age_s"]),
    )
    ego_history = EgoHistoryConfig(
        num_poses=v["history.length"],
        dt_ns=_ns(v["history.dt_s"]),
        max_stale_ns=_ns(v["odometry.max_stale_s"]),
        max_gap_ns=_ns(v["odometry.max_gap_s"]),
    )
    model_dtype = None if v["model.dtype"] == "auto" else v["model.dtype"]
    engine_dtype = model_dtype if v["vllm.dtype"] == "auto" else v["vllm.dtype"]
    backend_options = {
        **({"dtype": engine_dtype} if engine_dtype else {}),
        "max_images": len(cameras) * v["cameras.frames"],  # every frame of one request
        "gpu_memory_utilization": float(v["vllm.gpu_memory_utilization"]),
        "kv_cache_gib": float(v["vllm.kv_cache_gib"]) or None,
        "max_model_len": v["vllm.max_model_len"],
        "tensor_parallel_size": v["vllm.tensor_parallel_size"],
        "enforce_eager": v["vllm.enforce_eager"],
        "quantization": v["vllm.quantization"] or None,
        "speculation_method": v["vllm.speculation.method"],
        "speculation_draft_tokens": v["vllm.speculation.draft_tokens"],
        "speculation_proposer": v["vllm.speculation.proposer"],
        "cascade_attention": v["vllm.cascade_attention"],
    }
    if v["model.expert_quantization"] != "none":
        if v["model.backend"] == "remote":
            raise ParameterError("model.expert_quantization", "needs an in-process backend (hf or vllm); a remote "
                                                              "server sets its own (--expert-quantization)")
        if v["model.backend"] == "vllm" and v["vllm.tensor_parallel_size"] > 1:
            raise ParameterError("model.expert_quantization", "not with vllm.tensor_parallel_size > 1 (the expert "
                                                              "runs in vLLM's workers there, in full precision)")
    if v["vllm.speculation.method"] != "none":
        if v["model.backend"] != "vllm":
            raise ParameterError(
                "vllm.speculation.method",
                f"{v['vllm.speculation.method']!r} needs model.backend vllm, got {v['model.backend']!r} "
                "(a remote server speculates by its own setting)",
            )
        if v["vllm.tensor_parallel_size"] > 1:
            raise ParameterError(
                "vllm.speculation.method", "speculation runs only with vllm.tensor_parallel_size 1"
            )
    if v["vllm.cascade_attention"] != "off" and v["model.backend"] != "vllm":
        raise ParameterError(
            "vllm.cascade_attention",
            f"{v['vllm.cascade_attention']!r} needs model.backend vllm, got {v['model.backend']!r}",
        )
    return DriveSettings(
        checkpoint_path=checkpoint,
        backend=v["model.backend"],
        device=v["model.device"],
        dtype=model_dtype,
        expert_quantization=v["model.expert_quantization"],
        model_id=v["model.id"] or _model_id(checkpoint, remote),
        backend_options=backend_options if v["model.backend"] == "vllm" else {},
        cameras=cameras,
        frame_sync=frame_sync,
        ego_history=ego_history,
        image_size=(width, height) if width else None,
        odometry_topic=v["odometry.topic"],
        navigation_topic=v["navigation.topic"],
        navigation_max_age_ns=_ns(v["navigation.max_age_s"]),
        navigation_max_chars=v["navigation.max_chars"],
        max_future_ns=_ns(v["inputs.max_future_s"]),
        stay_up_on_failure=v["model.stay_up_on_failure"],
        max_plan_silence_ns=_ns(v["diagnostics.max_plan_silence_s"]),
        output_frame=v["output.frame"],
        ego_frame_id=v["output.ego_frame_id"],
        planning_period_s=1.0 / v["planning.rate_hz"],
        planning_trigger=v["planning.trigger"],
        sampling=sampling_settings(v),
        selection=v["sampling.selection"],
        max_lateral_accel_mps2=float(v["gates.max_lateral_accel_mps2"]),
        qos={name.removeprefix("qos."): v[name] for name in SPECS if name.startswith("qos.")},
        diagnostics_period_s=1.0 / v["diagnostics.rate_hz"],
        remote=remote,
    )


def _model_id(checkpoint: str, remote: RemoteSettings | None) -> str:
    """The checkpoint folder's name; a remote node without a checkpoint path names its server."""
    if checkpoint or remote is None:
        return os.path.basename(os.path.normpath(checkpoint))
    return remote.url


def _parse_remote(v: Mapping[str, Any]) -> RemoteSettings:
    url = v["remote.url"].strip()
    if not re.match(r"^https?://[^/\s]+", url):
        raise ParameterError("remote.url", f"expected http://host:port or https://host:port, got {url!r}")
    return RemoteSettings(url=url.rstrip("/"), timeout_s=float(v["remote.timeout_s"]), api_key=v["remote.api_key"],
                          frame_transport=v["remote.frame_transport"])


def sampling_settings(v: Mapping[str, Any]) -> SamplingSettings:
    """The sampling.* parameters as the pipeline's SamplingSettings."""
    return SamplingSettings(
        num_samples=v["sampling.num_samples"],
        temperature=float(v["sampling.temperature"]),
        top_p=float(v["sampling.top_p"]),
        max_reasoning_tokens=v["sampling.max_reasoning_tokens"],
        flow_steps=v["sampling.flow_steps"],
        cfg_weight=float(v["sampling.cfg_weight"]) or None,
        seed=v["sampling.seed"],
    )


def _parse_cameras(topics: list[str], indices: list[int], transports: list[str]) -> tuple[CameraInput, ...]:
    if not topics:
        raise ParameterError("cameras.topics", "empty; give at least one camera topic")
    if len(indices) != len(topics):
        raise ParameterError("cameras.indices", f"{len(indices)} indices for {len(topics)} cameras.topics")
    if len(transports) != len(topics):
        raise ParameterError("cameras.transports", f"{len(transports)} transports for {len(topics)} cameras.topics")
    unknown = [index for index in indices if index not in CAMERAS]
    if unknown:
        raise ParameterError("cameras.indices", f"unknown camera index {unknown[0]} (known: {sorted(CAMERAS)})")
    duplicates = sorted({index for index in indices if indices.count(index) > 1})
    if duplicates:
        raise ParameterError("cameras.indices", f"duplicate camera index {duplicates[0]}")
    if len(set(topics)) != len(topics) or not all(topics):
        raise ParameterError("cameras.topics", "topics must be non-empty and unique")
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad:
        raise ParameterError("cameras.transports", f"{bad[0]!r} is not one of {', '.join(TRANSPORTS)}")
    return tuple(CameraInput(topic, index, transport) for topic, index, transport in zip(topics, indices, transports))


def write_params_file(path: Path, parameters: Mapping[str, Any]) -> Path:
    """Write dotted parameter names as a `/**: ros__parameters:` YAML file (node and evaluator input)."""
    nested: dict[str, Any] = {}
    for name, value in parameters.items():
        *groups, leaf = name.split(".")
        target = nested
        for group in groups:
            target = target.setdefault(group, {})
        target[leaf] = value
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": nested}}, sort_keys=False))
    return path
