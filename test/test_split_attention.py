"""The expert's one-launch Triton attention (core/split_attention.py) against the exact path.

Triton kernels run on the CPU only under Triton's interpreter, which is chosen when Triton is
imported, so each check runs this file in a child process with TRITON_INTERPRET=1 (the child
fails on any mismatch). The kernel must give block_table_attention's numbers within float32
rounding for any split of the prefix, chunks past a row's length, a partial last block, rows of
several lengths, GQA groups that do not fill a query tile and vLLM's CPU layout (K transposed
per block); slots no row may read hold NaN. It must leave its tickets at zero, so a CUDA graph
can replay it, and the sampler over it (compiled layers too) must plan as the reference does.
(The interpreter's bf16 matrix product is broken, so bf16 is checked on the GPU by
bench/expert_parity.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alpamayo_ros.core.expert_state import BlockTableState

HERE = Path(__file__).resolve()


def _in_interpreter(check: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{HERE.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, str(HERE), check], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"{check}: ok" in done.stdout, done.stdout[-2000:]


def test_kernel_matches_the_exact_attention_over_splits_and_lengths():
    _in_interpreter("kernel")


def test_sampler_over_the_kernel_plans_as_the_reference():
    _in_interpreter("sampler")


def test_bad_inputs_are_named():
    from alpamayo_ros.core.split_attention import split_attention

    blocks = torch.zeros(4, 8, 2, 16)
    table, lengths = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="q: 9 tokens x 4 heads do not divide into 2 rows x 2 kv heads"):
        split_attention(torch.zeros(9, 4, 16), torch.zeros(9, 2, 16), torch.zeros(9, 2, 16), blocks, blocks, table, lengths, 0.25)
    strided = torch.zeros(8, 4, 32)[..., ::2]
    with pytest.raises(ValueError, match="q/k/v: the head dimension must be contiguous"):
        split_attention(strided, torch.zeros(8, 2, 16), torch.zeros(8, 2, 16), blocks, blocks, table, lengths, 0.25)
    with pytest.raises(ValueError, match="kernel: one of"):
        BlockTableState.zeros(rows=1, width=2, n_tokens=4, key_blocks=[blocks], value_blocks=[blocks],
                              dtype=torch.float32, query_heads=4, kernel="flash")  # fmt: skip


# -- run in the child process, under the interpreter --


def _kernel_cases() -> None:
    from alpamayo_ros.core import split_attention as module
    from alpamayo_ros.core.expert_attention import block_table_attention

    g = torch.Generator().manual_seed(0)
    cases = [  # rows, queries, heads, kv heads, head dim, block size, lengths, width, layout
        (1, 16, 4, 2, 32, 16, [37], 4, "nhd"),  # ends inside its third block
        (1, 16, 4, 2, 32, 16, [48], 3, "nhd"),  # ends on a block boundary
        (3, 10, 4, 2, 16, 8, [9, 40, 23], 6, "nhd"),  # 20 packed rows: a partial query tile
        (2, 24, 8, 2, 16, 8, [1, 30], 4, "cpu_kt"),  # 96 packed rows: two tiles
    ]
    for rows, queries, heads, kv_heads, dim, page, lengths, width, layout in cases:
        count = rows * width + 2
        if layout == "nhd":
            kb = torch.randn(count, page, kv_heads, dim, generator=g)
            vb = torch.randn(count, page, kv_heads, dim, generator=g)
        else:  # vLLM's CPU cache: K as (D, block size) per (block, head)
            kb = torch.randn(count, kv_heads, dim, page, generator=g).permute(0, 3, 1, 2)
            vb = torch.randn(count, kv_heads, page, dim, generator=g).transpose(1, 2)
        table = torch.randperm(count, generator=g)[: rows * width].view(rows, width).to(torch.int32)
        for n, used in enumerate(lengths):  # what no row may read is NaN
            for column in range(used, width * page):
                block, slot = divmod(column, page)
                kb[table[n, block], slot] = float("nan")
                vb[table[n, block], slot] = float("nan")
        lens = torch.tensor(lengths, dtype=torch.int32)
        q = torch.randn(rows * queries, heads, dim, generator=g)
        k = torch.randn(rows * queries, kv_heads, dim, generator=g)
        v = torch.randn(rows * queries, kv_heads, dim, generator=g)
        cu = torch.arange(0, rows * queries + 1, queries, dtype=torch.int32)
        exact = block_table_attention(q, k, v, kb, vb, table, lens, cu, dim**-0.5)
        for splits in (1, 2, 5):
            got = module.split_attention(q, k, v, kb, vb, table, lens, dim**-0.5, splits=splits)
            error = (got - exact).abs().max().item()
            assert error < 1e-5, (rows, queries, lengths, layout, splits, error)
            again = module.split_attention(q, k, v, kb, vb, table, lens, dim**-0.5, splits=splits)
            assert torch.equal(got, again), (lengths, splits)
        assert all(int(w[3].abs().sum()) == 0 for w in module._WORKSPACES.values()), "tickets left nonzero"


def _sampler_cases() -> None:
    from test_expert_paged import BlockPool, expert_of, paged_cache_of, reference, seeded

    from alpamayo_ros.core.flow_matching import ExpertSampler

    expert = expert_of(max_freq=1.0)
    expert.paged_kernel = "split"
    for bucket, compiled in ((1, False), (32, True)):  # compiled: as on the GPU, the op traced by its fake
        sampler = ExpertSampler(expert, bucket=bucket, compile_layers=compiled)
        pool = BlockPool(256, 8, "cpu_kt")
        plans = [
            paged_cache_of(pool, 21, [6, 3, 9, 6], [27, 22, 30, 27], seed=1),  # 21 = 2 blocks + 5
            paged_cache_of(pool, 16, [4], [20], seed=2),
        ]
        for i, (paged, plain) in enumerate(plans):
            noise = torch.randn(paged.rows, 64, 2, generator=seeded(i))
            got = sampler.sample(paged, steps=4, init_noise=noise)
            expected = reference(expert, plain, noise, steps=4)
            assert (got - expected).abs().max() < 1e-5, (bucket, i, (got - expected).abs().max())
            assert (expected - noise).abs().max() > 0.1  # the velocity really matters
        assert all(runner.state.kernel == "split" for runner in sampler._runners.values())


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests above, under Triton's interpreter"
    {"kernel": _kernel_cases, "sampler": _sampler_cases}[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok")
