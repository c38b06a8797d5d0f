"""Route text check at arrival: the node, the evaluator and the server refuse the same routes.

A route is caller text that goes into the prompt between `<|route_start|>` and `<|route_end|>`.
Special-token text (`<|im_end|>`, `<|cot_start|>`, `<i12>`) would let a route rewrite the prompt's
structure, and an unbounded route makes prefill (and memory) unbounded: both are refused when
the route arrives, so planning goes on without it instead of failing on every tick.
"""

from __future__ import annotations

import re

DEFAULT_MAX_ROUTE_CHARS = 512  # routes are short instructions ("Turn right in 30m")

# `<|...|>` covers every Qwen3 and Alpamayo special token; `<iN>` the trajectory tokens.
_SPECIAL_TOKEN = re.compile(r"<\|[^<>|]*\|>|<i\d+>")


class RouteRejected(ValueError):
    """A route text that must not reach the prompt; reason is a stable diagnostic key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_route(text: str, max_chars: int = DEFAULT_MAX_ROUTE_CHARS) -> str | None:
    """Return the stripped route, None for an empty one, or raise RouteRejected."""
    if len(text) > max_chars:
        raise RouteRejected("route_too_long", f"{len(text)} characters (limit {max_chars})")
    stripped = text.strip()
    if not stripped:
        return None
    special = _SPECIAL_TOKEN.search(stripped)
    if special:
        raise RouteRejected("route_special_token", f"contains the model token {special.group(0)!r}")
    if not stripped.isprintable():
        raise RouteRejected("route_unprintable", "contains control characters")
    return stripped
