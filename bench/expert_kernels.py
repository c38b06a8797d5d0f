"""Candidate kernels for the expert's layer on one GPU, against what the sampler runs today.

Times (us per call, CUDA graphs of 20 calls) for the expert's shapes:
- attention of 64 queries x 32 heads over a ~3.2k-token prefix: torch SDPA flash (GQA folded,
  today's path) against FlashAttention-3 from vLLM's bundle (`vllm.vllm_flash_attn`, varlen
  with seqused_k over a padded, bucketed buffer: no mask channel), and at 16 rows FA3 over a
  block table whose rows share the prefix's blocks against the split shared/own attention the sampler ran before the paged state;
- the layer's GEMMs at 64 rows: cuBLAS (F.linear) against a Triton split-K kernel over a small
  grid of tile shapes (fp32 partials summed by torch, the sum included);
- the kernel timeline of today's compiled sampler (1 row, bucket 256 and exact; 16 rows over vLLM's blocks),
  grouped into GEMM, attention, Triton-fused elementwise and the rest.

    PYTHONPATH=/tmp/site:. python -m bench.expert_kernels --out $OUT/kernels.json   # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.expert_loop_bench import FULL, graph_time_us, random_cache


def fa3():
    """vLLM's FlashAttention-3 varlen entry point, or None with the reason printed."""
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func, is_fa_version_supported

        if not is_fa_version_supported(3):
            print("FA3 not supported here", flush=True)
            return None
        return flash_attn_varlen_func
    except Exception:
        traceback.print_exc()
        return None


