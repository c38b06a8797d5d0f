"""Launch alpamayo_drive (and optionally rviz2) with config/drive.yaml plus argument overrides.

`ros2 launch alpamayo_ros drive.launch.py checkpoint_path:=/models/Alpamayo-1.5-10B backend:=vllm`

Every key parameter is a launch argument; an argument left empty keeps the params file's
value, so the YAML stays the single place for defaults. use_sim_time too: empty by default, so
a params file's `use_sim_time: true` (a replay setup's) holds unless the argument says otherwise.
ROS 2 launch is not on PyPI: without it this file still imports (the tests read its tables and
call node_parameters), and the node is started from its console script instead (see README).
"""

from __future__ import annotations

import os

import yaml
from ament_index_python.packages import PackageNotFoundError, get_package_prefix, get_package_share_directory

try:
    from launch import LaunchDescription
    from launch.actions import DeclareLaunchArgument, LogInfo, OpaqueFunction
    from launch.substitutions import LaunchConfiguration
    from launch_ros.actions import Node
except ImportError:  # PyPI ROS 2 wheels: no launch / launch_ros
    LaunchDescription = None

PACKAGE = "alpamayo_ros"
#: launch's SIGINT -> SIGTERM wait for the node: it exits within 3 s in any state (a plan in
#: flight stops at its next step); the rest is slack for a loaded machine
SIGTERM_TIMEOUT_S = 10.0

#: launch argument -> node parameter it overrides (when not empty)
PARAMETER_ARGUMENTS: dict[str, str] = {
    "checkpoint_path": "model.checkpoint_path",
    "backend": "model.backend",
    "device": "model.device",
    "dtype": "model.dtype",
    "model_id": "model.id",
    "remote_url": "remote.url",
    "remote_timeout_s": "remote.timeout_s",
    "gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "kv_cache_gib": "vllm.kv_cache_gib",
    "max_model_len": "vllm.max_model_len",
    "tensor_parallel_size": "vllm.tensor_parallel_size",
    "enforce_eager": "vllm.enforce_eager",
    "quantization": "vllm.quantization",
    "camera_topics": "cameras.topics",
    "camera_indices": "cameras.indices",
    "camera_transports": "cameras.transports",
    "odometry_topic": "odometry.topic",
    "navigation_topic": "navigation.topic",
    "output_frame": "output.frame",
    "planning_rate_hz": "planning.rate_hz",
    "planning_trigger": "planning.trigger",
    "num_samples": "sampling.num_samples",
    "selection": "sampling.selection",
    "flow_steps": "sampling.flow_steps",
    "max_reasoning_tokens": "sampling.max_reasoning_tokens",
    "cfg_weight": "sampling.cfg_weight",
    "seed": "sampling.seed",
}

#: launch-only arguments: name -> (default, description); "" defaults are resolved at launch
LAUNCH_ARGUMENTS: dict[str, tuple[str, str]] = {
    "params_file": ("", "Parameters YAML; empty = the installed config/drive.yaml."),
    "namespace": ("", "Namespace of the node."),
    "use_sim_time": ("", "Use /clock (bag replay, simulators); empty = the params file's value (else false)."),
    "rviz": ("false", "Also start rviz2 with config/alpamayo.rviz."),
    "log_level": ("info", "Node log level."),
}


