"""Time the action expert's flow loop on one GPU: reference vs prepared state vs CUDA graph.

Issue 7's workload: the full-size expert (36 layers, hidden 2048, ~2.29B parameters, bf16)
with random weights, a random 3100-token prefix cache, 1 sample, 10 Euler steps. Every
variant runs in the same process on the same inputs, so the printed ratios are same-run
figures. Times are wall-clock per `sample` call with the device synchronised (p50 over
--runs) after one untimed call (whose time, capture and compile included, is printed as
"first call"); the graph variants include loading the cache into their state. The
bandwidth floor reads every expert weight and the prefix K/V once per step at the measured
copy bandwidth. --micro adds per-kernel times (attention backends, each GEMM) from CUDA
graphs of 20 calls.

Parity is checked on one Euler step of dt = 1 (x1 - x0 = v): with random weights the
10-step flow is chaotic (Fourier frequencies up to 100 amplify a rounding ~400x per step),
so end points of different but equally valid kernels do not agree.

    PYTHONPATH=. python bench/expert_loop_bench.py --micro --out results.json   # on the GPU
    PYTHONPATH=. python bench/expert_loop_bench.py --smoke                      # tiny, any device
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from alpamayo_ros.core.backbone import PrefixCache
from alpamayo_ros.core.expert import ActionExpertModel, ExpertConfig
from alpamayo_ros.core.expert_attention import fa3_varlen
from alpamayo_ros.core.flow_matching import ExpertSampler, integrate, sample

#: The estimated release expert (alpamayo_ros.core.tiny_checkpoint.FULL_EXPERT) on
#: Qwen3-VL-8B's 36 cache layers.
FULL = ExpertConfig(
    hidden_size=2048, intermediate_size=6912, num_layers=36, num_heads=32, num_kv_heads=8,
    head_dim=128,
)
SMOKE = ExpertConfig(
    hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, mrope_section=(2, 3, 3), action_hidden_size=32,
)


def random_cache(config: ExpertConfig, rows: int, length: int, device, dtype) -> PrefixCache:
    """Random K/V with the stop of row i at length - 7 * i (row 0 stopped last)."""
    g = torch.Generator(device=device).manual_seed(0)
    shape = (rows, config.num_kv_heads, length, config.head_dim)
    layers = [
        torch.randn(shape, generator=g, device=device, dtype=dtype)
        for _ in range(2 * config.num_layers)
    ]
    return PrefixCache(
        keys=layers[: config.num_layers],
        values=layers[config.num_layers:],
        offsets=torch.tensor([length - 7 * i for i in range(rows)], device=device),
        rope_deltas=torch.full((rows,), -2000, device=device),
    )


def timed(fn: Callable[[], object], runs: int, device: torch.device) -> list[float]:
    """Wall milliseconds of `runs` synchronised calls, after one untimed call."""
    fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write), or None off the GPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (time.perf_counter() - start)


def kernel_profile(fn: Callable[[], object]) -> str:
    """Top GPU kernels of one call, by total device time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    return averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60)


