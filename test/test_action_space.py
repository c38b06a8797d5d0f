"""Unicycle action space on trajectories whose kinematics are known in closed form."""

import dataclasses
import math

import pytest
import torch

from alpamayo_ros.core.action_space import ActionSpaceConfig, UnicycleActionSpace, yaw_to_rot

DT = 0.1
N = 64
# Normalisation constants of the released checkpoint (model_facts.md section 3).
RELEASED = ActionSpaceConfig(
    accel_mean=0.029052734375,
    accel_std=0.6796875,
    curvature_mean=0.0002689361572265625,
    curvature_std=0.026123046875,
)


def arc_poses(speed: float, kappa: float, steps: torch.Tensor, z: float = 0.0):
    """Poses at times steps*DT on a constant-speed arc through the origin heading +x (float64)."""
    t = steps.double() * DT
    heading = kappa * speed * t
    if kappa == 0.0:
        x, y = speed * t, torch.zeros_like(t)
    else:
        x, y = torch.sin(heading) / kappa, (1 - torch.cos(heading)) / kappa
    xyz = torch.stack([x, y, torch.full_like(t, z)], dim=-1)
    return xyz, yaw_to_rot(heading)


def history(speed: float, kappa: float, z: float = 0.0):
    """16 float32 history poses at t0-1.5 s ... t0 on the arc, t0 at the origin."""
    xyz, rot = arc_poses(speed, kappa, torch.arange(-15, 1), z)
    return xyz.float(), rot.float()


def normalised(space, accel, kappa, dtype=torch.float32):
    """Normalised action (..., N, 2) for physical accel (m/s^2) and curvature (1/m)."""
    cfg = space.config
    accel = (accel - cfg.accel_mean) / cfg.accel_std
    kappa = (kappa - cfg.curvature_mean) / cfg.curvature_std
    return torch.stack([accel, kappa], dim=-1).to(dtype)


@pytest.mark.parametrize("speed", [0.0, 2.0, 8.0, 15.0])
def test_v0_of_constant_speed_line(speed):
    space = UnicycleActionSpace(RELEASED)
    xyz, rot = history(speed, 0.0)
    v0 = space.estimate_v0(xyz, rot)
    assert v0.shape == () and v0.dtype == torch.float32
    assert abs(float(v0) - speed) < 1e-3


def test_v0_of_gentle_arc_and_of_batch():
    space = UnicycleActionSpace(RELEASED)
    rows = [history(speed, kappa) for speed, kappa in [(3.0, 0.02), (12.0, -0.01), (6.0, 0.0)]]
    xyz = torch.stack([r[0] for r in rows]).view(3, 1, 16, 3)
    rot = torch.stack([r[1] for r in rows]).view(3, 1, 16, 3, 3)
    v0 = space.estimate_v0(xyz, rot)
    assert v0.shape == (3, 1)
    assert torch.allclose(v0[:, 0], torch.tensor([3.0, 12.0, 6.0]), atol=1e-3, rtol=0)


def test_constant_speed_straight_line():
    space = UnicycleActionSpace(RELEASED)
    hist_xyz, hist_rot = history(10.0, 0.0, z=0.37)
    zeros = torch.zeros(N, dtype=torch.float64)
    xyz, rot = space.action_to_traj(normalised(space, zeros, zeros), hist_xyz, hist_rot)
    v0 = float(space.estimate_v0(hist_xyz, hist_rot))
    expected, _ = arc_poses(v0, 0.0, torch.arange(1, N + 1), z=0.37)
    assert xyz.shape == (N, 3) and rot.shape == (N, 3, 3) and xyz.dtype == torch.float32
    assert (xyz.double() - expected).abs().max() < 1e-4
    assert (rot - torch.eye(3)).abs().max() < 1e-6


