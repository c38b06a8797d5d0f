"""Euler flow-matching sampler: seeding, injected noise, guidance and the update rule."""

import pytest
import torch

from alpamayo_ros.core.flow_matching import sample

SHAPE = (64, 2)


def pull_towards(target: torch.Tensor):
    """A velocity field that depends on x and t, so every step matters."""

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (target - x) * (1.0 + t[:, None, None])

    return velocity


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_same_seed_same_result_and_different_seeds_differ():
    velocity = pull_towards(torch.ones(SHAPE))
    first = sample(velocity, batch=3, generator=seeded(7))
    again = sample(velocity, batch=3, generator=seeded(7))
    other = sample(velocity, batch=3, generator=seeded(8))
    assert first.shape == (3, *SHAPE) and first.dtype == torch.float32
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    assert not torch.allclose(first[0], first[1])  # rows get independent noise


def test_global_rng_is_untouched():
    before = torch.get_rng_state()
    sample(pull_towards(torch.zeros(SHAPE)), batch=2, generator=seeded(0))
    assert torch.equal(torch.get_rng_state(), before)


def test_injected_noise_is_bit_identical_and_equals_the_generator_draw():
    velocity = pull_towards(torch.full(SHAPE, -0.5))
    noise = torch.randn(2, *SHAPE, generator=seeded(3))
    first = sample(velocity, batch=2, init_noise=noise, noise_temperature=0.6)
    second = sample(velocity, batch=2, init_noise=noise.clone(), noise_temperature=0.6)
    drawn = sample(velocity, batch=2, generator=seeded(3), noise_temperature=0.6)
    assert torch.equal(first, second)
    assert torch.equal(first, drawn)


def test_euler_update_rule_and_time_grid():
    seen_times = []

    def grow(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        seen_times.append(t.clone())
        return x

    noise = torch.randn(2, *SHAPE, generator=seeded(1))
    x = sample(grow, batch=2, steps=4, init_noise=noise)
    # dx/dt = x with Euler steps of 1/4: x1 = x0 * (1 + 1/4)^4.
    assert torch.allclose(x, noise * 1.25**4, rtol=1e-6, atol=0)
    assert [t.shape for t in seen_times] == [(2,)] * 4
    assert torch.allclose(torch.stack(seen_times)[:, 0], torch.tensor([0.0, 0.25, 0.5, 0.75]))


def test_temperature_scales_the_initial_noise():
    noise = torch.randn(1, *SHAPE, generator=seeded(2))
    still = lambda x, t: torch.zeros_like(x)  # noqa: E731
    half = sample(still, batch=1, init_noise=noise, noise_temperature=0.5)
    zero = sample(still, batch=1, init_noise=noise, noise_temperature=0.0)
    assert torch.equal(half, noise * 0.5)
    assert torch.equal(zero, torch.zeros_like(noise))


def test_guidance_weight_one_equals_unguided():
    conditional = pull_towards(torch.ones(SHAPE))
    unconditional = pull_towards(-torch.ones(SHAPE))
    plain = sample(conditional, batch=2, generator=seeded(5))
    guided = sample(
        conditional, batch=2, generator=seeded(5), uncond_velocity_fn=unconditional,
        guidance_weight=1.0,
    )
    assert torch.equal(plain, guided)


def test_guidance_mixes_velocities():
    cond = lambda x, t: torch.full_like(x, 2.0)  # noqa: E731
    uncond = lambda x, t: torch.full_like(x, -1.0)  # noqa: E731
    noise = torch.randn(1, *SHAPE, generator=seeded(4))
    x = sample(cond, batch=1, init_noise=noise, uncond_velocity_fn=uncond, guidance_weight=1.5)
    # v = (1 - 1.5) * (-1) + 1.5 * 2 = 3.5, integrated over t in [0, 1].
    assert torch.allclose(x, noise + 3.5, atol=1e-5, rtol=0)


def test_low_precision_velocity_keeps_the_state_in_float32():
    bf16 = lambda x, t: torch.full_like(x, 0.1, dtype=torch.bfloat16)  # noqa: E731
    x = sample(bf16, batch=1, steps=10, init_noise=torch.zeros(1, *SHAPE))
    assert x.dtype == torch.float32
    assert torch.allclose(x, torch.full_like(x, float(torch.tensor(0.1).bfloat16())), atol=1e-6)


def test_bad_arguments_are_named():
    velocity = pull_towards(torch.zeros(SHAPE))
    with pytest.raises(ValueError, match="generator"):
        sample(velocity, batch=1)
    with pytest.raises(ValueError, match="guidance_weight"):
        sample(velocity, batch=1, generator=seeded(0), guidance_weight=2.0)
    with pytest.raises(ValueError, match="init_noise"):
        sample(velocity, batch=2, init_noise=torch.zeros(1, *SHAPE))
    with pytest.raises(ValueError, match="steps"):
        sample(velocity, batch=1, generator=seeded(0), steps=0)
    with pytest.raises(ValueError, match="noise_temperature"):
        sample(velocity, batch=1, generator=seeded(0), noise_temperature=-1.0)
