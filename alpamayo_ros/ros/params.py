"""Declare the drive node's parameter table (alpamayo_ros/settings.py) on a ROS node."""

from __future__ import annotations

from typing import Any

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.node import Node

from alpamayo_ros.settings import PARAMETERS, ParamSpec


def descriptor(spec: ParamSpec) -> ParameterDescriptor:
    """ROS descriptor of a spec: description, range, choices; read-only unless dynamic."""
    constraints = f"one of: {', '.join(spec.choices)}" if spec.choices else ""
    desc = ParameterDescriptor(
        name=spec.name, description=spec.description, additional_constraints=constraints, read_only=not spec.dynamic
    )
    if spec.minimum is not None and isinstance(spec.default, float):
        desc.floating_point_range = [
            FloatingPointRange(from_value=float(spec.minimum), to_value=float(spec.maximum), step=0.0)
        ]
    elif spec.minimum is not None and isinstance(spec.default, int) and not isinstance(spec.default, bool):
        desc.integer_range = [IntegerRange(from_value=int(spec.minimum), to_value=int(spec.maximum), step=0)]
    return desc


def declare_parameters(node: Node) -> dict[str, Any]:
    """Declare every parameter on node and return name -> value (overrides applied)."""
    return {spec.name: node.declare_parameter(spec.name, spec.default, descriptor(spec)).value for spec in PARAMETERS}
