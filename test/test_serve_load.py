"""A bounded load test on loopback: 4 concurrent RemotePlanner clients, 200 requests, a queue
of 2. Only 503s (queue full, with Retry-After, which the clients honour) may fail; the server's memory stays flat.
Latency percentiles are printed (pytest -s), not asserted."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
import pytest
from serve_helpers import hf_server, small_frames_checkpoint

from alpamayo_ros.core.types import DrivingInput, SamplingSettings
from alpamayo_ros.serve.client import RemotePlanner, RemoteRejected

CLIENTS = 4
REQUESTS = 200
SETTINGS = SamplingSettings(temperature=0.0, max_reasoning_tokens=2, flow_steps=2)
RSS_GROWTH_LIMIT_MB = 300  # generous: a leak of one request's frames per request would exceed it


def test_four_clients_two_hundred_requests(
    tiny_checkpoint: Path, tmp_path: Path, make_driving_input: Callable[..., DrivingInput]
) -> None:
    checkpoint = small_frames_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    server = hf_server(checkpoint, tmp_path / "server.log", "--queue-size", "2").start()
    try:
        rss = psutil.Process(server.process.pid)
        inputs = make_driving_input(camera_indices=(1,), frames=1, height=64, width=96)
        latencies_ms: list[float] = []
        outcomes: dict[str, int] = {}
        errors: list[str] = []
        counter = iter(range(REQUESTS))
        lock = threading.Lock()
        rss_after_warmup: list[int] = []

        def client() -> None:
            planner = RemotePlanner(server.url, timeout_s=120)
            while True:
                with lock:
                    index = next(counter, None)
                if index is None:
                    break
                if index == 20:
                    rss_after_warmup.append(rss.memory_info().rss)
                start = time.perf_counter()
                try:
                    planner.plan(inputs, SETTINGS)
                    outcome = "ok"
                except RemoteRejected as rejected:
                    outcome = f"http_{rejected.status}"
                    if rejected.status != 503 or "busy" not in rejected.message or not rejected.retry_after_s:
                        errors.append(str(rejected))
                    else:
                        time.sleep(rejected.retry_after_s)  # as the server asked
                except Exception as error:  # noqa: BLE001 - every other failure is a test failure
                    outcome = type(error).__name__
                    errors.append(repr(error))
                with lock:
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                    if outcome == "ok":
                        latencies_ms.append((time.perf_counter() - start) * 1e3)
            planner.close()

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)  # hang guard
        assert not any(thread.is_alive() for thread in threads)
        growth_mb = (rss.memory_info().rss - rss_after_warmup[0]) / 2**20
        p50, p99 = np.percentile(latencies_ms, [50, 99])
        print(f"\nload: {outcomes}, p50 {p50:.0f} ms, p99 {p99:.0f} ms, server RSS growth {growth_mb:.0f} MB")
        assert not errors, errors[:5]
        assert sum(outcomes.values()) == REQUESTS and outcomes["ok"] > 0
        assert growth_mb < RSS_GROWTH_LIMIT_MB
    finally:
        server.stop()


pytestmark = pytest.mark.timeout(900)
