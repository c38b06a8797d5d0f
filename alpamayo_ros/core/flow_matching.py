"""Flow-matching sampler: Euler-integrate the expert's velocity field from noise to an action.

Upstream's convention: t = 0 is noise, t = 1 is data, and the model predicts the velocity
x_data - noise. The noise comes from an explicit torch.Generator (never the global RNG), so a
seed fully determines a plan and parallel pipelines cannot disturb each other's streams.
"""

from __future__ import annotations

from typing import Callable

import torch

from alpamayo_ros.core.types import NUM_WAYPOINTS

#: velocity_fn(x (N, 64, 2), t (N,)) -> velocity (N, 64, 2)
VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

ACTION_SHAPE = (NUM_WAYPOINTS, 2)  # (waypoints, [normalised accel, normalised curvature])


def sample(
    velocity_fn: VelocityFn,
    *,
    batch: int,
    steps: int = 10,
    noise_temperature: float = 1.0,
    generator: torch.Generator | None = None,
    init_noise: torch.Tensor | None = None,
    uncond_velocity_fn: VelocityFn | None = None,
    guidance_weight: float = 1.0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Draw `batch` normalised actions (batch, 64, 2) by `steps` Euler steps.

    x0 = noise * noise_temperature, where noise is randn from `generator` or, if given,
    init_noise (batch, 64, 2) (a standard-normal draw; still scaled by the temperature).
    With uncond_velocity_fn, the velocity is classifier-free guided:
    v = (1 - w) * v_uncond + w * v_cond, w = guidance_weight (w = 1: conditional only).
    The loop has no host syncs, so a caller can capture it in one CUDA graph.
    """
    if batch < 1:
        raise ValueError(f"batch: must be >= 1, got {batch}")
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    if not noise_temperature >= 0:
        raise ValueError(f"noise_temperature: must be >= 0, got {noise_temperature}")
    if uncond_velocity_fn is None and guidance_weight != 1.0:
        raise ValueError(
            f"guidance_weight: {guidance_weight} needs uncond_velocity_fn (only 1.0 works without)"
        )
    if init_noise is None:
        if generator is None:
            raise ValueError("generator: required when init_noise is not given")
        # Drawn on the generator's device, so a CPU generator gives the same noise for CPU
        # and GPU runs.
        shape = (batch, *ACTION_SHAPE)
        noise = torch.randn(shape, generator=generator, device=generator.device, dtype=dtype)
    else:
        if tuple(init_noise.shape) != (batch, *ACTION_SHAPE):
            expected = (batch, *ACTION_SHAPE)
            raise ValueError(f"init_noise: expected {expected}, got {tuple(init_noise.shape)}")
        noise = init_noise
    x = noise.to(device=device, dtype=dtype) * noise_temperature
    times = torch.linspace(0.0, 1.0, steps + 1, device=device, dtype=dtype)
    for i in range(steps):
        t = times[i].expand(batch)
        # (1, 1, 1), not 0-dim: a 0-dim fp32 step times a bf16 velocity would stay bf16, while
        # upstream's (batch, 1, 1) step promotes the update to fp32.
        step = (times[i + 1] - times[i]).view(1, 1, 1)
        velocity = velocity_fn(x, t)
        if uncond_velocity_fn is not None:
            unguided = uncond_velocity_fn(x, t)
            velocity = (1 - guidance_weight) * unguided + guidance_weight * velocity
        x = x + step * velocity
    return x
