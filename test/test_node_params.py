"""Parameter validation (issue 5 acceptance 3): a bad value stops the node at start with a
message naming the parameter; parse_settings covers the remaining rules directly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from alpamayo_ros.testing.rig import (
    RosSide,
    ros_env,
    start_console_script,
    stop_process,
    unique_domain_id,
    wait_until,
    write_params_file,
)

from alpamayo_ros.settings import SPECS, ParameterError, parse_param_overrides, parse_settings

CAMERAS = {
    "cameras.topics": ["/a", "/b", "/c"],
    "cameras.indices": [0, 1, 6],
    "cameras.transports": ["raw", "compressed", "raw"],
}


def defaults(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    values = {name: spec.default for name, spec in SPECS.items()}
    values["model.checkpoint_path"] = str(tmp_path)
    values.update(CAMERAS)
    values.update({name.replace("__", "."): value for name, value in overrides.items()})
    return values


def run_node(
    tmp_path: Path, parameters: dict[str, Any], ros_args: tuple[str, ...] = (), timeout_s: float = 60
) -> tuple[int, str]:
    params_file = write_params_file(tmp_path / "params.yaml", parameters)
    log = tmp_path / "node.log"
    process = start_console_script(
        "alpamayo_drive", env=ros_env(unique_domain_id()), log_path=log, params_file=params_file, ros_args=ros_args
    )
    code = process.wait(timeout=timeout_s)
    process.log_file.close()
    return code, log.read_text()


@pytest.mark.parametrize(
    ("parameters", "needle"),
    [
        ({"cameras.indices": [0, 9, 6]}, "parameter 'cameras.indices': unknown camera index 9"),
        ({"cameras.indices": [0, 6, 6]}, "parameter 'cameras.indices': duplicate camera index 6"),
        (
            {"model.checkpoint_path": "/nonexistent/alpamayo"},
            "parameter 'model.checkpoint_path': no such directory: /nonexistent/alpamayo",
        ),
    ],
    ids=["unknown camera index", "duplicate camera index", "missing checkpoint"],
)
def test_bad_parameter_fails_at_start_naming_it(tmp_path: Path, parameters: dict[str, Any], needle: str) -> None:
    values = {**CAMERAS, "model.checkpoint_path": str(tmp_path), **parameters}
    code, log = run_node(tmp_path, values)
    assert code == 2, log
    assert needle in log
    assert "Traceback" not in log


def test_checkpoint_path_is_required(tmp_path: Path) -> None:
    code, log = run_node(tmp_path, dict(CAMERAS))  # no model.checkpoint_path at all
    assert code == 2 and "parameter 'model.checkpoint_path': empty" in log, log


def test_out_of_range_override_names_the_parameter(tmp_path: Path) -> None:
    values = {**CAMERAS, "model.checkpoint_path": str(tmp_path)}
    code, log = run_node(tmp_path, values, ("-p", "sampling.num_samples:=0"))
    assert code == 2 and "sampling.num_samples" in log, log


def test_defaults_with_cameras_parse(tmp_path: Path) -> None:
    settings = parse_settings(defaults(tmp_path))
    assert settings.frame_sync.camera_indices == (0, 1, 6)
    assert settings.frame_sync.frame_spacing_ns == 100_000_000 and settings.frame_sync.max_skew_ns == 50_000_000
    assert settings.ego_history.num_poses == 16 and settings.ego_history.max_stale_ns == 100_000_000
    assert settings.model_id == tmp_path.name and settings.dtype is None
    assert settings.backend_options == {}  # the hf backend takes none
    assert settings.sampling.cfg_weight is None and settings.sampling.max_reasoning_tokens == 256
    assert [c.transport for c in settings.cameras] == ["raw", "compressed", "raw"]


def test_vllm_options_become_backend_options(tmp_path: Path) -> None:
    settings = parse_settings(
        defaults(
            tmp_path, model__backend="vllm", model__dtype="bfloat16", vllm__quantization="fp8", vllm__max_model_len=4096,
            vllm__cascade_attention="on",
        )
    )
    assert settings.backend_options == {
        "dtype": "bfloat16", "max_images": 12, "gpu_memory_utilization": 0.85, "kv_cache_gib": 2.0,
        "max_model_len": 4096, "tensor_parallel_size": 1, "enforce_eager": False, "quantization": "fp8",
        "speculation_method": "none", "speculation_draft_tokens": 4, "speculation_proposer": "auto",
        "cascade_attention": "on",
    }  # fmt: skip
    sized_by_fraction = parse_settings(defaults(tmp_path, model__backend="vllm", vllm__kv_cache_gib=0.0))
    assert sized_by_fraction.backend_options["kv_cache_gib"] is None  # 0 = let vLLM size it


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"cameras.indices": [0, 1]}, "cameras.indices"),
        ({"cameras.transports": ["raw", "raw", "h264"]}, "cameras.transports"),
        ({"cameras.topics": ["/a", "/a", "/c"]}, "cameras.topics"),
        ({"images.width": 640}, "images.height"),
        ({"model.device": "gpu0"}, "model.device"),
        ({"model.backend": "trt"}, "model.backend"),
        ({"cameras.max_frame_error_s": 0.1}, "cameras.max_frame_error_s"),
        ({"planning.rate_hz": 0.0}, "planning.rate_hz"),
        ({"sampling.selection": "best"}, "sampling.selection"),
        ({"history.length": 8}, "history.length"),
        ({"sampling.top_p": 2}, "sampling.top_p"),
        ({"vllm.enforce_eager": "yes"}, "vllm.enforce_eager"),
        ({"vllm.cascade_attention": "always"}, "vllm.cascade_attention"),
        ({"vllm.cascade_attention": "on"}, "vllm.cascade_attention"),  # the hf backend has no cascade
        ({"odometry.topic": ""}, "odometry.topic"),
    ],
)
def test_invalid_values_name_the_parameter(tmp_path: Path, overrides: dict[str, Any], name: str) -> None:
    values = defaults(tmp_path)
    values.update(overrides)
    with pytest.raises(ParameterError, match=f"^parameter '{name}'"):
        parse_settings(values)


def test_unloadable_checkpoint_stays_up_only_when_asked_and_reports_it(tmp_path: Path) -> None:
    """An existing but broken checkpoint is not a parameter error: with model.stay_up_on_failure
    the node stays up with an ERROR diagnostic (a SIGINT still ends it with 0)."""
    broken = tmp_path / "broken_checkpoint"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    domain_id = unique_domain_id()
    side = RosSide(domain_id, "load_failure_test")
    diagnostics = side.collect(DiagnosticArray, "/diagnostics", side.reliable())
    params = {**CAMERAS, "model.checkpoint_path": str(broken), "model.stay_up_on_failure": True}
    params_file = write_params_file(tmp_path / "params.yaml", params)
    process = start_console_script(
        "alpamayo_drive", env=ros_env(domain_id), log_path=tmp_path / "node.log", params_file=params_file
    )
    try:

        def failed() -> bool:
            return any(m.status[0].level == DiagnosticStatus.ERROR for m in diagnostics.messages)

        assert wait_until(failed, timeout_s=90), (tmp_path / "node.log").read_text()
        status = [m.status[0] for m in diagnostics.messages if m.status[0].level == DiagnosticStatus.ERROR][-1]
        assert status.message.startswith("model load failed") and "model.checkpoint_path" in status.message
        assert {kv.key: kv.value for kv in status.values}["state"] == "failed"
        assert process.poll() is None
    finally:
        code = stop_process(process)
        side.close()
    assert code == 0, (tmp_path / "node.log").read_text()


def _nested_type_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    target = tmp_path / "nested_type"
    shutil.copytree(tiny_checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    config["hist_traj_tokenizer_cfg"]["num_bins"] = [1000]
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("fault", ["broken config.json", "nested config type", "device without CUDA"])
def test_failed_model_load_exits_1_naming_the_cause(tmp_path: Path, tiny_checkpoint: Path, fault: str) -> None:
    """So that launch's respawn can act: the node never idles after a failed load."""
    params: dict[str, Any] = {**CAMERAS, "model.checkpoint_path": str(tiny_checkpoint)}
    if fault == "broken config.json":
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "config.json").write_text("{not json")
        params["model.checkpoint_path"], needle = str(broken), "model load failed"
    elif fault == "nested config type":
        params["model.checkpoint_path"] = str(_nested_type_checkpoint(tiny_checkpoint, tmp_path))
        needle = "hist_traj_tokenizer_cfg.num_bins: expected an integer, got list [1000]"
    else:
        params["model.device"], needle = "cuda:7", "model load failed"
    code, log = run_node(tmp_path, params, timeout_s=180)
    assert code == 1, log
    assert needle in log and "exiting with code 1" in log, log
    assert "Traceback" not in log


