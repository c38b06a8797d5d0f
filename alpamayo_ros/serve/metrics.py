"""Prometheus metrics of one server: requests, latency, queue depth, rejections by reason, and
the speculative-reasoning tokens its plans drafted and accepted.

A registry per server (not the process-global one), so several apps in one process (tests,
benchmarks) never share or collide on counters.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..core.types import Plan

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """requests{endpoint,status}, latency{endpoint}, queue depth (read when scraped), rejections{reason},
    speculation drafted / accepted tokens (fed by count_plan)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "alpamayo_requests", "Requests answered", ["endpoint", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "alpamayo_request_latency_seconds", "Time from arrival to answer of served requests",
            ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.rejections = Counter(
            "alpamayo_rejections", "Requests refused, by reason", ["reason"], registry=self.registry
        )
        # accepted / drafted over a scrape interval is the acceptance rate of the plans in it
        self.drafted_tokens = Counter(
            "alpamayo_speculation_drafted_tokens", "Draft tokens the model verified (vllm.speculation), all samples",
            registry=self.registry,
        )
        self.accepted_tokens = Counter(
            "alpamayo_speculation_accepted_tokens", "Draft tokens the model accepted (vllm.speculation), all samples",
            registry=self.registry,
        )
        depth = Gauge("alpamayo_queue_depth", "Requests queued or running on the pipeline", registry=self.registry)
        depth.set_function(queue_depth)

    def count_plan(self, plan: Plan) -> None:
        """Add one served plan's speculation counts (0 and 0 with speculation off)."""
        self.drafted_tokens.inc(plan.drafted_tokens)
        self.accepted_tokens.inc(plan.accepted_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
