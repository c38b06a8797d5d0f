"""Declare the drive node's parameter table (alpamayo_ros/settings.py) on a ROS node.

ROS types parameters strictly: `planning.rate_hz:=10` is an integer and a double-declared
parameter would refuse it. Double parameters are therefore declared with dynamic typing and
an integer is taken as its float; check_value (settings.py) still refuses anything else.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.node import Node
from rclpy.parameter import parameter_dict_from_yaml_file

from alpamayo_ros.settings import PARAMETERS, SPECS, ParamSpec

#: parameters every rclpy node has, besides the table's
ROS_PARAMETERS = ("use_sim_time", "start_type_description_service")


def descriptor(spec: ParamSpec) -> ParameterDescriptor:
    """ROS descriptor of a spec: description, range, choices; read-only unless dynamic."""
    constraints = f"one of: {', '.join(spec.choices)}" if spec.choices else ""
    desc = ParameterDescriptor(
        name=spec.name, description=spec.description, additional_constraints=constraints, read_only=not spec.dynamic
    )
    if isinstance(spec.default, float):
        desc.dynamic_typing = True  # an integer override is accepted and taken as a float
        if spec.minimum is not None:
            desc.floating_point_range = [
                FloatingPointRange(from_value=float(spec.minimum), to_value=float(spec.maximum), step=0.0)
            ]
    elif spec.minimum is not None and isinstance(spec.default, int) and not isinstance(spec.default, bool):
        desc.integer_range = [IntegerRange(from_value=int(spec.minimum), to_value=int(spec.maximum), step=0)]
    return desc


def as_declared(name: str, value: Any) -> Any:
    """An integer given for a double parameter, as a float; everything else unchanged."""
    spec = SPECS.get(name)
    if spec is not None and isinstance(spec.default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def declare_parameters(node: Node) -> dict[str, Any]:
    """Declare every parameter on node and return name -> value (overrides applied)."""
    return {
        spec.name: as_declared(spec.name, node.declare_parameter(spec.name, spec.default, descriptor(spec)).value)
        for spec in PARAMETERS
    }


def given_parameter_names(ros_args: Iterable[str], node_name: str) -> list[str]:
    """Names set for node_name by `--params-file FILE` and `-p NAME:=VALUE` in the ROS arguments."""
    args = list(ros_args)
    names: list[str] = []
    for flag, value in zip(args, args[1:]):
        if flag == "--params-file":
            names += parameter_dict_from_yaml_file(value, use_wildcard=True, target_nodes=[node_name])
        elif flag in ("-p", "--param") and ":=" in value:
            names.append(value.split(":=", 1)[0])
    return names


def unknown_parameter_warnings(names: Iterable[str]) -> list[str]:
    """One warning per name that is neither in the table nor a ROS node parameter, with the closest known name."""
    known = [*SPECS, *ROS_PARAMETERS]
    warnings = []
    for name in dict.fromkeys(names):
        if name in known or name.startswith("qos_overrides."):
            continue
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        warnings.append(f"unknown parameter '{name}' is ignored{hint}")
    return warnings


def help_text(program: str) -> str:
    """`alpamayo_drive --help`: usage and every parameter with its default and description."""
    lines = [
        f"usage: {program} --ros-args [--params-file FILE] [-p NAME:=VALUE ...]",
        "",
        "Plans trajectories with Alpamayo from time-synced cameras and odometry; see README.md.",
        "Example: alpamayo_drive --ros-args --params-file config/drive.yaml -p model.checkpoint_path:=/models/ckpt",
        "",
        "parameters (name = default: description):",
    ]
    for spec in PARAMETERS:
        extra = []
        if spec.choices:
            extra.append(f"one of {', '.join(spec.choices)}")
        if spec.minimum is not None:
            extra.append(f"{spec.minimum:g} .. {spec.maximum:g}")
        if spec.dynamic:
            extra.append("settable at runtime")
        suffix = f" [{'; '.join(extra)}]" if extra else ""
        lines.append(f"  {spec.name} = {spec.default!r}: {spec.description}{suffix}")
    return "\n".join(lines)
