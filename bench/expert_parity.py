"""Check the expert's fast paths against the reference on the GPU in bf16, and time them.

The fast paths (ExpertSampler: CUDA graph of the whole loop, compiled layers, bucket 256,
paged K/V read by FlashAttention-3 where vLLM's bundle is importable; 1 sample and 16 samples:
"plain", over per-row copies as the HF backend hands them over, and "vllm_paged", the same K/V
laid out in blocks of 16 as vLLM's GPU cache holds them, read in place through block tables,
rows sharing the prompt's full blocks, as the vLLM backend hands them over; each also with the
FP8 expert's weights, "fp8_*", against the float32 expert over the same FP8 weights dequantised,
its own truth) must be as close to the
fp32 reference as the bf16 reference itself is. One Euler step of dt = 1 from t = 0
(x1 - x0 = v) is compared: with random weights the 10-step flow is chaotic
(bench/expert_loop_bench.py), so only one step has a meaningful tolerance. The script exits
with status 1 on a mismatch: max |v_fast - v_fp32| > 2 x max |v_bf16_ref - v_fp32| (+ 1e-3).
Then it times full 10-step sampler calls (p50 over --runs, synchronised, state loading
included) for 1 sample and for 16 samples, per-row copies vs vLLM's blocks read in place.

    PYTHONPATH=. python -m bench.expert_parity --out $OUT/expert_parity.json   # on the GPU
    PYTHONPATH=. python -m bench.expert_parity --smoke                         # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

from alpamayo_ros.core.backbone import PagedPrefix, PrefixCache
from alpamayo_ros.core.expert import ActionExpertModel, ExpertConfig
from alpamayo_ros.core.flow_matching import ExpertSampler
from alpamayo_ros.core.fp8_linear import KERNELS
from bench.expert_loop_bench import FULL, SMOKE, kernel_profile, timed


def samples_cache(config: ExpertConfig, rows: int, prompt: int, own: int, device, dtype) -> PrefixCache:
    """Samples of one prompt, per row: the same `prompt` columns, then `own` reasoning columns
    of its own, row i stopped min(3 * i, own - 1) tokens early (its later columns masked)."""
    g = torch.Generator(device=device).manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device, dtype=dtype)

    heads, dim, layers = config.num_kv_heads, config.head_dim, config.num_layers

    def columns() -> torch.Tensor:
        return torch.cat([randn(1, heads, prompt, dim).expand(rows, -1, -1, -1), randn(rows, heads, own, dim)], dim=2)

    return PrefixCache(
        keys=[columns() for _ in range(layers)],
        values=[columns() for _ in range(layers)],
        offsets=torch.tensor([prompt + own - min(3 * i, own - 1) for i in range(rows)], device=device),
        rope_deltas=torch.full((rows,), -2000, device=device),
    )


def vllm_paged(cache: PrefixCache, prompt: int, block_size: int = 16) -> PrefixCache:
    """The K/V of samples_cache as vLLM's GPU cache holds them: per layer one
    (blocks, Hkv, block_size, 2D) tensor, K in [..., :D], at shuffled block ids; every row's
    table starts with the prompt's full blocks (row 0's columns: the rows' are the same), then
    blocks of its own (the prompt's partial last block recomputed into them, as vLLM does for
    each sample)."""
    rows, heads, width, dim = cache.keys[0].shape
    device = cache.keys[0].device
    shared = prompt // block_size
    own = -(-width // block_size) - shared
    ids = torch.randperm(shared + rows * own, generator=torch.Generator().manual_seed(3))
    table = torch.cat([ids[:shared].expand(rows, -1), ids[shared:].view(rows, own)], dim=1).to(device)
    position = torch.arange(width, device=device)
    blocks, slots = table[:, position // block_size], position % block_size  # (rows, width), (width,)
    key_blocks, value_blocks = [], []
    for keys, values in zip(cache.keys, cache.values):
        storage = torch.full((ids.numel(), heads, block_size, 2 * dim), float("nan"), device=device, dtype=keys.dtype)
        tokens = storage.transpose(1, 2)  # (blocks, block_size, Hkv, 2D)
        k, v = tokens[..., :dim], tokens[..., dim:]
        for row in range(rows):
            k[blocks[row], slots] = keys[row].transpose(0, 1)
            v[blocks[row], slots] = values[row].transpose(0, 1)
        key_blocks.append(k)
        value_blocks.append(v)
    paged = PagedPrefix(key_blocks, value_blocks, table.int(), [width] * rows, lambda: None)
    return PrefixCache(keys=[], values=[], offsets=cache.offsets, rope_deltas=cache.rope_deltas, paged=paged)


def cast(cache: PrefixCache, dtype: torch.dtype) -> PrefixCache:
    return PrefixCache(
        keys=[t.to(dtype) for t in cache.keys], values=[t.to(dtype) for t in cache.values], offsets=cache.offsets,
        rope_deltas=cache.rope_deltas, valid=cache.valid,
    )


def relative_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    """||got - truth|| / ||truth|| over all elements."""
    return ((got.float() - truth).norm() / truth.norm()).item()


def one_step(sampler: ExpertSampler, cache: PrefixCache, noise: torch.Tensor) -> torch.Tensor:
    return sampler.sample(cache, steps=1, init_noise=noise) - noise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny expert on the CPU, fp32 'fast' dtype")
    parser.add_argument("--prompt", type=int, default=3100, help="prompt tokens, the same in every row")
    parser.add_argument("--own", type=int, default=40, help="reasoning tokens per row")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--fp8-kernel", default="auto", choices=KERNELS, help="the FP8 expert's kernel")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    config = SMOKE if args.smoke else FULL
    fast_dtype = torch.float32 if args.smoke else torch.bfloat16
    prompt, own = (20, 6) if args.smoke else (args.prompt, args.own)
    torch.manual_seed(0)
    reference = ActionExpertModel(config).to(device).eval()
    fast = copy.deepcopy(reference).to(fast_dtype)
    fp8 = copy.deepcopy(fast)
    fp8.quantize_fp8(args.fp8_kernel)
    readable = copy.deepcopy(fast)  # the same FP8 values, kept where dequantized() reads them
    readable.quantize_fp8("dequant")
    fp8_reference = readable.dequantized()  # float32 over the FP8 weights: the FP8 expert's truth
    del readable
    on_gpu = device.type == "cuda"
    report: dict = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "prompt": prompt, "own": own,
                    "fp8_kernel": fp8.fp8_kernel}
    failed = []
    with torch.inference_mode():
        for rows in (1, args.rows):
            cache32 = samples_cache(config, rows, prompt, own, device, torch.float32)
            cache = cast(cache32, fast_dtype)
            noise = torch.randn(rows, 64, 2, generator=torch.Generator(device=device).manual_seed(2), device=device)
            t = torch.zeros(rows, device=device)
            case: dict = {}
            # each weight set against its float32 truth; its eager bf16 path sets the bound
            bounds = {}
            for weights, model, oracle in (("bf16", fast, reference), ("fp8", fp8, fp8_reference)):
                truth = oracle.velocity(noise, t, cache32)
                eager = model.velocity(noise, t, cache)
                bounds[weights] = truth, (eager.float() - truth).abs().max().item(), relative_error(eager, truth)
                case[f"reference_{weights}_error"], case[f"reference_{weights}_relative"] = bounds[weights][1:]
            case["max_abs_v"] = bounds["bf16"][0].abs().max().item()
            case["fp8_vs_bf16_truth_relative"] = relative_error(bounds["fp8"][0], bounds["bf16"][0])
            paged = vllm_paged(cache, prompt)
            variants = {  # name: (weights, expert, the cache it reads)
                "plain": ("bf16", fast, cache), "vllm_paged": ("bf16", fast, paged),
                "fp8_plain": ("fp8", fp8, cache), "fp8_vllm_paged": ("fp8", fp8, paged),
            }  # fmt: skip
            for name, (weights, model, source) in variants.items():
                sampler = ExpertSampler(model, bucket=256 if on_gpu else 1, compile_layers=on_gpu)
                truth, ref_error, ref_relative = bounds[weights]
                velocity = one_step(sampler, source, noise)
                error = (velocity.float() - truth).abs().max().item()
                relative = relative_error(velocity, truth)
                case[f"{name}_error"], case[f"{name}_relative"] = error, relative
                if error > 2 * ref_error + 1e-3 or relative > 2 * ref_relative + 1e-3:
                    failed.append(
                        f"{rows} rows, {name}: max|dv| {error:.4f}, relative {relative:.4f} against the {weights}"
                        f" reference's {ref_error:.4f}, {ref_relative:.4f}"
                    )
                times = timed(lambda: sampler.sample(source, init_noise=noise), args.runs, device)
                case[f"{name}_p50_ms"] = statistics.median(times)
                case[f"{name}_p90_ms"] = sorted(times)[int(0.9 * (len(times) - 1))]
                if on_gpu:
                    print(f"# kernels of one {name} call, {rows} rows", flush=True)
                    print(kernel_profile(lambda: sampler.sample(source, init_noise=noise)), flush=True)
                del sampler
            report[f"rows_{rows}"] = case
            print(f"{rows} rows: " + ", ".join(f"{k}={v:.4f}" for k, v in case.items()), flush=True)
            del variants, paged, cache, cache32
            if on_gpu:
                torch.cuda.empty_cache()
    report["failed"] = failed
    if on_gpu:
        from alpamayo_ros.core.expert_attention import fa3_varlen

        report["attention"] = "FlashAttention-3 (vLLM)" if fa3_varlen() is not None else "gathered K/V + SDPA"
        report["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"attention: {report['attention']}, peak GPU memory {report['max_memory_allocated_gib']:.1f} GiB", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if failed:
        print("MISMATCH: " + "; ".join(failed), flush=True)
        return 1
    print("parity ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
