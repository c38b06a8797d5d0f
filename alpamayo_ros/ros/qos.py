"""QoS profiles of the drive node, built from the qos.* parameters.

Defaults and why: sensor subscriptions are best effort with a short queue, which matches
both best-effort and reliable publishers and never lets a backlog build up (latest data wins);
outputs are reliable/volatile so a late subscriber gets only fresh plans; the route topic is
reliable and volatile by default, which matches any publisher (transient_local would refuse
a volatile publisher) -- set transient_local for latched route publishers.
"""

from __future__ import annotations

from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

_RELIABILITY = {"best_effort": ReliabilityPolicy.BEST_EFFORT, "reliable": ReliabilityPolicy.RELIABLE}
_DURABILITY = {"volatile": DurabilityPolicy.VOLATILE, "transient_local": DurabilityPolicy.TRANSIENT_LOCAL}


def profile(reliability: str, depth: int, durability: str = "volatile") -> QoSProfile:
    """A keep-last profile from parameter strings (validated by params.check_value)."""
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST,
        depth=depth,
        reliability=_RELIABILITY[reliability],
        durability=_DURABILITY[durability],
    )


def camera_profile(qos: dict[str, object]) -> QoSProfile:
    return profile(str(qos["cameras.reliability"]), int(qos["cameras.depth"]))


def odometry_profile(qos: dict[str, object]) -> QoSProfile:
    return profile(str(qos["odometry.reliability"]), int(qos["odometry.depth"]))


def navigation_profile(qos: dict[str, object]) -> QoSProfile:
    return profile("reliable", 1, str(qos["navigation.durability"]))


def output_profile(qos: dict[str, object]) -> QoSProfile:
    return profile("reliable", int(qos["outputs.depth"]))


def describe(name: str, qos_profile: QoSProfile) -> str:
    """One log line per decision, e.g. 'cameras: best_effort, volatile, depth 2'."""
    return (
        f"{name}: {qos_profile.reliability.name.lower()}, {qos_profile.durability.name.lower()}, "
        f"depth {qos_profile.depth}"
    )
