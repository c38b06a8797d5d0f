"""Prometheus metrics of one server: requests, latency, queue depth, rejections by reason.

A registry per server (not the process-global one), so several apps in one process (tests,
benchmarks) never share or collide on counters.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """requests{endpoint,status}, latency{endpoint}, queue depth (read when scraped), rejections{reason}."""

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
        depth = Gauge("alpamayo_queue_depth", "Requests queued or running on the pipeline", registry=self.registry)
        depth.set_function(queue_depth)

    def render(self) -> bytes:
        return generate_latest(self.registry)