def test_param_overrides_take_both_separators_and_keep_equals_in_values(tmp_path: Path) -> None:
    overrides = parse_param_overrides(["model.backend:=vllm", "sampling.num_samples=4", "cameras.indices:=[0, 1, 6]",
                                       "remote.url:=http://host:8000/?a=b", "model.id=run:=1", "vllm.quantization:="])
    assert overrides == {"model.backend": "vllm", "sampling.num_samples": 4, "cameras.indices": [0, 1, 6],
                         "remote.url": "http://host:8000/?a=b", "model.id": "run:=1", "vllm.quantization": ""}
    settings = parse_settings({**defaults(tmp_path), **overrides})  # the values are the types the table declares
    assert settings.backend == "vllm" and settings.sampling.num_samples == 4 and settings.model_id == "run:=1"


def test_param_overrides_give_a_double_parameter_a_double() -> None:
    # a ROS node refuses an integer for a double parameter, so `:=1` must reach it as 1.0
    overrides = parse_param_overrides(["cameras.max_age_s:=1", "sampling.num_samples:=2"])
    assert overrides == {"cameras.max_age_s": 1.0, "sampling.num_samples": 2}
    assert type(overrides["cameras.max_age_s"]) is float and type(overrides["sampling.num_samples"]) is int


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("planning.rat_hz:=5", "unknown parameter 'planning.rat_hz'; did you mean 'planning.rate_hz'?"),
        ("sampling.selecton=first", "unknown parameter 'sampling.selecton'; did you mean 'sampling.selection'?"),
        ("use_sim_time:=true", "unknown parameter 'use_sim_time'; alpamayo_drive --help lists them"),
        ("sampling.seed", "expected NAME:=VALUE"),
        (":=3", "expected NAME:=VALUE"),
        ("cameras.indices:=[0, 1", "the value is not valid YAML"),
    ],
)
def test_bad_param_overrides_are_refused_naming_them(item: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_param_overrides(["model.backend:=vllm", item])
    assert str(refused.value) == f"--param {item!r}: {message}"


def test_help_lists_every_parameter_with_default(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("alpamayo_drive")
    for args in (["--help"], ["--ros-args", "--help"]):
        run = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=60, env=ros_env(0))
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
        for spec in SPECS.values():
            assert f"  {spec.name} = {spec.default!r}: {spec.description}" in run.stdout


def test_misspelled_parameter_is_named_with_the_closest_known_one(tmp_path: Path) -> None:
    # cameras.indices 9 makes the node stop right after reading its parameters
    params = {**CAMERAS, "model.checkpoint_path": str(tmp_path), "planning.rat_hz": 5.0, "cameras.indices": [0, 9, 6]}
    code, log = run_node(tmp_path, params)
    assert code == 2
    assert "unknown parameter 'planning.rat_hz' is ignored; did you mean 'planning.rate_hz'?" in log, log


def test_integer_for_a_double_parameter_is_accepted(tmp_path: Path) -> None:
    # an integer override for planning.rate_hz: the node gets past its parameters (and stops at the
    # bad camera index, which names its parameter, not planning.rate_hz)
    params = {**CAMERAS, "model.checkpoint_path": str(tmp_path), "cameras.indices": [0, 9, 6]}
    code, log = run_node(tmp_path, params, ros_args=("-p", "planning.rate_hz:=10", "-p", "sampling.temperature:=1"))
    assert code == 2 and "planning.rate_hz" not in log and "sampling.temperature" not in log, log
    assert "parameter 'cameras.indices'" in log