def parameter_overrides(arguments: dict[str, str]) -> dict[str, object]:
    """Typed parameter values for the non-empty launch arguments (YAML syntax: `[0, 1]`, `true`)."""
    from alpamayo_ros.settings import SPECS, check_value

    overrides: dict[str, object] = {}
    for argument, parameter in PARAMETER_ARGUMENTS.items():
        text = arguments.get(argument, "")
        if text == "":
            continue
        value = yaml.safe_load(text)
        if isinstance(SPECS[parameter].default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # `planning_rate_hz:=2` must still be a double parameter
        if isinstance(SPECS[parameter].default, str) and not isinstance(value, str):
            value = text
        check_value(parameter, value)
        overrides[parameter] = value
    return overrides


def _sim_time_argument(text: str) -> bool | None:
    """use_sim_time:=true|false; None when empty (the params file decides)."""
    if text == "":
        return None
    if text.lower() not in ("true", "false"):
        raise ValueError(f"use_sim_time: expected true, false or empty, got {text!r}")
    return text.lower() == "true"


def node_parameters(arguments: dict[str, str], params_file: str) -> list:
    """alpamayo_drive's `parameters` for launch_ros: the params file, then the overrides of the
    non-empty arguments (launch_ros passes each as a --params-file, the later one winning)."""
    overrides = parameter_overrides(arguments)
    sim_time = _sim_time_argument(arguments.get("use_sim_time", ""))
    if sim_time is not None:
        overrides["use_sim_time"] = sim_time
    return [params_file, overrides]


def effective_sim_time(arguments: dict[str, str], params_file: str) -> bool:
    """Whether the node runs on /clock: the argument if given, else the params file's use_sim_time
    for any node it configures, else false (rviz2 must follow the same clock)."""
    sim_time = _sim_time_argument(arguments.get("use_sim_time", ""))
    if sim_time is not None:
        return sim_time
    with open(params_file) as text:
        return _file_sets_sim_time(yaml.safe_load(text))


def _file_sets_sim_time(tree: object) -> bool:
    """Whether some ros__parameters block of a params file (under any node or namespace key)
    sets use_sim_time true."""
    if not isinstance(tree, dict):
        return False
    block = tree.get("ros__parameters")
    if isinstance(block, dict) and block.get("use_sim_time") is True:
        return True
    return any(_file_sets_sim_time(value) for key, value in tree.items() if key != "ros__parameters")


def _launch_nodes(context) -> list:
    arguments = {name: LaunchConfiguration(name).perform(context) for name in (*PARAMETER_ARGUMENTS, *LAUNCH_ARGUMENTS)}
    share = get_package_share_directory(PACKAGE)
    params_file = arguments["params_file"] or os.path.join(share, "config", "drive.yaml")
    drive = Node(
        package=PACKAGE,
        executable="alpamayo_drive",
        namespace=arguments["namespace"],
        parameters=node_parameters(arguments, params_file),
        ros_arguments=["--log-level", arguments["log_level"]],
        output="screen",
        emulate_tty=True,
        sigterm_timeout=str(SIGTERM_TIMEOUT_S),
    )
    if arguments["rviz"].lower() != "true":
        return [drive]
    if rviz_missing():
        # launch would fail on the missing executable and leave alpamayo_drive running orphaned
        return [drive, LogInfo(msg=f"rviz:=true but {rviz_missing()}; starting alpamayo_drive without it")]
    rviz = Node(
        package="rviz2",
        executable="rviz2",
        arguments=["-d", os.path.join(share, "config", "alpamayo.rviz")],
        parameters=[{"use_sim_time": effective_sim_time(arguments, params_file)}],
    )
    return [drive, rviz]


def rviz_missing() -> str:
    """Why rviz2 cannot start here ("" when it can): its package or executable is not installed."""
    try:
        prefix = get_package_prefix("rviz2")
    except PackageNotFoundError:
        return "the rviz2 package is not installed (apt install ros-<distro>-rviz2)"
    executable = os.path.join(prefix, "lib", "rviz2", "rviz2")
    return "" if os.access(executable, os.X_OK) else f"{executable} is missing"


def generate_launch_description():
    """The launch description; fails with a hint where ROS 2 launch is not installed."""
    if LaunchDescription is None:
        raise RuntimeError(
            "ROS 2 launch is not installed (PyPI wheels); run "
            "`alpamayo_drive --ros-args --params-file config/drive.yaml -p model.checkpoint_path:=...` instead"
        )
    declared = [
        DeclareLaunchArgument(name, default_value="", description=f"Overrides parameter {parameter}.")
        for name, parameter in PARAMETER_ARGUMENTS.items()
    ]
    declared += [
        DeclareLaunchArgument(name, default_value=default, description=text)
        for name, (default, text) in LAUNCH_ARGUMENTS.items()
    ]
    return LaunchDescription([*declared, OpaqueFunction(function=_launch_nodes)])
