"""planning.trigger = frames: a real node process plans from each newer complete frame set as it
arrives (not on the planning timer), and its slow timer still reports a camera that stops."""

from __future__ import annotations

from pathlib import Path

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from nav_msgs.msg import Path as PathMsg

from alpamayo_ros.inputs.messages import stamp_to_ns
from alpamayo_ros.testing.rig import (
    CameraFeed,
    RosSide,
    SensorRig,
    diag_values,
    ros_env,
    start_console_script,
    stop_process,
    unique_domain_id,
    wait_until,
    write_params_file,
)
from alpamayo_ros_msgs.msg import StageTimings

NODE = "/alpamayo_drive"
TIMER_HZ = 0.5  # the planning timer: on its own it could start at most one plan per 2 s
WINDOW_S = 6.0


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path):
    tmp = tmp_path_factory.mktemp("trigger")
    domain_id = unique_domain_id()
    side = RosSide(domain_id, "trigger_test")
    cameras = [CameraFeed(1, "/trig/front", "raw"), CameraFeed(6, "/trig/tele", "compressed")]
    params = {
        "model.checkpoint_path": str(tiny_checkpoint),
        "cameras.topics": [c.topic for c in cameras],
        "cameras.indices": [c.index for c in cameras],
        "cameras.transports": [c.transport for c in cameras],
        "odometry.topic": "/trig/odom",
        "planning.rate_hz": TIMER_HZ,
        "planning.trigger": "frames",
        "sampling.max_reasoning_tokens": 4,
        "sampling.flow_steps": 2,
        "diagnostics.rate_hz": 5.0,
        "cameras.max_age_s": 0.5,
    }
    reliable = side.reliable(depth=200)
    collected = {
        "paths": side.collect(PathMsg, f"{NODE}/output/path", reliable),
        "timings": side.collect(StageTimings, f"{NODE}/output/timings", reliable),
        "diagnostics": side.collect(DiagnosticArray, "/diagnostics", reliable),
    }
    rig = SensorRig(side, cameras, odometry_topic="/trig/odom").start()
    log = tmp / "node.log"
    process = start_console_script(
        "alpamayo_drive",
        env=ros_env(domain_id, OMP_NUM_THREADS="1"),
        log_path=log,
        params_file=write_params_file(tmp / "drive.yaml", params),
    )
    yield {"cameras": cameras, "log": log, **collected}
    rig.stop()
    code = stop_process(process, timeout_s=40)
    side.close()
    assert code == 0, f"node exit code {code} after SIGINT\n{log.read_text(errors='replace')[-4000:]}"


def test_newer_frame_sets_start_plans_without_waiting_for_the_timer(node) -> None:
    """Plans start from frame sets, not ticks: counted by the node itself, not by the clock."""
    paths, timings, diagnostics = node["paths"], node["timings"], node["diagnostics"]
    log = lambda: node["log"].read_text(errors="replace")[-4000:]  # noqa: E731
    assert wait_until(lambda: len(paths) >= 1, timeout_s=120), log()
    first = len(paths)
    assert wait_until(lambda: len(paths) - first >= 4, timeout_s=300), log()
    published = len(paths)
    # each published plan came from a frame set (the diagnostics follow every plan; wait for them)
    assert wait_until(
        lambda: int(diag_values(diagnostics.messages[-1]).get("frame_starts", 0)) >= published, timeout_s=60
    ), diag_values(diagnostics.messages[-1])
    counters = diag_values(diagnostics.messages[-1])
    assert int(counters["ticks.started"]) == 0, counters  # with trigger frames a tick never starts a plan
    t0s = [stamp_to_ns(path.header.stamp) for path in paths.messages]
    assert t0s == sorted(set(t0s))  # every plan from a newer frame set, none twice
    # the frame that completed the set started the plan: its wait covers only the assembly
    for message in timings.messages[first:]:
        stages = dict(zip(message.stage_names, message.stage_ms))
        assert 0.0 < stages["node.assemble"] <= stages["node.input_wait"], stages


def test_the_timer_still_reports_a_stopped_camera(node) -> None:
    diagnostics = node["diagnostics"]
    front = next(c for c in node["cameras"] if c.index == 1)
    front.stopped = True
    try:
        assert wait_until(
            lambda: diag_values(diagnostics.messages[-1]).get("last_rejection", "").startswith("camera_stale"),
            timeout_s=20,
        ), diag_values(diagnostics.messages[-1])
    finally:
        front.stopped = False
    plans_before = len(node["paths"])
    assert wait_until(lambda: len(node["paths"]) > plans_before + 2, timeout_s=30)  # planning resumes
