"""The expert over K/V a paged engine holds (PrefixCache.paged), read in place through block
tables: the same plans as the reference over the copied-out cache.

The blocks here are laid out as vLLM's caches lay them out (only the last dim contiguous, K
and V interleaved per block, or K stored transposed per block as on vLLM's CPU backend), at
shuffled block ids, with the samples of one prompt pointing at the prompt's full blocks and
each holding its own copy of the prompt's partial last block. Every slot no row may read
holds NaN, so a read past a row's length would show. The real vLLM caches are covered by
test_vllm_backend.py.
"""

import pytest
import torch

from alpamayo_ros.core.backbone import PagedPrefix, PrefixCache
from alpamayo_ros.core.expert import ActionExpertModel, ExpertConfig
from alpamayo_ros.core.expert_state import BlockTableState
from alpamayo_ros.core.flow_matching import ExpertSampler, sample

KV_HEADS, HEAD_DIM, LAYERS = 2, 16, 2


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def expert_of(max_freq: float) -> ActionExpertModel:
    """max_freq 1: a flow that is not chaotic (see test_flow_matching.well_conditioned_expert);
    upstream's 100: rounding grows ~400x a step, so only bit-exact paths agree."""
    torch.manual_seed(0)
    config = ExpertConfig(
        hidden_size=64, intermediate_size=96, num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, rope_theta=10_000.0, mrope_section=(2, 3, 3), action_hidden_size=32,
        max_freq=max_freq,
    )
    return ActionExpertModel(config).eval()


