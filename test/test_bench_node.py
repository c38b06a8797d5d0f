"""bench/bench_node.py end to end on the CPU (issue 7's node-level latency figure), so it cannot rot.

The harness runs for real: the drive node and the publisher as their own processes, this
test's ROS domain, a tiny checkpoint and small frames. The report must hold finite numbers
that respect causality (no stage, transport or wait is negative; the pipeline's stages fit in
its total; end to end exceeds what the node itself measured), every plan must be
matched to the camera messages it came from, and both child processes must exit 0 on SIGINT.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from alpamayo_ros.testing.rig import ros_env, unique_domain_id

ROOT = Path(__file__).resolve().parents[1]
PLANS = 3
HANG_S = 600
MEASURES = ("e2e_ms", "latency_ms", "input_age_ms", "total_ms", "node_overhead_ms", "inbound_ms",
            "receive_ms", "input_wait_ms", "transport_queueing_ms", "publish_lag_ms")  # fmt: skip


def run_bench(command: list[str], env: dict[str, str], out: Path) -> subprocess.CompletedProcess:
    """Run the bench; a hang fails with its output and the node's log instead of pytest's bare timeout.

    The bench's own waits are bounded (ready 300 s, 60 s between plans); past HANG_S it is stopped
    with SIGINT, so it stops its node and publisher too.
    """
    bench = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        bench.send_signal(signal.SIGINT)
        try:
            stdout, stderr = bench.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            bench.kill()
            stdout, stderr = bench.communicate()
        node_log = out / "node.log"
        node_tail = node_log.read_text(errors="replace")[-3000:] if node_log.exists() else "(no node log)"
        pytest.fail(f"bench_node still running after {HANG_S} s\n{stderr[-4000:]}\nnode log:\n{node_tail}")
    return subprocess.CompletedProcess(command, bench.returncode, stdout, stderr)


@pytest.mark.parametrize("transport", ["raw", "compressed"])
def test_bench_node_reports_finite_latencies(tmp_path: Path, tiny_checkpoint: Path, transport: str) -> None:
    domain_id = unique_domain_id()
    report_path = tmp_path / "report.json"
    command = [
        sys.executable, "-m", "bench.bench_node", "--checkpoint", str(tiny_checkpoint),
        "--transport", transport, "--height", "270", "--width", "480", "--plans", str(PLANS), "--warmup", "1",
        "--max-reasoning-tokens", "8", "--domain-id", str(domain_id), "--out", str(tmp_path / "run"),
        "--json", str(report_path),
        # a busy CI box may delay frames; the bench measures, it does not test the node's freshness gates
        "--param", "cameras.max_age_s=1.0", "--plan-timeout-s", "60", "--ready-timeout-s", "300",
    ]  # fmt: skip
    if transport == "compressed":
        command += ["--reference-plans", "1"]
    result = run_bench(command, ros_env(domain_id), tmp_path / "run")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(report_path.read_text())

    assert report["exit_codes"] == {"publisher": 0, "node": 0}
    assert report["unmatched_plans"] == 0
    assert report["config"]["transport"] == transport
    plans = report["plans"]
    assert len(plans) == PLANS
    assert len({plan["t0_ns"] for plan in plans}) == PLANS  # distinct inputs
    for plan in plans:
        for key in MEASURES:
            assert math.isfinite(plan[key]), (key, plan)
        assert plan["total_ms"] > 0 and plan["stages_ms"]["total"] == plan["total_ms"]
        # the node's own work and both transports take time; a negative value means mismatched clocks or stamps
        assert plan["node_overhead_ms"] >= -0.01, plan
        assert plan["inbound_ms"] > 0 and plan["transport_queueing_ms"] > 0 and plan["publish_lag_ms"] >= 0, plan
        # inbound = published -> the image callback in the node + from there to inference (publish() is timed
        # from its call, so the receipt of the last t0 message cannot precede it)
        assert plan["receive_ms"] >= -0.01 and plan["input_wait_ms"] >= plan["stages_ms"]["node.assemble"] > 0, plan
        # the pipeline's stages run one after another inside its total
        stages = plan["stages_ms"]
        parts = sum(stages[name] for name in ("preprocess", "prompt", "backbone", "expert", "action"))
        assert 0 < parts <= plan["total_ms"] + 0.01, stages
        # end to end (this process's clock) covers the node's own latency minus the publisher's lag
        assert plan["e2e_ms"] > plan["latency_ms"] - plan["publish_lag_ms"] > plan["total_ms"], plan
        assert plan["generated_tokens"] is not None and 1 <= plan["generated_tokens"] <= 8
    for key in MEASURES:
        p = report["measures_ms"][key]
        assert set(p) == {"p50", "p90", "p99"} and all(math.isfinite(v) for v in p.values()), key
        assert p["p50"] <= p["p90"] <= p["p99"]
    assert {"preprocess", "backbone", "expert", "total"} <= set(report["stages_ms"])
    assert report["node_diagnostics"]["state"] == "ready"
    assert int(report["node_diagnostics"]["plans"]) >= PLANS + 1
    if transport == "compressed":
        assert report["pipeline_alone"]["stages_ms"]["total"]["p50"] > 0
    assert "| end-to-end: t0 cameras published -> Path received |" in result.stdout
    logs = tmp_path / "run"
    assert "ROS closed; exiting" in (logs / "publisher.log").read_text()  # the publisher's clean end
    assert json.loads((logs / "published.jsonl").read_text().splitlines()[0])["last_ns"] > 0