@pytest.mark.parametrize("kappa", [0.01, -0.01])
def test_constant_curvature_circle(kappa):
    space = UnicycleActionSpace(RELEASED)
    hist_xyz, hist_rot = history(5.0, kappa)
    v0 = float(space.estimate_v0(hist_xyz, hist_rot))
    accel = torch.zeros(N, dtype=torch.float64)
    xyz, rot = space.action_to_traj(
        normalised(space, accel, torch.full_like(accel, kappa)), hist_xyz, hist_rot
    )
    expected_xyz, expected_rot = arc_poses(v0, kappa, torch.arange(1, N + 1))
    assert (xyz.double() - expected_xyz).abs().max() < 1e-4
    assert (rot.double() - expected_rot).abs().max() < 1e-5


def test_constant_acceleration_from_rest_in_float64():
    space = UnicycleActionSpace(RELEASED)
    hist_xyz, hist_rot = (p.double() for p in history(0.0, 0.0))
    accel = torch.full((N,), 1.5, dtype=torch.float64)
    action = normalised(space, accel, torch.zeros_like(accel), torch.float64)
    xyz, _ = space.action_to_traj(action, hist_xyz, hist_rot)
    t = torch.arange(1, N + 1, dtype=torch.float64) * DT
    assert xyz.dtype == torch.float64
    # Trapezoid integration of a linear speed is exact: x = a t^2 / 2.
    assert (xyz[:, 0] - 0.75 * t**2).abs().max() < 1e-9


def smooth_random_case(generator: torch.Generator, rows: int):
    """Histories on gentle arcs and low-frequency accel/curvature profiles (float64)."""
    speeds = 3.0 + 22.0 * torch.rand(rows, generator=generator, dtype=torch.float64)
    kappas = 0.02 * (torch.rand(rows, generator=generator, dtype=torch.float64) - 0.5)
    hist = [history(float(s), float(k)) for s, k in zip(speeds, kappas)]
    t = torch.arange(N, dtype=torch.float64) * DT
    freqs = torch.tensor([0.03, 0.06, 0.12], dtype=torch.float64)[None, :, None]
    phase = 2 * math.pi * torch.rand(rows, 3, 1, generator=generator, dtype=torch.float64)
    wave = torch.sin(2 * math.pi * freqs * t + phase)  # (rows, 3, N)
    amplitude = torch.rand(2, rows, 3, 1, generator=generator, dtype=torch.float64) - 0.5
    accel = (amplitude[0] * wave).sum(1)  # m/s^2, within +-1.5
    kappa = (0.04 * amplitude[1] * wave).sum(1)  # 1/m, within +-0.06
    hist_xyz = torch.stack([h[0] for h in hist])
    hist_rot = torch.stack([h[1] for h in hist])
    return hist_xyz, hist_rot, accel, kappa


def test_round_trip_on_smooth_random_trajectories():
    # Near-zero ridges isolate the inversion itself: traj -> action -> traj must close.
    space = UnicycleActionSpace(
        dataclasses.replace(RELEASED, v_ridge=1e-8, a_ridge=1e-8, kappa_ridge=1e-8)
    )
    hist_xyz, hist_rot, accel, kappa = smooth_random_case(torch.Generator().manual_seed(0), 32)
    xyz, rot = space.action_to_traj(normalised(space, accel, kappa), hist_xyz, hist_rot)
    action = space.traj_to_action(hist_xyz, hist_rot, xyz, rot)
    assert action.shape == (32, N, 2) and action.dtype == torch.float32
    xyz_again, _ = space.action_to_traj(action, hist_xyz, hist_rot)
    assert (xyz_again - xyz).norm(dim=-1).max() < 1e-3


def test_round_trip_with_released_smoothing_is_close():
    # Upstream's ridges shrink the fitted speed by ~5e-5 relative, so the error grows with
    # speed; this bounds it for speeds up to 25 m/s.
    space = UnicycleActionSpace(RELEASED)
    hist_xyz, hist_rot, accel, kappa = smooth_random_case(torch.Generator().manual_seed(1), 32)
    xyz, rot = space.action_to_traj(normalised(space, accel, kappa), hist_xyz, hist_rot)
    action = space.traj_to_action(hist_xyz, hist_rot, xyz, rot)
    xyz_again, _ = space.action_to_traj(action, hist_xyz, hist_rot)
    assert (xyz_again - xyz).norm(dim=-1).max() < 2e-2