def attention_figures(length: int, figures: dict, errors: dict) -> None:
    """One row: SDPA flash folded vs FA3 over a bucket-256 buffer with seqused_k."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    heads, kv_heads, dim = 32, 8, 128
    used = length + 64
    capacity = -(-used // 256) * 256
    q = torch.randn(64, heads, dim, **bf16)
    k = torch.randn(1, capacity, kv_heads, dim, **bf16)
    v = torch.randn(1, capacity, kv_heads, dim, **bf16)
    folded = q.view(64, kv_heads, 4, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, 256, dim)
    k_sdpa = k[:, :used].transpose(1, 2).contiguous()
    v_sdpa = v[:, :used].transpose(1, 2).contiguous()

    def sdpa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(folded, k_sdpa, v_sdpa)

    figures[f"attn 1 row S={used}: sdpa flash (exact)"] = graph_time_us(sdpa)
    want = sdpa().view(kv_heads, 4, 64, dim).permute(2, 0, 1, 3).reshape(64, heads, dim)
    func = fa3()
    if func is None:
        return
    cu_q = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([used], dtype=torch.int32, device="cuda")
    for splits in (0, 4, 8, 16):
        def run(splits=splits) -> torch.Tensor:
            return func(q, k, v, 64, cu_q, capacity, seqused_k=used_k, fa_version=3, num_splits=splits)

        figures[f"attn 1 row S={used} in C={capacity}: FA3 seqused_k splits={splits}"] = graph_time_us(run)
        errors[f"fa3 1 row splits={splits}"] = (run().float() - want.float()).abs().max().item()


def shared_figures(prompt: int, own: int, rows: int, figures: dict, errors: dict) -> None:
    """16 rows of one prompt: today's shared+own attention vs FA3 over a shared block table."""
    def attention_with_lse(q, keys, values, scale, bias=None):
        # what the shared-prefix path ran before the paged state: flash without a bias,
        # memory-efficient with one, both returning the log-sum-exp
        if bias is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, False, False, scale=scale)[:2]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, keys, values, bias, True, scale=scale)[:2]
        return out, lse[..., : q.shape[2]]

    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    heads, kv_heads, dim, page = 32, 8, 128, 16
    scale = dim**-0.5
    q = torch.randn(rows, 64, heads, dim, **bf16)
    sk = torch.randn(1, kv_heads, prompt, dim, **bf16)
    sv = torch.randn(1, kv_heads, prompt, dim, **bf16)
    own_len = own + 64
    ok = torch.randn(rows, kv_heads, own_len, dim, **bf16)
    ov = torch.randn(rows, kv_heads, own_len, dim, **bf16)
    bias = torch.zeros(rows, 1, 1, own_len, **bf16)

    def today() -> torch.Tensor:
        qh = q.permute(0, 2, 1, 3).reshape(rows, kv_heads, 4 * 64, dim)
        stacked = qh.transpose(0, 1).reshape(1, kv_heads, rows * 256, dim)
        s_out, s_lse = attention_with_lse(stacked, sk, sv, scale)
        s_out = s_out.reshape(kv_heads, rows, 256, dim).transpose(0, 1)
        s_lse = s_lse.reshape(kv_heads, rows, 256).transpose(0, 1)
        o_out, o_lse = attention_with_lse(qh, ok, ov, scale, bias.expand(rows, kv_heads, 256, -1))
        lse = torch.logaddexp(s_lse, o_lse)
        out = s_out.float() * torch.exp(s_lse - lse)[..., None] + o_out.float() * torch.exp(o_lse - lse)[..., None]
        return out.to(torch.bfloat16)

    figures[f"attn {rows} rows shared {prompt}+{own}: today (flash shared + efficient own + merge)"] = graph_time_us(today)
    want = today().reshape(rows, kv_heads, 4, 64, dim).permute(0, 3, 1, 2, 4).reshape(rows * 64, heads, dim)
    func = fa3()
    if func is None:
        return
    # Paged: the prompt's full blocks once; each row's blocks hold the prompt's partial last block
    # (copied), its own tokens and the 64 action tokens.
    full = prompt // page
    tail = prompt - full * page
    per_row = -(-(tail + own_len) // page)
    blocks = torch.zeros(full + rows * per_row, page, kv_heads, dim, **bf16)
    vblocks = torch.zeros_like(blocks)
    blocks[:full] = sk[0, :, : full * page].transpose(0, 1).reshape(full, page, kv_heads, dim)
    vblocks[:full] = sv[0, :, : full * page].transpose(0, 1).reshape(full, page, kv_heads, dim)
    table = torch.zeros(rows, full + per_row, dtype=torch.int32, device="cuda")
    for r in range(rows):
        seq_k = torch.cat([sk[0, :, full * page:], ok[r]], dim=1).transpose(0, 1)  # (tail+own, H, D)
        seq_v = torch.cat([sv[0, :, full * page:], ov[r]], dim=1).transpose(0, 1)
        first = full + r * per_row
        pad = per_row * page - seq_k.shape[0]
        blocks[first : first + per_row] = F.pad(seq_k, (0, 0, 0, 0, 0, pad)).view(per_row, page, kv_heads, dim)
        vblocks[first : first + per_row] = F.pad(seq_v, (0, 0, 0, 0, 0, pad)).view(per_row, page, kv_heads, dim)
        table[r, :full] = torch.arange(full, dtype=torch.int32)
        table[r, full:] = torch.arange(first, first + per_row, dtype=torch.int32)
    cu_q = torch.arange(0, rows * 64 + 1, 64, dtype=torch.int32, device="cuda")
    used_k = torch.full((rows,), prompt + own_len, dtype=torch.int32, device="cuda")
    flat_q = q.reshape(rows * 64, heads, dim)
    for splits in (0, 1, 2):
        def run(splits=splits) -> torch.Tensor:
            return func(flat_q, blocks, vblocks, 64, cu_q, prompt + own_len, seqused_k=used_k,
                        block_table=table, fa_version=3, num_splits=splits)

        figures[f"attn {rows} rows shared {prompt}+{own}: FA3 paged ({page}) splits={splits}"] = graph_time_us(run)
        errors[f"fa3 {rows} rows paged splits={splits}"] = (run().float() - want.float()).abs().max().item()


try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the GEMM comparison is skipped
    triton = None

if triton is not None:

    @triton.jit
    def _split_k_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_os, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        chunk = K // SPLIT_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, chunk, BLOCK_K):
            offs_k = pid_s * chunk + k + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=offs_m[:, None] < M, other=0.0)
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :])
            acc = tl.dot(x, tl.trans(w), acc)
        out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < M)


def triton_mm():
    """A split-K GEMM x (M, K) @ w (N, K)^T -> partials (SPLIT_K, M, N), or None without Triton."""
    if triton is None:
        return None

    def mm(x, w, block_n, block_k, split_k, stages, warps, out):
        m, k = x.shape
        n = w.shape[0]
        grid = (n // block_n, split_k, -(-m // 64))
        _split_k_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), out.stride(1),
                              BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                              num_stages=stages, num_warps=warps)
        return out

    return mm


