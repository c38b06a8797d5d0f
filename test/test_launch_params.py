"""config/drive.yaml, config/drive.schema.json and launch/drive.launch.py agree with the
parameters the node declares (static checks plus one real declaration on an rclpy node)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import rclpy
import yaml
from rclpy.context import Context
from rclpy.node import Node

from alpamayo_ros.settings import PARAMETERS, SPECS, ParameterError
from alpamayo_ros.ros.params import declare_parameters

ROOT = Path(__file__).resolve().parents[1]
YAML_PATH = ROOT / "config" / "drive.yaml"
SCHEMA_PATH = ROOT / "config" / "drive.schema.json"
LAUNCH_PATH = ROOT / "launch" / "drive.launch.py"
KEY_PARAMETERS = {
    "model.checkpoint_path", "model.backend", "model.device", "model.dtype", "cameras.topics", "cameras.indices",
    "cameras.transports", "odometry.topic", "navigation.topic", "output.frame", "planning.rate_hz",
    "sampling.num_samples", "sampling.selection", "sampling.flow_steps", "sampling.max_reasoning_tokens",
    "sampling.cfg_weight", "vllm.gpu_memory_utilization", "vllm.max_model_len", "vllm.tensor_parallel_size",
    "vllm.enforce_eager", "vllm.quantization",
}  # fmt: skip
SCHEMA_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def yaml_parameters() -> dict[str, Any]:
    document = yaml.safe_load(YAML_PATH.read_text())
    assert list(document) == ["/**"], "keyed /** so a namespace does not silently drop it"
    return flatten(document["/**"]["ros__parameters"])


def load_launch_module():
    spec = importlib.util.spec_from_file_location("drive_launch", LAUNCH_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_yaml_keys_and_defaults_match_declared_parameters() -> None:
    values = yaml_parameters()
    assert set(values) == set(SPECS)
    for name, value in values.items():
        assert value == SPECS[name].default, name
        assert type(value) is type(SPECS[name].default), f"{name}: YAML type must match the declared type"


def test_schema_describes_every_parameter_and_validates_the_yaml() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    node_schema = schema["definitions"]["alpamayo_drive"]
    properties = node_schema["properties"]
    assert set(properties) == set(SPECS) == set(node_schema["required"])
    for spec in PARAMETERS:
        entry = properties[spec.name]
        assert entry["type"] == SCHEMA_TYPES[type(spec.default)], spec.name
        assert entry["default"] == spec.default, spec.name
        assert entry["description"] == spec.description and spec.description, spec.name
        assert entry.get("minimum") == spec.minimum and entry.get("maximum") == spec.maximum, spec.name
        assert tuple(entry.get("enum", ())) == spec.choices, spec.name
        if isinstance(spec.default, (int, float)) and not isinstance(spec.default, bool):
            assert "minimum" in entry and "maximum" in entry, f"{spec.name}: numbers need a range"
    document = {"/**": {"ros__parameters": yaml_parameters()}}
    jsonschema.validate(document, schema)
    document["/**"]["ros__parameters"]["sampling.selection"] = "best"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, schema)


def test_declared_parameters_accept_the_yaml_file() -> None:
    """Declare on a real node with drive.yaml as params file: names, types and ranges line up."""
    context = Context()
    rclpy.init(context=context, args=["--ros-args", "--params-file", str(YAML_PATH), "-p", "sampling.num_samples:=3"])
    try:
        node = Node("alpamayo_drive", context=context)
        values = declare_parameters(node)
        declared = set(node.list_parameters([], 0).names) - {"use_sim_time", "start_type_description_service"}
        assert declared == set(SPECS)
        assert values["sampling.num_samples"] == 3  # an override reached the declaration
        assert {k: v for k, v in values.items() if k != "sampling.num_samples"} == {
            k: v for k, v in yaml_parameters().items() if k != "sampling.num_samples"
        }
        assert node.describe_parameter("model.checkpoint_path").read_only
        assert not node.describe_parameter("sampling.num_samples").read_only
        node.destroy_node()
    finally:
        rclpy.shutdown(context=context)


def test_launch_arguments_map_to_declared_parameters() -> None:
    launch = load_launch_module()
    targets = set(launch.PARAMETER_ARGUMENTS.values())
    assert targets <= set(SPECS), targets - set(SPECS)
    assert KEY_PARAMETERS <= targets, KEY_PARAMETERS - targets
    assert len(targets) == len(launch.PARAMETER_ARGUMENTS), "two arguments for one parameter"
    assert not set(launch.PARAMETER_ARGUMENTS) & set(launch.LAUNCH_ARGUMENTS)
    assert {"params_file", "namespace", "use_sim_time", "rviz"} <= set(launch.LAUNCH_ARGUMENTS)


def test_launch_overrides_are_typed_and_validated() -> None:
    launch = load_launch_module()
    overrides = launch.parameter_overrides(
        {"checkpoint_path": "/models/a", "planning_rate_hz": "2", "camera_indices": "[1, 6]",
         "camera_topics": "[/a, /b]", "enforce_eager": "true", "quantization": "", "seed": "7"}
    )  # fmt: skip
    assert overrides == {
        "model.checkpoint_path": "/models/a", "planning.rate_hz": 2.0, "cameras.indices": [1, 6],
        "cameras.topics": ["/a", "/b"], "vllm.enforce_eager": True, "sampling.seed": 7,
    }  # fmt: skip
    assert isinstance(overrides["planning.rate_hz"], float)
    with pytest.raises(ParameterError, match="sampling.selection"):
        launch.parameter_overrides({"selection": "best"})


def test_launch_description_or_hint() -> None:
    """With ROS 2 launch: every argument is declared. Without it (PyPI): a hint, not a traceback."""
    launch = load_launch_module()
    if launch.LaunchDescription is None:
        with pytest.raises(RuntimeError, match="alpamayo_drive --ros-args"):
            launch.generate_launch_description()
        return
    description = launch.generate_launch_description()
    declared = {argument.name for argument in description.get_launch_arguments()}
    assert declared == set(launch.PARAMETER_ARGUMENTS) | set(launch.LAUNCH_ARGUMENTS)


def test_launch_leaves_the_node_its_shutdown_time_and_checks_for_rviz() -> None:
    """launch escalates SIGINT -> SIGTERM after sigterm_timeout: the node's 3 s shutdown fits;
    rviz2 is looked up before it is added (a missing one would orphan the node)."""
    launch = load_launch_module()
    assert launch.SIGTERM_TIMEOUT_S >= 5.0
    missing = launch.rviz_missing()
    try:
        from ament_index_python.packages import get_package_prefix

        get_package_prefix("rviz2")
    except LookupError:
        assert "rviz2" in missing  # this machine has no rviz2: the reason says so


def _declared_sim_time(tmp_path: Path, parameters: list) -> bool:
    """use_sim_time of a real rclpy node given `parameters` the way launch_ros passes them: each
    entry a --params-file in order, a dict written to a file keyed /** first."""
    args = ["--ros-args"]
    for k, entry in enumerate(parameters):
        if isinstance(entry, dict):
            path = tmp_path / f"overrides_{k}.yaml"
            path.write_text(yaml.safe_dump({"/**": {"ros__parameters": entry}}))
            entry = str(path)
        args += ["--params-file", entry]
    context = Context()
    rclpy.init(context=context, args=args)
    try:
        node = Node("alpamayo_drive", context=context)
        value = node.get_parameter("use_sim_time").value
        node.destroy_node()
        return value
    finally:
        rclpy.shutdown(context=context)


def test_launch_keeps_the_params_files_use_sim_time_unless_the_argument_sets_it(tmp_path: Path) -> None:
    """A replay setup's params file says use_sim_time: true; the launch file's empty default
    must leave it so, and an explicit argument must win either way."""
    launch = load_launch_module()
    replay_yaml = tmp_path / "drive.yaml"
    replay_yaml.write_text(yaml.safe_dump({"/**": {"ros__parameters": {"use_sim_time": True, "planning.rate_hz": 2.0}}}))
    default = {name: default for name, (default, _) in launch.LAUNCH_ARGUMENTS.items()}
    assert default["use_sim_time"] == ""
    kept = launch.node_parameters(default, str(replay_yaml))
    assert _declared_sim_time(tmp_path, kept) is True
    assert launch.effective_sim_time(default, str(replay_yaml)) is True  # rviz2 follows the node's clock
    for text, expected in (("false", False), ("True", True)):
        given = launch.node_parameters({**default, "use_sim_time": text}, str(replay_yaml))
        assert _declared_sim_time(tmp_path, given) is expected, text
        assert launch.effective_sim_time({**default, "use_sim_time": text}, str(replay_yaml)) is expected
    assert launch.effective_sim_time(default, str(YAML_PATH)) is False  # the shipped file leaves it unset
    with pytest.raises(ValueError, match="use_sim_time"):
        launch.node_parameters({**default, "use_sim_time": "yes please"}, str(replay_yaml))
