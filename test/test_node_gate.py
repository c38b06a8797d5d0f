"""The output gate (alpamayo_ros/drive/gate.py) on plans the model produced (issue 12 acceptance 4).

Bad plans come from real checkpoints whose action head was edited the way a broken model
would behave: scaled up (actions far outside the action space's bounds), NaN bias, or a
constant hard turn at speed (curvature within bounds, lateral acceleration impossible). The
tiny checkpoint as written, on inputs like the demo's (5-15 m/s, straight), passes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.types import DrivingInput, SamplingSettings
from alpamayo_ros.drive.gate import gate_plan

SAMPLING = SamplingSettings(num_samples=2, max_reasoning_tokens=4, flow_steps=4)
MAX_LATERAL = 12.0  # gates.max_lateral_accel_mps2 default


def edited_checkpoint(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor], dict], None]) -> Path:
    """A copy of source whose action_out_proj tensors were changed by edit(tensors, action_space_cfg)."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    edit(tensors, config["action_space_cfg"])
    save_file(tensors, str(target / "model.safetensors"))
    return target


def plans(checkpoint: Path, make_input: Callable[..., DrivingInput], speeds: tuple[float, ...],
          sampling: SamplingSettings = SAMPLING) -> list:  # fmt: skip
    pipeline = Pipeline.from_checkpoint(checkpoint)
    try:
        return [pipeline.plan(make_input(height=64, width=96, speed_mps=v, seed=i), sampling) for i, v in enumerate(speeds)]
    finally:
        pipeline.close()


def test_good_plans_pass(tiny_checkpoint: Path, make_driving_input) -> None:
    for plan in plans(tiny_checkpoint, make_driving_input, (5.0, 8.0, 15.0)):
        assert plan.within_bounds is not None and plan.within_bounds.all()
        assert gate_plan(plan, MAX_LATERAL) is None


def test_actions_outside_the_bounds_are_dropped(tiny_checkpoint: Path, make_driving_input, tmp_path: Path) -> None:
    def scale(tensors: dict[str, torch.Tensor], _: dict) -> None:
        tensors["action_out_proj.weight"] *= 1000.0
        tensors["action_out_proj.bias"] += 50.0

    (plan,) = plans(edited_checkpoint(tiny_checkpoint, tmp_path / "scaled", scale), make_driving_input, (8.0,))
    assert not plan.within_bounds.all()
    reason, detail = gate_plan(plan, MAX_LATERAL)
    assert reason == "plan_out_of_bounds" and "action space's bounds" in detail


def test_non_finite_actions_are_dropped(tiny_checkpoint: Path, make_driving_input, tmp_path: Path) -> None:
    def poison(tensors: dict[str, torch.Tensor], _: dict) -> None:
        tensors["action_out_proj.bias"][0] = float("nan")

    (plan,) = plans(edited_checkpoint(tiny_checkpoint, tmp_path / "nan", poison), make_driving_input, (8.0,))
    reason, detail = gate_plan(plan, MAX_LATERAL)
    assert reason == "plan_nonfinite" and "sample 0" in detail


def test_a_hard_turn_at_speed_is_implausible(tiny_checkpoint: Path, make_driving_input, tmp_path: Path) -> None:
    """Curvature 0.1 1/m (inside the bounds) held at 20 m/s: 40 m/s^2 of lateral acceleration."""

    def turn(tensors: dict[str, torch.Tensor], space: dict) -> None:
        # a constant velocity field: with no initial noise the action is exactly the bias
        tensors["action_out_proj.weight"].zero_()
        tensors["action_out_proj.bias"].copy_(torch.tensor([
            -space["accel_mean"] / space["accel_std"], (0.1 - space["curvature_mean"]) / space["curvature_std"],
        ]))  # fmt: skip

    no_noise = SamplingSettings(num_samples=1, max_reasoning_tokens=4, flow_steps=4, noise_temperature=0.0)
    (plan,) = plans(edited_checkpoint(tiny_checkpoint, tmp_path / "turn", turn), make_driving_input, (20.0,), no_noise)
    assert plan.within_bounds.all()
    reason, detail = gate_plan(plan, MAX_LATERAL)
    assert reason == "plan_implausible" and "lateral acceleration" in detail
    assert gate_plan(plan, 100.0) is None  # the limit is the parameter


def test_the_node_drops_the_bad_plans_of_a_broken_model(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A node process on the scaled checkpoint: every plan is refused by name, no Path goes out."""
    from diagnostic_msgs.msg import DiagnosticArray
    from nav_msgs.msg import Path as PathMsg

    from alpamayo_ros.testing.rig import (
        CameraFeed, RosSide, SensorRig, diag_values, log_excerpt, ros_env, start_console_script, stop_process, unique_domain_id,
        wait_until, write_params_file,
    )  # fmt: skip

    def scale(tensors: dict[str, torch.Tensor], _: dict) -> None:
        tensors["action_out_proj.weight"] *= 1000.0
        tensors["action_out_proj.bias"] += 50.0

    checkpoint = edited_checkpoint(tiny_checkpoint, tmp_path / "scaled", scale)
    domain_id = unique_domain_id()
    side = RosSide(domain_id, "gate_test")
    cameras = [CameraFeed(1, "/gate/front", "raw")]
    params = write_params_file(tmp_path / "drive.yaml", {
        "model.checkpoint_path": str(checkpoint), "cameras.topics": ["/gate/front"], "cameras.indices": [1],
        "cameras.transports": ["raw"], "odometry.topic": "/gate/odom", "sampling.max_reasoning_tokens": 4,
        "sampling.flow_steps": 2, "cameras.max_age_s": 1.0, "odometry.max_stale_s": 0.3, "diagnostics.rate_hz": 5.0,
    })  # fmt: skip
    paths = side.collect(PathMsg, "/alpamayo_drive/output/path", side.reliable())
    diagnostics = side.collect(DiagnosticArray, "/diagnostics", side.reliable(depth=100))
    rig = SensorRig(side, cameras, odometry_topic="/gate/odom").start()
    log = tmp_path / "node.log"
    process = start_console_script("alpamayo_drive", env=ros_env(domain_id, OMP_NUM_THREADS="1"), log_path=log,
                                   params_file=params)  # fmt: skip

    def refused() -> int:
        return max((int(diag_values(m).get("rejected.plan_out_of_bounds", 0)) for m in diagnostics.messages), default=0)

    try:
        assert wait_until(lambda: refused() >= 3, timeout_s=300), log_excerpt(log, rig)
    finally:
        rig.stop()
        code = stop_process(process, timeout_s=40)
        side.close()
    assert code == 0, log.read_text()[-3000:]
    assert len(paths) == 0
    reports = [diag_values(m) for m in diagnostics.messages]
    assert any(r["last_rejection"].startswith("plan_out_of_bounds: sample 0") for r in reports)
    assert all(int(r["plans"]) == 0 for r in reports)