def gemm_figures(figures: dict, best: dict) -> None:
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    shapes = {"qkv": (6144, 2048), "o": (2048, 4096), "gate_up": (13824, 2048), "down": (2048, 6912)}
    mm = triton_mm()
    for name, (n, k) in shapes.items():
        x = torch.randn(64, k, **bf16)
        w = torch.randn(n, k, **bf16) / k**0.5
        base = graph_time_us(lambda: F.linear(x, w))
        figures[f"gemm {name} 64x{k}x{n}: cuBLAS"] = base
        want = F.linear(x, w).float()
        if mm is None:
            continue
        results = []
        for block_n in (64, 128):
            for block_k in (64, 128):
                for split_k in (1, 2, 3, 4, 6, 8):
                    if n % block_n or k % (split_k * block_k):
                        continue
                    for stages in (3, 4):
                        parts = torch.empty(split_k, 64, n, device="cuda",
                                            dtype=torch.float32 if split_k > 1 else torch.bfloat16)

                        def run(block_n=block_n, block_k=block_k, split_k=split_k, stages=stages, parts=parts):
                            out = mm(x, w, block_n, block_k, split_k, stages, 4, parts)
                            return out[0] if split_k == 1 else out.sum(0, dtype=torch.float32).to(torch.bfloat16)

                        try:
                            us = graph_time_us(run)
                            err = (run().float() - want).abs().max().item()
                        except Exception as error:  # a tile shape that does not fit shared memory
                            print(f"triton {name} {block_n}/{block_k}/{split_k}/{stages}: {str(error)[:120]}")
                            continue
                        results.append((us, f"BN={block_n} BK={block_k} split={split_k} stages={stages}", err))
        results.sort()
        for us, label, err in results[:3]:
            figures[f"gemm {name} 64x{k}x{n}: triton {label}"] = us
        if results:
            us, label, err = results[0]
            best[name] = {"cublas_us": base, "triton_us": us, "config": label, "max_abs_err": err,
                          "weight_tb_s": n * k * 2 / us / 1e6}
            print(f"gemm {name}: cuBLAS {base:.2f} us, best triton {us:.2f} us ({label}, err {err:.3g},"
                  f" {n * k * 2 / us / 1e6:.2f} TB/s)", flush=True)


def categories(prof) -> dict[str, float]:
    """Device ms of one profiled call per kernel family."""
    sums: dict[str, float] = {}
    for event in prof.key_averages():
        us = event.self_device_time_total
        if us <= 0:
            continue
        name = event.key.lower()
        if "flash" in name or "fmha" in name or "attention" in name or "combine" in name:
            family = "attention"
        elif "nvjet" in name or "gemm" in name or "cutlass" in name or "splitk" in name or "xmma" in name:
            family = "gemm"
        elif name.startswith("triton"):
            family = "triton (fused elementwise)"
        else:
            family = "other"
        sums[family] = sums.get(family, 0.0) + us / 1e3
    return sums


def timeline(figures: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    from alpamayo_ros.core.expert import ActionExpertModel
    from alpamayo_ros.core.flow_matching import ExpertSampler
    from bench.expert_parity import samples_cache, vllm_paged

    torch.manual_seed(0)
    with torch.device("cuda"):
        expert = ActionExpertModel(FULL).eval().to(torch.bfloat16)
    cases = [
        ("1 row bucket 256", ExpertSampler(expert, bucket=256, compile_layers=True),
         random_cache(FULL, 1, 3100, "cuda", torch.bfloat16)),
        ("1 row exact", ExpertSampler(expert, bucket=1, compile_layers=True),
         random_cache(FULL, 1, 3100, "cuda", torch.bfloat16)),
        ("16 rows over vLLM's blocks", ExpertSampler(expert, bucket=256, compile_layers=True),
         vllm_paged(samples_cache(FULL, 16, 3100, 40, "cuda", torch.bfloat16), 3100)),
    ]
    for label, sampler, cache in cases:
        noise = torch.randn(cache.rows, 64, 2, device="cuda")
        call = lambda: sampler.sample(cache, init_noise=noise)  # noqa: E731
        call()
        call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            call()
        torch.cuda.synchronize()
        figures[f"timeline {label}: wall ms"] = (time.perf_counter() - start) * 100
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        for family, ms in categories(prof).items():
            figures[f"timeline {label}: {family} ms"] = ms
        print(f"# {label}", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70), flush=True)
        del sampler
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--skip", default="", help="comma list of: attention,shared,gemm,timeline")
    args = parser.parse_args(argv)
    figures: dict[str, float] = {}
    errors: dict[str, float] = {}
    best: dict[str, dict] = {}
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us": figures,
              "max_abs_err": errors, "triton_best": best}
    steps = {"attention": lambda: attention_figures(3100, figures, errors),
             "shared": lambda: shared_figures(3100, 40, 16, figures, errors),
             "gemm": lambda: gemm_figures(figures, best),
             "timeline": lambda: timeline(figures)}
    for name, step in steps.items():
        if name in args.skip.split(","):
            continue
        begin = time.perf_counter()
        try:
            step()
        except Exception:
            traceback.print_exc()
        print(f"[{name}: {time.perf_counter() - begin:.0f} s]", flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
    for key, value in figures.items():
        print(f"{key:90s} {value:9.2f}")
    for key, value in errors.items():
        print(f"err {key:86s} {value:9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