def test_traj_to_action_recovers_known_controls():
    space = UnicycleActionSpace(RELEASED)
    hist_xyz, hist_rot = history(8.0, 0.0)
    accel = torch.full((N,), 0.5, dtype=torch.float64)
    kappa = torch.full((N,), 0.01, dtype=torch.float64)
    xyz, rot = space.action_to_traj(normalised(space, accel, kappa), hist_xyz, hist_rot)
    action = space.traj_to_action(hist_xyz, hist_rot, xyz, rot)
    cfg = space.config
    fitted_accel = action[:, 0] * cfg.accel_std + cfg.accel_mean
    fitted_kappa = action[:, 1] * cfg.curvature_std + cfg.curvature_mean
    # Interior steps; the first and last few carry the smoother's boundary effects.
    assert (fitted_accel[3:-3] - 0.5).abs().max() < 5e-3
    assert (fitted_kappa[3:-3] - 0.01).abs().max() < 1e-4


def test_autocast_does_not_lower_precision():
    space = UnicycleActionSpace(RELEASED)
    hist_xyz, hist_rot = history(10.0, 0.01)
    action = torch.randn(N, 2, generator=torch.Generator().manual_seed(3))
    plain, _ = space.action_to_traj(action, hist_xyz, hist_rot)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, _ = space.action_to_traj(action.bfloat16(), hist_xyz, hist_rot)
    assert autocast.dtype == torch.float32
    # Only the bf16 rounding of the action itself may differ.
    reference, _ = space.action_to_traj(action.bfloat16().float(), hist_xyz, hist_rot)
    assert torch.equal(autocast, reference)
    assert not torch.equal(plain, reference)


def test_is_within_bounds():
    space = UnicycleActionSpace(RELEASED)
    zeros = torch.zeros(2, N, dtype=torch.float64)
    kappa = zeros.clone()
    kappa[1, 10] = 0.25  # above the 0.2 1/m bound
    assert space.is_within_bounds(normalised(space, zeros, kappa)).tolist() == [True, False]


def test_bad_inputs_name_the_argument():
    space = UnicycleActionSpace(RELEASED)
    hist_xyz, hist_rot = history(5.0, 0.0)
    with pytest.raises(ValueError, match="hist_rot"):
        space.estimate_v0(hist_xyz, hist_rot[:-1])
    with pytest.raises(ValueError, match="action"):
        space.action_to_traj(torch.zeros(N - 1, 2), hist_xyz, hist_rot)
    with pytest.raises(ValueError, match="fut_xyz"):
        space.traj_to_action(hist_xyz, hist_rot, torch.zeros(10, 3), torch.zeros(10, 3, 3))
    with pytest.raises(ValueError, match="accel_std"):
        ActionSpaceConfig(accel_std=0.0)
    with pytest.raises(ValueError, match="curvature_bounds"):
        ActionSpaceConfig(curvature_bounds=(0.2, -0.2))


def test_samples_of_one_scene_share_its_history():
    """Rows of one plan pass the history once (leading dim 1): each row's trajectory equals
    the one integrated from its own copy of the history."""
    space = UnicycleActionSpace(RELEASED)
    hist_xyz, hist_rot = history(7.0, 0.005)
    g = torch.Generator().manual_seed(0)
    actions = torch.randn(5, N, 2, generator=g) * 0.3
    xyz, rot = space.action_to_traj(actions, hist_xyz[None], hist_rot[None])
    assert xyz.shape == (5, N, 3) and rot.shape == (5, N, 3, 3)
    for row in range(5):
        one_xyz, one_rot = space.action_to_traj(actions[row], hist_xyz, hist_rot)
        assert torch.equal(xyz[row], one_xyz) and torch.equal(rot[row], one_rot)
    with pytest.raises(ValueError, match="action"):  # two histories cannot serve five rows
        space.action_to_traj(actions, hist_xyz.expand(2, -1, -1), hist_rot.expand(2, -1, -1, -1))
