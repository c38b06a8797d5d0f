"""Unicycle action space: normalised (acceleration, curvature) <-> 64-waypoint trajectory.

The expert denoises a (64, 2) action; this module turns it into poses in the t0 ego frame
with upstream's kinematics (trapezoid integration), and does the inverse by upstream's
regularised least squares. Everything runs in float32 (float64 if the inputs are) with
autocast off, because the normal equations are too ill-conditioned for bf16.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_MAX_RIDGE_RETRIES = 8  # each retry multiplies the ridge by 10 (upstream's singularity fallback)


@dataclass(frozen=True)
class ActionSpaceConfig:
    """Constants of the action space; defaults are upstream's class defaults.

    The released checkpoint sets the normalisation constants in config.json
    (action_space_cfg). The smoother weights only matter for traj_to_action, except
    v_lambda / v_ridge, which also drive the t0 speed estimate used at inference.
    """

    accel_mean: float = 0.0  # m/s^2
    accel_std: float = 1.0  # m/s^2
    curvature_mean: float = 0.0  # 1/m
    curvature_std: float = 1.0  # 1/m
    accel_bounds: tuple[float, float] = (-9.8, 9.8)  # m/s^2, only for is_within_bounds
    curvature_bounds: tuple[float, float] = (-0.2, 0.2)  # 1/m, only for is_within_bounds
    dt: float = 0.1  # s between waypoints (and between history poses)
    n_waypoints: int = 64
    theta_lambda: float = 1e-6  # 3rd-order smoothness weight of the heading fit
    theta_ridge: float = 1e-8
    v_lambda: float = 1e-6  # 3rd-order smoothness weight of the speed fit
    v_ridge: float = 1e-4
    a_lambda: float = 1e-4  # 2nd-order smoothness weight of the acceleration fit
    a_ridge: float = 1e-4
    kappa_lambda: float = 1e-4  # 2nd-order smoothness weight of the curvature fit
    kappa_ridge: float = 1e-4

    def __post_init__(self) -> None:
        if not self.dt > 0:
            raise ValueError(f"dt: must be > 0 s, got {self.dt}")
        if self.n_waypoints < 1:
            raise ValueError(f"n_waypoints: must be >= 1, got {self.n_waypoints}")
        for name in ("accel_std", "curvature_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("theta", "v", "a", "kappa"):
            for kind in ("lambda", "ridge"):
                value = getattr(self, f"{name}_{kind}")
                if not value >= 0:
                    raise ValueError(f"{name}_{kind}: must be >= 0, got {value}")
        for name in ("accel_bounds", "curvature_bounds"):
            low, high = getattr(self, name)
            if not low < high:
                raise ValueError(f"{name}: expected (min, max) with min < max, got {(low, high)}")


def yaw_of(rot: torch.Tensor) -> torch.Tensor:
    """Return the heading (rad) of rotation matrices (..., 3, 3), read as upstream does."""
    return torch.atan2(rot[..., 1, 0], rot[..., 0, 0])


def unwrap_angle(angle: torch.Tensor) -> torch.Tensor:
    """Unwrap the last dim so consecutive steps lie in (-pi, pi], keeping the first value."""
    step = torch.diff(angle, dim=-1)
    step = torch.atan2(torch.sin(step), torch.cos(step))
    return torch.cat([angle[..., :1], angle[..., :1] + torch.cumsum(step, dim=-1)], dim=-1)


def yaw_to_rot(yaw: torch.Tensor) -> torch.Tensor:
    """Embed headings (...) as z-axis rotations (..., 3, 3)."""
    cos, sin = torch.cos(yaw), torch.sin(yaw)
    zero, one = torch.zeros_like(yaw), torch.ones_like(yaw)
    rows = [[cos, -sin, zero], [sin, cos, zero], [zero, zero, one]]
    return torch.stack([torch.stack(row, dim=-1) for row in rows], dim=-2)


def smoothness_gram(
    n: int, order: int, lam: float, dt: float, *, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Return (lam / dt^(2*order)) * D^T D (n, n), penalising the order-th time derivative.

    D is the (n - order, n) finite-difference operator, order 2 or 3.
    """
    stencils = {2: (-1.0, 2.0, -1.0), 3: (-1.0, 3.0, -3.0, 1.0)}
    if order not in stencils:
        raise ValueError(f"order: expected 2 or 3, got {order}")
    rows = max(n - order, 0)
    diff = torch.zeros(rows, n, dtype=dtype, device=device)
    index = torch.arange(rows, device=device)
    for shift, coefficient in enumerate(stencils[order]):
        diff[index, index + shift] = coefficient
    return (lam / dt ** (2 * order)) * (diff.transpose(0, 1) @ diff)


