"""alpamayo_drive on a simulated clock that arrives late and jumps, as with a replayed bag.

With use_sim_time the node is ready before /clock arrives, at sim time 0; the bag's clock then
starts at 1000 s, and a loop or a seek jumps it. Time the node never lived through is no silence:
diagnostics must not call the planner stalled for it, and a stall that is real (here: the server
of model.backend remote is down, so no plan comes out) must still show, with its reason up front.
A real node process (remote backend: no model to load) and a real /clock from the sensor rig.
"""

from __future__ import annotations

import time
from pathlib import Path

from diagnostic_msgs.msg import DiagnosticArray

from alpamayo_ros.inputs.messages import stamp_to_ns
from alpamayo_ros.testing.rig import (
    CameraFeed,
    RosSide,
    SensorRig,
    diag_values,
    log_excerpt,
    ros_env,
    start_console_script,
    stop_process,
    unique_domain_id,
    wait_until,
    write_params_file,
)
from alpamayo_ros.serve.process import free_port  # the remote backend's server: down

SIM_START_S = 1000.0
JUMP_S = 500.0
MAX_SILENCE_S = 3.0
TIMEOUT_S = 300.0  # hang guard on a busy machine
ROUNDING_S = 0.15  # since_plan_s is reported to 0.1 s



def _report(msg: DiagnosticArray) -> dict[str, str]:
    return {**diag_values(msg), "message": msg.status[0].message, "stamp_ns": str(stamp_to_ns(msg.header.stamp))}


def _brief(reports: list[dict[str, str]]) -> list[tuple[str, ...]]:
    """What a failure shows of some reports: stamp, stalled, since_plan_s, message."""
    return [(r["stamp_ns"], r["stalled"], r["since_plan_s"], r["message"]) for r in reports]


def test_late_clock_and_a_jump_are_no_stall_and_a_real_stall_names_its_reason(tmp_path: Path) -> None:
    domain_id = unique_domain_id()
    side = RosSide(domain_id, "sim_clock_test")
    cameras = [CameraFeed(1, "/simclock/front", "raw")]
    params = write_params_file(tmp_path / "drive.yaml", {
        "use_sim_time": True, "model.backend": "remote", "remote.url": f"http://127.0.0.1:{free_port()}",
        "cameras.topics": [c.topic for c in cameras], "cameras.indices": [c.index for c in cameras],
        "cameras.transports": [c.transport for c in cameras], "odometry.topic": "/simclock/odom",
        "diagnostics.max_plan_silence_s": MAX_SILENCE_S, "diagnostics.rate_hz": 4.0,
        "cameras.max_age_s": 1.0, "odometry.max_stale_s": 0.3, "odometry.max_gap_s": 1.0,
    })  # fmt: skip
    diagnostics = side.collect(DiagnosticArray, "/diagnostics", side.reliable(depth=100))
    log = tmp_path / "node.log"
    process = start_console_script("alpamayo_drive", env=ros_env(domain_id), log_path=log, params_file=params)
    rig = None

    def reports() -> list[dict[str, str]]:
        return [_report(m) for m in diagnostics.messages]

    def stalled_after(start_ns: int) -> bool:
        return any("planning_stalled" in r["message"] and int(r["stamp_ns"]) >= start_ns for r in reports())

    try:
        # ready with no /clock yet: the node's time is 0
        assert wait_until(lambda: "ready: " in log.read_text() or process.poll() is not None, TIMEOUT_S)
        assert process.poll() is None, log.read_text()[-3000:]
        rig = SensorRig(side, cameras, odometry_topic="/simclock/odom", sim_start_s=SIM_START_S).start()
        assert wait_until(lambda: stalled_after(int(SIM_START_S * 1e9)), TIMEOUT_S), (
            reports()[-3:], log_excerpt(log, rig)
        )
        jumped_to_ns = rig.now_ns() + int(JUMP_S * 1e9)
        rig.jump_clock(int(JUMP_S * 1e9))
        assert wait_until(lambda: stalled_after(jumped_to_ns), TIMEOUT_S), (reports()[-3:], log_excerpt(log, rig))
    finally:
        if rig is not None:
            rig.stop()
        code = stop_process(process, timeout_s=40)
        side.close()
    assert code == 0, log.read_text()[-3000:]

    # Silence counts from the clock's arrival, and again from the jump: never from sim time 0,
    # nor across the jump. (Reports are stamped with the node's clock.)
    starts_ns = [int(SIM_START_S * 1e9), jumped_to_ns]
    timed = [r for r in reports() if int(r["stamp_ns"]) >= starts_ns[0]]
    for r in timed:
        stamp_ns = int(r["stamp_ns"])
        lived_s = (stamp_ns - max(s for s in starts_ns if s <= stamp_ns)) / 1e9
        assert float(r["since_plan_s"]) <= lived_s + ROUNDING_S, _brief([r])
        if lived_s < MAX_SILENCE_S:
            assert "planning_stalled" not in r["message"], _brief([r])
    # The real stall: the reason plans are refused right after its key, then how long (the
    # reason may be another one for a moment after the jump: the buffered input is then old)
    stalls = [r for r in timed if "planning_stalled" in r["message"]]
    assert stalls and all(r["message"].startswith("planning_stalled: no plan: ") for r in stalls), _brief(stalls)
    assert any(r["message"].startswith("planning_stalled: no plan: remote_unavailable") for r in stalls), _brief(stalls)
    # (since_plan_s is rounded to 0.1 s: 3.04 s reads 3.0)
    assert all(float(r["since_plan_s"]) >= MAX_SILENCE_S and r["stalled"] == "true" for r in stalls), _brief(stalls)
    quiet = [r for r in timed if "planning_stalled" not in r["message"]]
    assert all(r["stalled"] == "false" for r in quiet), _brief(quiet)