class BlockPool:
    """Per-layer paged K/V storage in one of vLLM's layouts, NaN wherever nothing was written."""

    def __init__(self, num_blocks: int, block_size: int, layout: str) -> None:
        self.block_size = block_size
        self.keys, self.values = [], []
        for _ in range(LAYERS):
            if layout == "packed":  # (blocks, H, bs, 2D), K in [..., :D]
                storage = torch.full((num_blocks, KV_HEADS, block_size, 2 * HEAD_DIM), float("nan"))
                tokens = storage.transpose(1, 2)
                k, v = tokens[..., :HEAD_DIM], tokens[..., HEAD_DIM:]
            else:  # per (block, head): K as [D, bs], then V as [bs, D]
                storage = torch.full((num_blocks, KV_HEADS, 2 * block_size * HEAD_DIM), float("nan"))
                k = storage[..., : block_size * HEAD_DIM].unflatten(-1, (HEAD_DIM, block_size)).permute(0, 3, 1, 2)
                v = storage[..., block_size * HEAD_DIM :].unflatten(-1, (block_size, HEAD_DIM)).transpose(1, 2)
            self.keys.append(k)
            self.values.append(v)
        self.free = torch.randperm(num_blocks, generator=seeded(num_blocks)).tolist()

    def write(self, blocks: list[int], start: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Columns k, v (T, H, D) at positions start.. of the row whose blocks these are."""
        for offset in range(k.shape[0]):
            block, slot = divmod(start + offset, self.block_size)
            self.keys[layer][blocks[block], slot] = k[offset]
            self.values[layer][blocks[block], slot] = v[offset]


def paged_cache_of(
    pool: BlockPool, prompt: int, own: list[int], offsets: list[int], seed: int, released: list[int] | None = None
) -> tuple[PrefixCache, PrefixCache]:
    """Rows sharing a `prompt`-column prefix plus `own` columns each: the paged cache, and the
    same K/V as a plain cache (zero padded, valid marking each row's columns)."""
    g = seeded(seed)
    bs = pool.block_size
    lengths = [prompt + n for n in own]
    width = max(lengths)

    def columns(n: int) -> torch.Tensor:
        return torch.randn(LAYERS, n, KV_HEADS, HEAD_DIM, generator=g)

    prompt_k, prompt_v = columns(prompt), columns(prompt)
    shared = [pool.free.pop() for _ in range(prompt // bs)]
    keys = torch.zeros(LAYERS, len(own), KV_HEADS, width, HEAD_DIM)
    values = torch.zeros_like(keys)
    tables = []
    for row, (n, length) in enumerate(zip(own, lengths)):
        blocks = shared + [pool.free.pop() for _ in range(-(-length // bs) - len(shared))]
        k = torch.cat([prompt_k, columns(n)], dim=1)  # (layers, length, H, D)
        v = torch.cat([prompt_v, columns(n)], dim=1)
        for layer in range(LAYERS):
            start = len(shared) * bs  # the shared blocks hold the prompt's full blocks once
            pool.write(blocks, start, layer, k[layer, start:], v[layer, start:])
            if row == 0:
                pool.write(blocks, 0, layer, k[layer, :start], v[layer, :start])
        keys[:, row, :, :length] = k.transpose(1, 2)
        values[:, row, :, :length] = v.transpose(1, 2)
        tables.append(blocks)
    table = torch.tensor([t + [pool.free[0]] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    valid = None if len(set(lengths)) == 1 else torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    common = dict(offsets=torch.tensor(offsets), rope_deltas=torch.arange(len(own)) - 4, valid=valid)
    release = (lambda: released.append(seed)) if released is not None else (lambda: None)
    paged = PagedPrefix(pool.keys, pool.values, table, lengths, release)
    plain = PrefixCache(keys=list(keys), values=list(values), **common)
    return PrefixCache(keys=[], values=[], paged=paged, **common), plain


def reference(expert, cache, noise, uncond_cache=None, weight=1.0, steps=10):
    with torch.no_grad():
        return sample(
            lambda x, t: expert.velocity(x, t, cache), batch=noise.shape[0], init_noise=noise, steps=steps,
            uncond_velocity_fn=None if uncond_cache is None else lambda x, t: expert.velocity(x, t, uncond_cache),
            guidance_weight=weight,
        )


@pytest.mark.parametrize("layout", ["packed", "cpu_kt"])
def test_gather_copies_exactly_each_rows_columns(layout):
    pool = BlockPool(64, 8, layout)
    paged, plain = paged_cache_of(pool, 21, [5, 0, 11], [26, 21, 30], seed=1)
    full = paged.materialized()
    assert paged.rows == 3 and paged.length == 32 and not paged.keys
    for ours, theirs in zip(full.keys + full.values, plain.keys + plain.values):
        assert torch.equal(ours, theirs)  # zeros past a row's length, never the NaN there


@pytest.mark.parametrize("layout", ["packed", "cpu_kt"])
@pytest.mark.parametrize("bucket", [1, 32])
def test_paged_sampler_matches_the_reference_over_plans_and_guidance(layout, bucket):
    """Plans of several lengths and row counts over one pool (states reused, stale table
    entries), a prompt ending inside a block, rows stopping early, and nav guidance with a
    paged route-free prefix."""
    expert = expert_of(max_freq=1.0)
    sampler = ExpertSampler(expert, bucket=bucket)
    pool = BlockPool(256, 8, layout)
    released: list[int] = []
    plans = [
        paged_cache_of(pool, 21, [6, 3, 9, 6], [27, 22, 30, 27], seed=1, released=released),  # 21 = 2 blocks + 5
        paged_cache_of(pool, 16, [4], [20], seed=2, released=released),  # the prompt fills its blocks
        paged_cache_of(pool, 29, [2, 7, 7, 1], [31, 36, 33, 30], seed=3, released=released),
    ]
    for i, (paged, plain) in enumerate(plans):
        noise = torch.randn(paged.rows, 64, 2, generator=seeded(i))
        got = sampler.sample(paged, steps=4, init_noise=noise)
        expected = reference(expert, plain, noise, steps=4)
        assert (got - expected).abs().max() < 1e-5, i
        assert (expected - noise).abs().max() > 0.1  # the velocity really matters
    assert all(isinstance(runner.state, BlockTableState) for runner in sampler._runners.values())
    cond, cond_plain = paged_cache_of(pool, 21, [6, 2], [27, 23], seed=4)
    free, free_plain = paged_cache_of(pool, 14, [6, 2], [20, 16], seed=5)  # route span removed
    noise = torch.randn(2, 64, 2, generator=seeded(5))
    got = sampler.sample(cond, init_noise=noise, uncond_cache=free, guidance_weight=1.5)
    expected = reference(expert, cond_plain, noise, uncond_cache=free_plain, weight=1.5)
    assert (got - expected).abs().max() < 1e-5
    assert (reference(expert, cond_plain, noise) - expected).abs().max() > 1e-3
    for paged, _ in plans:
        paged.release()
    assert released == [1, 2, 3]  # PrefixCache.release reaches the engine's handle


@pytest.mark.parametrize("rows", [1, 3])
def test_paged_sampler_is_bit_exact_in_a_chaotic_flow(rows):
    """At upstream's Fourier frequencies only the reference's exact numbers agree after 10
    steps: the paged read must attend the same keys in the same order with the same kernel.
    (Rows of one length: the reference's SDPA rounds differently over masked padding.)"""
    expert = expert_of(max_freq=100.0)
    paged, plain = paged_cache_of(BlockPool(64, 8, "cpu_kt"), 19, [9] * rows, [28] * rows, seed=7)
    noise = torch.randn(rows, 64, 2, generator=seeded(8))
    got = ExpertSampler(expert, bucket=1).sample(paged, init_noise=noise)
    assert torch.equal(got, reference(expert, plain, noise))


def test_paged_caches_refuse_what_they_cannot_serve():
    expert = expert_of(max_freq=1.0)
    pool = BlockPool(64, 8, "packed")
    paged, plain = paged_cache_of(pool, 21, [6, 3], [27, 24], seed=1)
    sampler = ExpertSampler(expert, bucket=1)
    noise = torch.randn(2, 64, 2, generator=seeded(0))
    with pytest.raises(ValueError, match="uncond_cache: must be paged exactly when cache is"):
        sampler.sample(paged, init_noise=noise, uncond_cache=plain, guidance_weight=1.5)
    with pytest.raises(ValueError, match="caches: one is paged"):
        expert.load_state(expert.prepare(plain), [paged])
    other = BlockPool(64, 8, "packed")  # another engine's blocks
    with pytest.raises(ValueError, match="paged caches over its own blocks"):
        expert.load_state(expert.prepare(paged_cache_of(other, 21, [6, 3], [27, 24], seed=2)[0]), [paged])
    holes = PrefixCache(
        keys=[], values=[], offsets=paged.offsets, rope_deltas=paged.rope_deltas,
        valid=torch.arange(27)[None, :].expand(2, -1) != 3, paged=paged.paged,
    )
    with pytest.raises(ValueError, match="leading run"):
        expert.prepare(holes)
    with pytest.raises(ValueError, match="paged: a paged cache holds no keys"):
        PrefixCache(keys=plain.keys, values=plain.values, offsets=paged.offsets, rope_deltas=paged.rope_deltas,
                    paged=paged.paged)  # fmt: skip
    narrow = PagedPrefix([k[..., :8] for k in pool.keys], pool.values, paged.paged.block_table, [27, 24], lambda: None)
    with pytest.raises(ValueError, match="cache.paged: expected blocks"):
        expert.prepare(PrefixCache(keys=[], values=[], offsets=paged.offsets, rope_deltas=paged.rope_deltas,
                                   paged=narrow))  # fmt: skip
