"""alpamayo-demo end to end (short drive): node process, closed loop, MCAP, report, plots.

Also the acceptance check that the evaluator and the node build the same inputs: the demo
re-plans offline, through the evaluator, at every t0 the node planned for online, with the
same checkpoint and seed; identical plans mean identical inputs.
"""

import json
import shlex
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from alpamayo_ros.testing.rig import VENV_BIN, ros_env, unique_domain_id

from alpamayo_ros.eval.bags import bag_topics, read_messages
from alpamayo_ros.eval.scene import ASPHALT, SKY, Renderer, Road, Vehicle, default_rig


README = Path(__file__).resolve().parents[1] / "README.md"
TIMING_KEYS = {"timings_ms", "latency_ms", "drive_wall_s"}  # wall-clock measurements, not results


def run_demo(out: Path, *params: str) -> str:
    run = subprocess.run(
        [str(VENV_BIN / "alpamayo-demo"), "--out", str(out), "--duration", "11", "--cameras", "1",
         "--rate", "0.5", "--max-reasoning-tokens", "4", *(f"--param={p}" for p in params)],
        env=ros_env(unique_domain_id()), capture_output=True, text=True, timeout=1500)  # hang guard only
    log = run.stdout + run.stderr
    assert run.returncode == 0, log + (out / "node.log").read_text(errors="replace")
    return log


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("demo")
    return out, run_demo(out)


def without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def test_says_plainly_that_a_tiny_model_drives_nonsense(demo):
    _, log = demo
    assert "tiny random model drives nonsense" in log
    assert "--checkpoint" in log  # how real weights plug in


def test_leaves_mcap_json_and_png(demo):
    out, _ = demo
    assert list((out / "session").glob("*.mcap"))
    doc = json.loads((out / "report.json").read_text())
    assert doc["plots"] and all((out / p).stat().st_size > 0 for p in doc["plots"])
    assert any(p.endswith(".png") for p in doc["plots"])
    assert "drive_map.png" in doc["plots"]
    assert "nonsense" in (out / "report.md").read_text()


def test_session_holds_inputs_and_node_outputs(demo):
    out, _ = demo
    topics = bag_topics(out / "session")
    assert topics["/odom"][1] >= 500  # 11 s at 50 Hz
    assert topics["/demo/camera_front_wide_120fov/image/compressed"][1] >= 100
    assert topics["/alpamayo_drive/output/trajectories"][1] >= 2
    assert topics["/alpamayo_drive/output/timings"][0] == "alpamayo_ros_msgs/msg/StageTimings"


def test_evaluator_reproduces_the_node_plans(demo):
    out, _ = demo
    doc = json.loads((out / "report.json").read_text())
    assert doc["demo"]["plans_followed"] >= 2
    assert doc["summary"]["count"] >= 1  # at least one plan with 6.4 s of driven future
    assert doc["replan_compared"] >= 1
    assert doc["replan_max_difference_m"] < 1e-3


def test_scene_draws_the_road_and_keeps_a_wild_vehicle_on_it():
    road = Road.winding()
    front = default_rig(128, 72)[0]
    vehicle = Vehicle.on_road(road)
    image = Renderer(road, (front,)).render(vehicle.pose, front)
    assert tuple(image[2, 64]) == SKY and tuple(image[70, 64]) == ASPHALT  # sky above, road ahead
    for _ in range(100):  # a plan pulling 100 m to the left, every step
        vehicle.follow(vehicle.pose.to_world(np.array([[1.0, 100.0]]))[0], 0.1)
        _, lateral = road.locate(vehicle.pose.xy)
        assert abs(lateral - vehicle.lane_offset_m) <= vehicle.max_lateral_m + 1e-9
    assert vehicle.clamped_steps > 0


def test_reasoning_text_is_what_was_generated(demo):
    """4 tokens never reach <|cot_end|>: the Reasoning messages carry the generated text, marked unclosed there and in the report."""
    out, _ = demo
    messages = [m.msg for m in read_messages(out / "session", topics=["/alpamayo_drive/output/reasoning"])]
    assert messages and all(m.coc and not m.closed and list(m.sample_closed) == [False] for m in messages)
    ticks = [t for t in json.loads((out / "report.json").read_text())["bags"][0]["ticks"] if "min_ade" in t]
    assert ticks and all(t["coc"][0] and t["reasoning_closed"] == [False] for t in ticks)


def test_readme_eval_command_works_on_the_demo_recording(demo, tmp_path):
    """The evaluation command of the README, as written, with out/demo where this demo wrote."""
    out, _ = demo
    (line,) = [x for x in README.read_text().splitlines() if x.startswith(".venv/bin/alpamayo-eval out/demo/session")]
    command = [a.replace("out/demo", str(out)).replace("out/eval", str(tmp_path / "eval")) for a in shlex.split(line)]
    command[0] = str(VENV_BIN / "alpamayo-eval")
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert doc["summary"]["count"] >= 1 and doc["bags"][0]["bag"] == str(out / "session")


def test_same_seed_gives_the_same_report(demo):
    """Lockstep (the default): a second run of the same demo drives and scores exactly the same."""
    out, _ = demo
    first = json.loads((out / "report.json").read_text())
    run_demo(out)
    second = json.loads((out / "report.json").read_text())
    assert second["demo"]["lockstep"] and second["demo"]["plans_followed"] >= 2
    assert without_timings(second) == without_timings(first)


def test_the_demo_drives_on_vllm_with_speculative_reasoning(tmp_path):
    """The same demo with the vLLM backend drafting from earlier plans: the node's plans carry
    speculation counts and the evaluator, speculating the same way, re-plans them."""
    out = tmp_path / "spec"
    run_demo(out, "model.backend:=vllm", "model.dtype:=float32", "vllm.kv_cache_gib:=1.0", "vllm.enforce_eager:=true",
             "vllm.speculation.method:=plans", "vllm.speculation.draft_tokens:=2", "sampling.temperature:=0.0")
    doc = json.loads((out / "report.json").read_text())
    assert doc["backend"] == "vllm" and doc["demo"]["plans_followed"] >= 2
    assert doc["replan_compared"] >= 1 and doc["replan_max_difference_m"] < 1e-3
    timings = [m.msg for m in read_messages(out / "session", topics=["/alpamayo_drive/output/timings"])]
    assert sum(t.drafted_tokens for t in timings) > 0  # the node's plans drafted from earlier ones
    assert doc["speculation"]["drafted_tokens"] > 0  # and so did the evaluator's


def test_the_demo_refuses_an_unknown_parameter_naming_it(tmp_path):
    run = subprocess.run([str(VENV_BIN / "alpamayo-demo"), "--out", str(tmp_path), "-p", "model.backnd:=vllm"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "unknown parameter 'model.backnd'; did you mean 'model.backend'?" in run.stderr
    assert not (tmp_path / "session").exists()  # refused before anything ran
