"""Euler flow-matching sampler: seeding, injected noise, guidance and the update rule; the
fast ExpertSampler against the reference sampler over ActionExpertModel.velocity."""

import pytest
import torch

from alpamayo_ros.core.backbone import PrefixCache
from alpamayo_ros.core.expert import ActionExpertModel, ExpertConfig
from alpamayo_ros.core.flow_matching import ExpertSampler, sample

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


# --- ExpertSampler: the fast loop must give the reference sampler's numbers ----------------

KV_HEADS, HEAD_DIM, LAYERS = 2, 16, 2


def well_conditioned_expert() -> ActionExpertModel:
    """A tiny random expert whose 10-step flow is not chaotic.

    With untrained weights and Fourier frequencies up to 100 per unit, one Euler step
    amplifies a 1e-7 change in x by ~400x, so float rounding alone moves a 10-step result by
    0.2 and multi-step parity could not be asserted. max_freq=1 keeps the gain near 20; the
    single-call parity of the fast path at release-like frequencies is in test_expert.py.
    """
    torch.manual_seed(0)
    config = ExpertConfig(
        hidden_size=64, intermediate_size=96, num_layers=LAYERS, num_heads=4,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=10_000.0, mrope_section=(2, 3, 3),
        action_hidden_size=32, max_freq=1.0,
    )
    return ActionExpertModel(config).eval()


def cache_of(rows: int, length: int, offsets: list[int], seed: int, valid=None) -> PrefixCache:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, KV_HEADS, length, HEAD_DIM)
    return PrefixCache(
        keys=[torch.randn(shape, generator=g) for _ in range(LAYERS)],
        values=[torch.randn(shape, generator=g) for _ in range(LAYERS)],
        offsets=torch.tensor(offsets), rope_deltas=torch.arange(rows) - 4, valid=valid,
    )


def reference(expert, cache, noise, uncond_cache=None, weight=1.0, temperature=1.0, steps=10):
    with torch.no_grad():
        return sample(
            lambda x, t: expert.velocity(x, t, cache), batch=noise.shape[0], init_noise=noise,
            steps=steps,
            uncond_velocity_fn=(
                None if uncond_cache is None else lambda x, t: expert.velocity(x, t, uncond_cache)
            ),
            guidance_weight=weight, noise_temperature=temperature,
        )


@pytest.mark.parametrize("bucket", [1, 32])
def test_expert_sampler_matches_reference_across_plans_of_several_lengths(bucket):
    # On CPU the sampler runs its states eagerly (the CUDA-graph replay of the same states is
    # measured on the GPU by bench/expert_loop_bench.py, not here). Plans of different
    # lengths and row counts reuse states, so stale columns from earlier plans are exercised.
    expert = well_conditioned_expert()
    sampler = ExpertSampler(expert, bucket=bucket, cuda_graphs=True)
    assert not sampler.uses_cuda_graphs
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[2, :6] = False
    plans = [
        cache_of(1, 40, [40], seed=1),
        cache_of(3, 40, [40, 33, 25], seed=2, valid=valid),
        cache_of(1, 23, [23], seed=3),
        cache_of(3, 31, [31, 31, 20], seed=4),
        cache_of(1, 40, [40], seed=5),
    ]
    for i, cache in enumerate(plans):
        noise = torch.randn(cache.keys[0].shape[0], 64, 2, generator=seeded(i))
        got = sampler.sample(cache, steps=5, init_noise=noise, noise_temperature=0.8)
        expected = reference(expert, cache, noise, temperature=0.8, steps=5)
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert (got - expected).abs().max() < 1e-5, i
        assert (expected - noise * 0.8).abs().max() > 0.1  # the velocity really matters
    assert sampler.capacity_for(40) == (40 + 64 if bucket == 1 else 128)


@pytest.mark.parametrize("rows", [1, 3])
def test_guided_expert_sampler_matches_reference(rows):
    expert = well_conditioned_expert()
    sampler = ExpertSampler(expert, bucket=16)
    offsets = [36, 30, 28][:rows]
    cache = cache_of(rows, 36, offsets, seed=1)
    route_free = cache_of(rows, 29, [o - 7 for o in offsets], seed=2)  # route span removed
    noise = torch.randn(rows, 64, 2, generator=seeded(3))
    got = sampler.sample(cache, init_noise=noise, uncond_cache=route_free, guidance_weight=1.5)
    expected = reference(expert, cache, noise, uncond_cache=route_free, weight=1.5)
    unguided = reference(expert, cache, noise)
    assert (got - expected).abs().max() < 1e-5
    assert (unguided - expected).abs().max() > 1e-3


def test_expert_sampler_draws_the_reference_noise_from_the_generator():
    expert = well_conditioned_expert()
    cache = cache_of(2, 20, [20, 18], seed=1)
    got = ExpertSampler(expert).sample(cache, steps=3, generator=seeded(9))
    with torch.no_grad():
        expected = sample(
            lambda x, t: expert.velocity(x, t, cache), batch=2, steps=3, generator=seeded(9)
        )
    assert (got - expected).abs().max() < 1e-5


def test_expert_sampler_bad_arguments_are_named():
    expert = well_conditioned_expert()
    cache = cache_of(2, 20, [20, 18], seed=1)
    sampler = ExpertSampler(expert)
    with pytest.raises(ValueError, match="bucket"):
        ExpertSampler(expert, bucket=0)
    with pytest.raises(ValueError, match="max_shapes"):
        ExpertSampler(expert, max_shapes=0)
    with pytest.raises(ValueError, match="guidance_weight"):
        sampler.sample(cache, generator=seeded(0), guidance_weight=2.0)
    with pytest.raises(ValueError, match="uncond_cache: 1 rows"):
        sampler.sample(cache, generator=seeded(0), uncond_cache=cache_of(1, 20, [20], seed=2))
    with pytest.raises(ValueError, match="steps"):
        sampler.sample(cache, generator=seeded(0), steps=0)
    with pytest.raises(ValueError, match="generator"):
        sampler.sample(cache)


def test_expert_sampler_keeps_only_the_most_recent_shapes():
    """A node sees ever-new prompt lengths: states must not pile up (bounded memory)."""
    expert = well_conditioned_expert()
    sampler = ExpertSampler(expert, bucket=1, max_shapes=2)
    lengths = [20, 21, 22, 21, 23]
    for length in lengths:
        cache = cache_of(1, length, [length], seed=length)
        noise = torch.randn(1, 64, 2, generator=seeded(length))
        got = sampler.sample(cache, steps=2, init_noise=noise)
        assert (got - reference(expert, cache, noise, steps=2)).abs().max() < 1e-5
    kept = sorted(key[0] - 64 for key in sampler._runners)
    assert kept == [21, 23]  # 22 was the least recently used when 23 arrived


def test_sampler_equals_the_reference_bit_for_bit_in_a_chaotic_flow():
    """At release-like Fourier frequencies a 1e-7 rounding grows to ~0.3 over 10 steps, so the
    paged state must give the reference's numbers exactly: same keys, same order, same kernel."""
    torch.manual_seed(0)
    config = ExpertConfig(
        hidden_size=64, intermediate_size=96, num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, mrope_section=(2, 3, 3), action_hidden_size=32,
    )
    expert = ActionExpertModel(config).eval()
    rows = 3
    cache = cache_of(rows, 40, [40] * rows, seed=7)
    noise = torch.randn(rows, 64, 2, generator=seeded(8))
    got = ExpertSampler(expert, bucket=1).sample(cache, init_noise=noise)
    assert torch.equal(got, reference(expert, cache, noise))
