"""Output gate: a plan that cannot be driven is dropped, never published.

It checks what a model can actually get wrong: non-finite numbers, actions outside the action
space's own bounds (the model's acceleration and curvature outputs are unbounded; training data
never left those bounds), and motion no car can make (speed^2 x curvature above a lateral
acceleration limit, held for a second). Plans are integrated from the history speed, so their first waypoint is
always near the ego: where a plan starts is no test. ROS-free.
"""

from __future__ import annotations

import numpy as np

from alpamayo_ros.core.types import WAYPOINT_DT_S, Plan

SUSTAINED_S = 1.0  # lateral acceleration is judged as a mean over this long


def gate_plan(plan: Plan, max_lateral_accel_mps2: float) -> tuple[str, str] | None:
    """(reason, detail) when a plan must not be published, else None."""
    arrays = {"waypoints": plan.xyz, "rotations": plan.rot, "accelerations": plan.accel_mps2,
              "curvatures": plan.curvature_per_m}  # fmt: skip
    for name, values in arrays.items():
        if values is not None and not np.isfinite(values).all():
            sample = int(np.argmax(~np.isfinite(values.reshape(len(values), -1)).all(axis=1)))
            return "plan_nonfinite", f"sample {sample}: the model returned non-finite {name}"
    if plan.within_bounds is not None and not plan.within_bounds.all():
        sample = int(np.argmin(plan.within_bounds))
        accel = _worst(plan.accel_mps2, sample)
        curvature = _worst(plan.curvature_per_m, sample)
        return (
            "plan_out_of_bounds",
            f"sample {sample}: actions outside the action space's bounds (acceleration up to {accel} m/s^2, "
            f"curvature up to {curvature} 1/m)",
        )
    if plan.curvature_per_m is not None:
        steps = np.diff(plan.xyz[..., :2], axis=1, prepend=np.zeros_like(plan.xyz[:, :1, :2]))
        speed = np.linalg.norm(steps, axis=-1) / WAYPOINT_DT_S  # (samples, 64) m/s
        # signed speed^2 x curvature, averaged over SUSTAINED_S: step-to-step curvature noise
        # of a sampled action averages out, a turn the car would have to hold does not
        window = round(SUSTAINED_S / WAYPOINT_DT_S)
        lateral = speed**2 * plan.curvature_per_m
        kernel = np.full(window, 1.0 / window)
        sustained = np.abs(np.stack([np.convolve(row, kernel, mode="valid") for row in lateral]))
        sample, step = np.unravel_index(int(np.argmax(sustained)), sustained.shape)
        if sustained[sample, step] > max_lateral_accel_mps2:
            return (
                "plan_implausible",
                f"sample {sample}: lateral acceleration {sustained[sample, step]:.1f} m/s^2 held for "
                f"{SUSTAINED_S:.0f} s from t0+{(step + 1) * WAYPOINT_DT_S:.1f} s (max {max_lateral_accel_mps2:.1f} "
                "m/s^2, gates.max_lateral_accel_mps2)",
            )
    return None


def _worst(values: np.ndarray | None, sample: int) -> str:
    return "?" if values is None else f"{float(np.abs(values[sample]).max()):.2f}"
