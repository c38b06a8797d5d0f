"""What the host did during timed plans, recorded beside them: Python garbage collections and
the process's resource usage (CPU time, page faults, context switches) during each preprocess.

Preprocessing has two modes on the GPU machines, ~7 ms or 50-100 ms a plan, for whole runs at a
time, and its cause is not found. Each candidate leaves its own trace here: a collection inside
the plan (gc), fresh memory (minor faults, system time), other threads taking the cores
(involuntary switches while the CPU time stays that of a fast call), or a wait (voluntary
switches, CPU time far below the wall time).
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import time
from typing import Any, Callable

import torch

#: rusage fields kept per preprocess call, and their names in the JSON
USAGE_FIELDS = {"ru_minflt": "minor_faults", "ru_majflt": "major_faults", "ru_nvcsw": "voluntary_switches",
                "ru_nivcsw": "involuntary_switches"}  # fmt: skip


class GcPauses:
    """Every collection while entered: (perf_counter start, seconds, generation)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, int]] = []
        self._started = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        else:
            self.events.append((self._started, now - self._started, int(info["generation"])))

    def within(self, start: float, end: float) -> list[dict[str, float]]:
        """Collections that began in [start, end): offset from start and length in ms, generation."""
        return [
            {"at_ms": (began - start) * 1e3, "ms": seconds * 1e3, "generation": generation}
            for began, seconds, generation in self.events
            if start <= began < end
        ]


def _snapshot() -> tuple[float, resource.struct_rusage]:
    return time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)


def usage_between(before: tuple[float, resource.struct_rusage], after: tuple[float, resource.struct_rusage]) -> dict[str, float]:
    """Wall, user and system CPU ms (all threads of the process) and the USAGE_FIELDS counts."""
    (wall0, r0), (wall1, r1) = before, after
    usage = {"wall_ms": (wall1 - wall0) * 1e3, "user_ms": (r1.ru_utime - r0.ru_utime) * 1e3,
             "system_ms": (r1.ru_stime - r0.ru_stime) * 1e3}  # fmt: skip
    usage.update({name: getattr(r1, field) - getattr(r0, field) for field, name in USAGE_FIELDS.items()})
    return usage


class PreprocessUsage:
    """While entered, records usage_between around every call of `owner.preprocess` (an
    instance attribute shadowing the method, removed on exit)."""

    def __init__(self, owner: Any) -> None:
        self.calls: list[dict[str, float]] = []
        self._owner = owner

    def __enter__(self) -> PreprocessUsage:
        original: Callable[..., Any] = self._owner.preprocess

        def probed(*args: Any, **kwargs: Any) -> Any:
            before = _snapshot()
            try:
                return original(*args, **kwargs)
            finally:
                self.calls.append(usage_between(before, _snapshot()))

        self._owner.preprocess = probed
        return self

    def __exit__(self, *exc: object) -> None:
        del self._owner.preprocess

    def last(self) -> dict[str, float] | None:
        return self.calls[-1] if self.calls else None


def summarize_host(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """Over timed plans, each {"preprocess_ms", "gc": GcPauses.within(...), optionally
    "preprocess_usage": usage_between(...)}: collections per generation and their ms per plan;
    the slow preprocesses (over twice the median), how many had a collection start inside them,
    and the median usage of slow and of fast preprocesses side by side."""
    preprocess = sorted(plan["preprocess_ms"] for plan in plans)
    median = preprocess[len(preprocess) // 2] if preprocess else 0.0
    slow = [plan for plan in plans if plan["preprocess_ms"] > 2 * median]
    fast = [plan for plan in plans if plan["preprocess_ms"] <= 2 * median]

    def median_usage(group: list[dict[str, Any]]) -> dict[str, float] | None:
        usages = [plan["preprocess_usage"] for plan in group if plan.get("preprocess_usage")]
        return {key: statistics.median(u[key] for u in usages) for key in usages[0]} if usages else None

    return {
        "collections": {str(g): sum(e["generation"] == g for p in plans for e in p["gc"]) for g in (0, 1, 2)},
        "gc_ms_per_plan": [round(sum(e["ms"] for e in plan["gc"]), 2) for plan in plans],
        "slow_preprocess_plans": len(slow),
        "slow_preprocess_plans_with_gc_inside": sum(
            any(e["at_ms"] < plan["preprocess_ms"] for e in plan["gc"]) for plan in slow
        ),
        "preprocess_usage_median": {"slow": median_usage(slow), "fast": median_usage(fast)},
    }


def host_line(summary: dict[str, Any]) -> str:
    """summarize_host's figures in one report line."""
    per_plan = summary["gc_ms_per_plan"]
    line = (f"gc in timed plans: collections by generation {summary['collections']}, "
            f"max {max(per_plan, default=0.0):.1f} ms in a plan; slow preprocesses {summary['slow_preprocess_plans']}, "
            f"with a collection inside {summary['slow_preprocess_plans_with_gc_inside']}")  # fmt: skip
    for group, usage in summary.get("preprocess_usage_median", {}).items():
        if usage:
            line += (f"; {group} preprocess median: wall {usage['wall_ms']:.1f} ms, cpu {usage['user_ms']:.1f} user + "
                     f"{usage['system_ms']:.1f} system ms, {usage['minor_faults']:.0f} faults, "
                     f"{usage['voluntary_switches']:.0f} / {usage['involuntary_switches']:.0f} switches "
                     f"(voluntary / involuntary)")  # fmt: skip
    return line


def host_facts() -> dict[str, float]:
    """The host a run shared: torch's intra-op threads, the CPUs this process may use, the 1-minute
    load average (other processes' demand) when asked."""
    return {"torch_threads": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0)),
            "loadavg_1m": os.getloadavg()[0]}  # fmt: skip