def graph_time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Device microseconds per call of fn, replayed as a CUDA graph of `reps` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def kernel_micro(config: ExpertConfig, length: int, device: torch.device) -> dict[str, float]:
    """Per-layer kernel times (us) behind the loop: attention backends, separate vs fused GEMMs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bf16 = {"device": device, "dtype": torch.bfloat16}
    figures: dict[str, float] = {}
    heads, rows = config.num_kv_heads, config.num_heads // config.num_kv_heads * 64
    for width, capacity in ((128, length + 64), (136, -(-(length + 64) // 256) * 256)):
        q = torch.randn(1, heads, rows, width, **bf16)
        k, v = (torch.randn(1, heads, capacity, width, **bf16) for _ in range(2))
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION):
            def attend(backend=backend, q=q, k=k, v=v) -> torch.Tensor:
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v)
            try:
                figures[f"attention D={width} S={capacity} {backend.name}"] = graph_time_us(attend)
            except RuntimeError as error:
                print(f"{backend.name} D={width}: {str(error).splitlines()[0]}", flush=True)
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, wide = torch.randn(64, hidden, **bf16), torch.randn(64, inter, **bf16)
    w = {name: torch.randn(out, inp, **bf16) for name, out, inp in (
        ("q", q_dim, hidden), ("k", kv_dim, hidden), ("v", kv_dim, hidden),
        ("o", hidden, q_dim), ("gate", inter, hidden), ("up", inter, hidden),
        ("down", hidden, inter), ("qkv", q_dim + 2 * kv_dim, hidden),
        ("gate_up", 2 * inter, hidden),
    )}
    linear = torch.nn.functional.linear
    for name in w:
        source = torch.randn(64, q_dim, **bf16) if name == "o" else wide if name == "down" else h
        figures[f"gemm {name} 64x{w[name].shape[1]}x{w[name].shape[0]}"] = graph_time_us(
            lambda name=name, source=source: linear(source, w[name])
        )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI / no GPU)")
    parser.add_argument("--length", type=int, default=3100, help="prefix tokens T")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no variant after this")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--only", help="run only the variants whose name contains this")
    parser.add_argument("--micro", action="store_true", help="also time attention and GEMMs")
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = SMOKE if args.smoke else FULL
    length = 40 if args.smoke else args.length
    runs = 3 if args.smoke else args.runs

    torch.manual_seed(0)
    with torch.device(device):
        expert = ActionExpertModel(config).eval().to(dtype)
    params = sum(p.numel() for p in expert.parameters())
    cache = random_cache(config, 1, length, device, dtype)
    noise = torch.randn(1, 64, 2, generator=torch.Generator().manual_seed(1))
    bandwidth = copy_bandwidth(device)
    kv_elements = 2 * config.num_layers * length * config.num_kv_heads * config.head_dim
    step_bytes = (params + kv_elements) * dtype.itemsize  # weights + prefix K/V, once per step
    results: dict[str, object] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "params": params, "prefix_tokens": length,
        "steps": args.steps, "dtype": str(dtype),
        "copy_bandwidth_tb_s": bandwidth and bandwidth / 1e12,
        "floor_ms": bandwidth and args.steps * step_bytes / bandwidth * 1e3,
        "floor_ms_at_4.8tb_s": args.steps * step_bytes / 4.8e12 * 1e3, "variants": {},
    }
    print(json.dumps({k: v for k, v in results.items() if k != "variants"}), flush=True)

    def reference(n_steps: int) -> torch.Tensor:
        return sample(
            lambda x, t: expert.velocity(x, t, cache), batch=1, steps=n_steps, init_noise=noise,
            device=device,
        )

    def prepared(n_steps: int) -> torch.Tensor:
        state = expert.prepare(cache)
        x0 = noise.to(device)
        return integrate(lambda x, t: expert.velocity_prepared(x, t, state), x0, steps=n_steps)

    samplers: dict[str, ExpertSampler] = {}

    def graphed(bucket: int, compile_layers: bool) -> Callable[[int], torch.Tensor]:
        name = f"{bucket}-{compile_layers}"
        samplers[name] = ExpertSampler(expert, bucket=bucket, compile_layers=compile_layers)
        return lambda n_steps: samplers[name].sample(cache, steps=n_steps, init_noise=noise)

    with torch.inference_mode():
        one_step = reference(1)
        variants: list[tuple[str, Callable[[int], torch.Tensor]]] = [
            ("reference (eager, concat per step)", reference),
            ("prepared state (eager, T+64, no mask)", prepared),
            ("graph, bucket 256", graphed(256, False)),
            ("graph + compiled layers, bucket 256", graphed(256, True)),
            ("graph, exact length", graphed(1, False)),
            ("graph + compiled layers, exact length", graphed(1, True)),
        ]
        if args.micro and device.type == "cuda":
            try:
                results["micro_us"] = kernel_micro(config, length, device)
            except Exception:  # the loop figures matter more than these
                traceback.print_exc()
            for name, micro in results.get("micro_us", {}).items():
                print(f"{name:50s} {micro:8.2f} us", flush=True)
        for name, run in variants:
            if args.only and args.only not in name:
                continue
            if time.perf_counter() - begin > args.budget_s:
                print(f"SKIPPED (time budget): {name}", flush=True)
                continue
            try:
                start = time.perf_counter()
                first = run(args.steps)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first_ms = (time.perf_counter() - start) * 1e3  # incl. capture / compile
                times = timed(lambda: run(args.steps), runs, device)
                figures = {
                    "p50_ms": statistics.median(times), "min_ms": min(times),
                    "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))], "runs": len(times),
                    "first_call_ms": first_ms,
                    # one step of dt = 1: x1 - x0 is the velocity itself
                    "one_step_max_abs_dv": (run(1) - one_step).abs().max().item(),
                    "one_step_max_abs_v": (one_step - noise.to(device)).abs().max().item(),
                    "finite": bool(torch.isfinite(first).all()),
                }
            except Exception:  # report and go on: one failed variant must not lose the others
                traceback.print_exc()
                figures = {"error": traceback.format_exc(limit=3)}
            results["variants"][name] = figures
            print(json.dumps({"variant": name, **figures}), flush=True)
            if args.out:  # partial results survive a run cut short
                args.out.write_text(json.dumps(results, indent=2))

        # What each graph variant pays per plan before its replay: the prefix copy.
        state = expert.new_state(1, ExpertSampler(expert).capacity_for(length))
        load_times = timed(lambda: expert.load_state(state, [cache]), runs, device)
        results["load_state_p50_ms"] = statistics.median(load_times)
        print(json.dumps({"load_state_p50_ms": results["load_state_p50_ms"]}), flush=True)
        state_bytes = sum(t.numel() * t.element_size() for t in (*state.k_blocks, *state.v_blocks))
        results["state_gib_1_row"] = state_bytes / 2**30
        if device.type == "cuda":
            results["attention"] = "FlashAttention-3 (vLLM)" if fa3_varlen() is not None else "gathered K/V + SDPA"
            results["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            print(json.dumps({k: results[k] for k in ("attention", "state_gib_1_row", "max_memory_allocated_gib")}))
            compiled_ok = "p50_ms" in results["variants"].get(variants[3][0], {})
            profiled = samplers["256-True" if compiled_ok else "256-False"]

            def call() -> torch.Tensor:
                return profiled.sample(cache, steps=args.steps, init_noise=noise)

            print(f"kernels of one bucket-256 graph call, compiled={compiled_ok}:", flush=True)
            print(kernel_profile(call), flush=True)

    reference_ms = results["variants"].get(variants[0][0], {}).get("p50_ms")
    lines = [
        f"{results['device']}, torch {results['torch']}, {params / 1e9:.3f} B params,"
        f" T={length}, {args.steps} steps, 1 sample, {dtype}"
    ]
    if bandwidth:
        lines.append(
            f"copy bandwidth {bandwidth / 1e12:.2f} TB/s -> floor {results['floor_ms']:.2f} ms"
            f" ({results['floor_ms_at_4.8tb_s']:.2f} ms at 4.8 TB/s)"
        )
    for name, figures in results["variants"].items():
        if "p50_ms" not in figures:
            lines.append(f"{name:42s} FAILED")
            continue
        ratio = f"  x{reference_ms / figures['p50_ms']:.1f} vs reference" if reference_ms else ""
        lines.append(
            f"{name:42s} p50 {figures['p50_ms']:8.2f} ms  (first call"
            f" {figures['first_call_ms']:6.0f} ms, 1-step max|dv|"
            f" {figures['one_step_max_abs_dv']:.3g} of {figures['one_step_max_abs_v']:.3g}){ratio}"
        )
    load_ms = results["load_state_p50_ms"]
    lines.append(f"load_state (per plan, included in the graph variants) p50 {load_ms:.3f} ms")
    print("\n".join(lines), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0 if all("p50_ms" in f for f in results["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