def solve_spd(lhs: torch.Tensor, rhs: torch.Tensor, ridge: float, name: str) -> torch.Tensor:
    """Solve (lhs + ridge*I) x = rhs for a batch of SPD systems by Cholesky.

    Like upstream, a singular system (e.g. the curvature of a standing vehicle) is retried
    with a 10x larger ridge instead of failing.
    """
    eye = torch.eye(lhs.shape[-1], dtype=lhs.dtype, device=lhs.device)
    for _ in range(_MAX_RIDGE_RETRIES):
        factor, info = torch.linalg.cholesky_ex(lhs + ridge * eye)
        if not bool(info.any()):
            return torch.cholesky_solve(rhs.unsqueeze(-1), factor).squeeze(-1)
        ridge *= 10.0
        logger.warning(f"{name} fit is singular; retrying with ridge {ridge:g}")
    raise ValueError(f"{name}: least-squares system is still singular at ridge {ridge:g}")


class UnicycleActionSpace:
    """Unicycle kinematics driven by acceleration and curvature, as in upstream Alpamayo.

    Poses are in the t0 ego frame (x forward, y left, z up, metres); the last history pose
    is the origin with identity rotation. Actions are normalised with the config's mean and
    std. Every method accepts any leading batch dims.
    """

    def __init__(self, config: ActionSpaceConfig) -> None:
        self.config = config

    def estimate_v0(self, hist_xyz: torch.Tensor, hist_rot: torch.Tensor) -> torch.Tensor:
        """Estimate the speed at t0 (m/s, shape (...)) from history poses.

        hist_xyz (..., T, 3), hist_rot (..., T, 3, 3), dt apart. Least squares on the
        trapezoid relation v_t u_t + v_{t+1} u_{t+1} = 2 dp_t / dt (u = heading unit vector)
        with a 3rd-order smoothness penalty; returns the last of the T fitted speeds.
        """
        _check_poses("hist", hist_xyz, hist_rot)
        with torch.autocast(hist_xyz.device.type, enabled=False):
            xy = hist_xyz[..., :2].to(_working_dtype(hist_xyz))
            heading = unwrap_angle(yaw_of(hist_rot.to(xy.dtype)))
            speed = self._fit_speed(xy[..., 1:, :] - xy[..., :-1, :], heading, v0=None)
        return speed[..., -1]

    def action_to_traj(
        self, action: torch.Tensor, hist_xyz: torch.Tensor, hist_rot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Integrate a normalised action (..., 64, 2) into future poses.

        Returns xyz (..., 64, 3) and yaw rotations (..., 64, 3, 3) at t0+dt ... t0+64*dt in
        the t0 ego frame; z is held at the last history z. The history's leading dims may
        broadcast to the action's (samples of one scene: its speed is fitted once).
        """
        cfg = self.config
        _check_poses("hist", hist_xyz, hist_rot)
        batch = tuple(hist_xyz.shape[:-2])
        leading = tuple(action.shape[:-2])
        try:
            fits = tuple(torch.broadcast_shapes(batch, leading)) == leading
        except RuntimeError:
            fits = False
        if tuple(action.shape[-2:]) != (cfg.n_waypoints, 2) or not fits:
            raise ValueError(
                f"action: expected {batch} (or dims it broadcasts to) + ({cfg.n_waypoints}, 2),"
                f" got {tuple(action.shape)}"
            )
        v0 = self.estimate_v0(hist_xyz, hist_rot).expand(leading)
        dt = cfg.dt
        with torch.autocast(hist_xyz.device.type, enabled=False):
            action = action.to(v0.dtype)
            accel, kappa = self.denormalize(action)
            v0 = v0.unsqueeze(-1)
            speed = torch.cat([v0, v0 + torch.cumsum(accel * dt, dim=-1)], dim=-1)  # (..., N+1)
            # Heading change of one step at constant a and kappa: kappa * (v dt + a dt^2 / 2).
            turn = torch.cumsum(kappa * speed[..., :-1] * dt, dim=-1)
            turn = turn + torch.cumsum(kappa * accel * (0.5 * dt**2), dim=-1)
            heading = torch.cat([torch.zeros_like(v0), turn], dim=-1)  # (..., N+1)
            x = _trapezoid(speed * torch.cos(heading), dt)
            y = _trapezoid(speed * torch.sin(heading), dt)
            z = hist_xyz[..., -1:, 2].to(x.dtype).expand_as(x)
            xyz = torch.stack([x, y, z], dim=-1)
            rot = yaw_to_rot(heading[..., 1:])
        return xyz, rot

    def traj_to_action(
        self,
        hist_xyz: torch.Tensor,
        hist_rot: torch.Tensor,
        fut_xyz: torch.Tensor,
        fut_rot: torch.Tensor,
    ) -> torch.Tensor:
        """Fit the normalised action (..., 64, 2) that reproduces a future trajectory.

        Assumes the last history pose is the origin. Heading, speed, acceleration and
        curvature are fitted in turn by regularised least squares, as upstream does.
        """
        cfg = self.config
        _check_poses("hist", hist_xyz, hist_rot)
        _check_poses("fut", fut_xyz, fut_rot)
        if fut_xyz.shape != hist_xyz.shape[:-2] + (cfg.n_waypoints, 3):
            expected = tuple(hist_xyz.shape[:-2]) + (cfg.n_waypoints, 3)
            raise ValueError(f"fut_xyz: expected {expected}, got {tuple(fut_xyz.shape)}")
        v0 = self.estimate_v0(hist_xyz, hist_rot)
        dt = cfg.dt
        with torch.autocast(hist_xyz.device.type, enabled=False):
            xy = torch.cat([hist_xyz[..., -1:, :2], fut_xyz[..., :2]], dim=-2).to(v0.dtype)
            heading = self._fit_heading(fut_rot.to(v0.dtype))  # (..., N+1)
            speed = self._fit_speed(xy[..., 1:, :] - xy[..., :-1, :], heading, v0=v0)
            dv = torch.diff(speed, dim=-1) / dt
            accel = self._fit_slope(torch.ones_like(dv), dv, cfg.a_lambda, cfg.a_ridge, "accel")
            arc = dt * speed[..., :-1] + (dt**2) / 2.0 * accel  # distance travelled per step
            dtheta = torch.diff(heading, dim=-1)
            kappa = self._fit_slope(arc, dtheta, cfg.kappa_lambda, cfg.kappa_ridge, "curvature")
            accel = (accel - cfg.accel_mean) / cfg.accel_std
            kappa = (kappa - cfg.curvature_mean) / cfg.curvature_std
        return torch.stack([accel, kappa], dim=-1)

    def denormalize(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Acceleration (m/s^2) and curvature (1/m), each (..., 64), of a normalised (..., 64, 2) action."""
        cfg = self.config
        return action[..., 0] * cfg.accel_std + cfg.accel_mean, action[..., 1] * cfg.curvature_std + cfg.curvature_mean

    def is_within_bounds(self, action: torch.Tensor) -> torch.Tensor:
        """Return (...) bool: every de-normalised step of a (..., 64, 2) action is in bounds."""
        cfg = self.config
        accel, kappa = self.denormalize(action)
        ok = (accel >= cfg.accel_bounds[0]) & (accel <= cfg.accel_bounds[1])
        ok &= (kappa >= cfg.curvature_bounds[0]) & (kappa <= cfg.curvature_bounds[1])
        return ok.all(dim=-1)

    def _fit_speed(
        self, dxy: torch.Tensor, heading: torch.Tensor, v0: torch.Tensor | None
    ) -> torch.Tensor:
        """Fit speeds (..., N+1) to displacements dxy (..., N, 2) and headings (..., N+1).

        With v0 given, the first speed is pinned to it and only the other N are solved for.
        """
        cfg = self.config
        *lead, n, _ = dxy.shape
        dtype, device = dxy.dtype, dxy.device
        target = (2.0 / cfg.dt * dxy).flatten(-2)  # (..., 2N): gx0, gy0, gx1, ...
        cos, sin = torch.cos(heading), torch.sin(heading)
        design = torch.zeros(*lead, 2 * n, n + 1, dtype=dtype, device=device)  # (..., 2N, N+1)
        rows, cols = 2 * torch.arange(n, device=device), torch.arange(n, device=device)
        design[..., rows, cols] = cos[..., :-1]
        design[..., rows, cols + 1] = cos[..., 1:]
        design[..., rows + 1, cols] = sin[..., :-1]
        design[..., rows + 1, cols + 1] = sin[..., 1:]
        gram = design.transpose(-1, -2) @ design  # (..., N+1, N+1)
        smooth = smoothness_gram(n + 1, 3, cfg.v_lambda, cfg.dt, dtype=dtype, device=device)
        if v0 is None:
            rhs = (design.transpose(-1, -2) @ target.unsqueeze(-1)).squeeze(-1)
            return solve_spd(gram + smooth, rhs, cfg.v_ridge, "speed")
        # Move the pinned v0 column to the right-hand side.
        rhs = (design[..., 1:].transpose(-1, -2) @ target.unsqueeze(-1)).squeeze(-1)
        rhs = rhs - gram[..., 1:, 0] * v0.unsqueeze(-1)
        rhs = rhs - smooth[1:, 0] * v0.unsqueeze(-1)
        rest = solve_spd(gram[..., 1:, 1:] + smooth[1:, 1:], rhs, cfg.v_ridge, "speed")
        return torch.cat([v0.unsqueeze(-1), rest], dim=-1)

    def _fit_heading(self, fut_rot: torch.Tensor) -> torch.Tensor:
        """Smooth future headings (..., N) into (..., N+1) with heading 0 pinned at t0."""
        cfg = self.config
        target = unwrap_angle(yaw_of(fut_rot))
        n = target.shape[-1]
        dtype, device = target.dtype, target.device
        smooth = smoothness_gram(n + 1, 3, cfg.theta_lambda, cfg.dt, dtype=dtype, device=device)
        eye = torch.eye(n, dtype=dtype, device=device)
        # The pinned start value is 0, so it adds nothing to the right-hand side.
        fitted = solve_spd(eye + smooth[1:, 1:], target, cfg.theta_ridge, "heading")
        return torch.cat([torch.zeros_like(fitted[..., :1]), fitted], dim=-1)

    def _fit_slope(
        self, slope: torch.Tensor, value: torch.Tensor, lam: float, ridge: float, name: str
    ) -> torch.Tensor:
        """Solve min_x sum (x_i s_i - y_i)^2 + lam/dt^4 |D2 x|^2 + ridge |x|^2 (last dim)."""
        n = value.shape[-1]
        smooth = smoothness_gram(
            n, 2, lam, self.config.dt, dtype=value.dtype, device=value.device
        )
        return solve_spd(torch.diag_embed(slope * slope) + smooth, slope * value, ridge, name)


def _working_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def _check_poses(name: str, xyz: torch.Tensor, rot: torch.Tensor) -> None:
    if xyz.ndim < 2 or xyz.shape[-1] != 3 or xyz.shape[-2] < 2:
        raise ValueError(f"{name}_xyz: expected (..., T>=2, 3), got {tuple(xyz.shape)}")
    if rot.shape != xyz.shape + (3,):
        expected = tuple(xyz.shape) + (3,)
        raise ValueError(f"{name}_rot: expected {expected}, got {tuple(rot.shape)}")


def _trapezoid(rate: torch.Tensor, dt: float) -> torch.Tensor:
    """Integrate rates (..., N+1) sampled dt apart into N positions after the start (at 0)."""
    half_dt = 0.5 * dt
    return torch.cumsum(rate[..., :-1] * half_dt, dim=-1) + torch.cumsum(
        rate[..., 1:] * half_dt, dim=-1
    )
