"""Time the backbone's and the expert's GEMMs in bf16 against every FP8 path vLLM 0.26 offers,
without a model.

Shapes come from the checkpoint config (text: fused qkv, o_proj, fused gate_up, down, lm_head;
vision tower: qkv, proj, fc1, fc2; the action expert's fused qkv, o, gate_up, down), at decode M
(1..16 rows) and prefill M (the W16 prompt; the vision tower at 4 and 16 new frames); the
expert's at 64 rows (one sample's 64 action tokens), 128 (one sample under navigation guidance)
and 1024 (16 samples). Each variant is what one vLLM linear layer does per call, the
activation's dynamic quantisation included:

- bf16: F.linear (cuBLAS), the reference.
- cutlass_token_tensor: per-token activations, one weight scale, torch.ops._C.cutlass_scaled_mm
  (vLLM's online `quantization="fp8"` / "fp8_per_tensor" on Hopper: CutlassFP8ScaledMMLinearKernel).
- cutlass_tensor_tensor: one activation scale, one weight scale (the non-per-token fallback).
- cutlass_token_channel: per-token activations, per-channel weights ("fp8_per_channel").
- cutlass_block: (1, 128) activation groups, 128x128 weight blocks ("fp8_per_block" on this
  bundle: CutlassFp8BlockScaledMMKernel; DeepGEMM and FlashInfer are not shipped).
- triton_block: the same scales through w8a8_triton_block_scaled_mm (TritonFp8BlockScaledMMKernel).
- torch_tensor / torch_rowwise / torch_channel_dq: torch._scaled_mm per-tensor, row-wise scales,
  and vLLM's channel-wise fallback (fp32 product, then both scales applied).
- marlin_w8a16: FP8 weight-only Marlin, bf16 activations (vLLM picks it on Hopper only with
  VLLM_TEST_FORCE_FP8_MARLIN=1).

A missing op or a failing variant is reported with its reason, never a crash. Every result is
checked against an fp32 product of the same bf16 inputs (relative Frobenius error; FP8 lands
near 2-5e-2, a broken layout near 1). On CUDA, each timing is the median of graph replays of
calls that rotate over weight copies worth more than the L2 cache, so HBM is what is timed.

    python -m bench.fp8_gemm_bench --json-dir $OUT          # on the H200
    python -m bench.fp8_gemm_bench --smoke --json-dir /tmp  # tiny shapes on the CPU

Over 400 lines: one script, so one device call measures every variant on the same shapes and
inputs; each variant's builder is a few lines of its own.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from alpamayo_ros.core.config import AlpamayoConfig
from alpamayo_ros.core.tiny_checkpoint import write_checkpoint
from bench.bench_pipeline import gpu_rates

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK = 128  # vLLM's FP8 block: (1, 128) activation groups, 128 x 128 weight tiles
ROTATION_BYTES = 256 * 2**20  # weight copies per shape: several times the H200's 50 MB L2
DECODE_M = (1, 2, 4, 8, 16)
EXPERT_M = (64, 128, 1024)  # action tokens of 1 sample, 1 guided sample, 16 samples
FLOW_STEPS = 10  # expert forwards per plan
#: calls captured per CUDA graph and graph replays per timing
CALLS_PER_GRAPH, REPLAYS = 20, 10

Run = Callable[[torch.Tensor, int], torch.Tensor]  # (activations, weight copy) -> output


@dataclass(frozen=True)
class Shape:
    name: str
    n: int  # output features
    k: int  # input features
    ms: tuple[int, ...]  # rows to time it at
    per_token: int  # times one decode step runs it (layers), 0: not in decode
    per_plan: int = 0  # times one plan's flow matching runs it (layers x steps), 0: not in the expert


def backbone_shapes(config: AlpamayoConfig, prompt_tokens: int, patches: tuple[int, ...]) -> list[Shape]:
    """The backbone's linear layers as vLLM fuses them, from the checkpoint config."""
    text, vision = config.backbone.text, config.backbone.vision
    hidden, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], config.backbone.head_dim
    v_hidden, v_inter = vision["hidden_size"], vision["intermediate_size"]
    text_ms = (*DECODE_M, prompt_tokens)
    return [
        Shape("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden, text_ms, layers),
        Shape("o_proj", hidden, heads * head_dim, text_ms, layers),
        Shape("gate_up_proj", 2 * inter, hidden, text_ms, layers),
        Shape("down_proj", hidden, inter, text_ms, layers),
        # NOTE: vLLM keeps the lm_head in bf16 under FP8 (it is an embedding, not a LinearBase);
        # it runs once per row (logits of the sampled position only), so decode M only
        Shape("lm_head", config.vocab_size, hidden, DECODE_M, 1),
        Shape("vision.qkv", 3 * v_hidden, v_hidden, patches, 0),
        Shape("vision.proj", v_hidden, v_hidden, patches, 0),
        Shape("vision.fc1", v_inter, v_hidden, patches, 0),
        Shape("vision.fc2", v_hidden, v_inter, patches, 0),
    ]


def expert_shapes(config: AlpamayoConfig) -> list[Shape]:
    """The action expert's linear layers (q, k and v fused, gate and up fused, as ExpertLayer
    runs them), from the checkpoint config."""
    expert = config.expert
    hidden, q_width = expert.hidden_size, expert.num_heads * expert.head_dim
    per_plan = expert.num_layers * FLOW_STEPS
    return [
        Shape("expert.qkv", q_width + 2 * expert.num_kv_heads * expert.head_dim, hidden, EXPERT_M, 0, per_plan),
        Shape("expert.o", hidden, q_width, EXPERT_M, 0, per_plan),
        Shape("expert.gate_up", 2 * expert.intermediate_size, hidden, EXPERT_M, 0, per_plan),
        Shape("expert.down", hidden, expert.intermediate_size, EXPERT_M, 0, per_plan),
    ]


# -- quantisation (weights once, plain torch; activations as the layer does it) ------------


def quantize(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric FP8 with scale = amax / 448 (broadcast over x): (fp8 values, fp32 scale)."""
    scale = (amax.float() / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 128 tiles of (N, K) w: fp8 (N, K) and fp32 scales (N/128, K/128), rounded up."""
    n, k = w.shape
    pad = F.pad(w.float(), (0, -k % BLOCK, 0, -n % BLOCK))
    tiles = pad.view(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    q, scale = quantize(tiles, amax)
    return q.view(pad.shape)[:n, :k].contiguous(), scale[:, 0, :, 0].contiguous()


def vllm_ops():
    """vLLM's op wrappers (vllm._custom_ops), or ImportError naming what is missing."""
    from vllm import _custom_ops as ops

    return ops


def act_quant(per_token: bool) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Dynamic activation quantisation: vLLM's op where its build has one, else plain torch."""
    try:
        ops = vllm_ops()
        if has_op("dynamic_per_token_scaled_fp8_quant" if per_token else "dynamic_scaled_fp8_quant"):
            return lambda x: ops.scaled_fp8_quant(x, use_per_token_if_dynamic=per_token)
    except ImportError:
        pass
    if per_token:
        return lambda x: quantize(x, x.abs().amax(dim=1, keepdim=True))
    return lambda x: quantize(x, x.abs().amax().view(1))


def has_op(name: str) -> bool:
    """Whether vLLM's build implements torch.ops._C.<name> (the CPU build declares some as
    argument-less stubs)."""
    packet = getattr(torch.ops._C, name, None)
    return packet is not None and bool(packet.default._schema.arguments)


def need_op(name: str) -> None:
    vllm_ops()
    if not has_op(name):
        raise RuntimeError(f"torch.ops._C.{name}: not in this vLLM build")


# -- variants: each builds its weights from the bf16 copies and returns one call ------------


def bf16(weights: list[torch.Tensor]) -> tuple[Run, int]:
    return (lambda x, i: F.linear(x, weights[i])), weights[0].numel() * 2


def cutlass(act_per_token: bool, weight: str) -> Callable[[list[torch.Tensor]], tuple[Run, int]]:
    """cutlass_scaled_mm with a weight scale per tensor or per channel (vLLM's layouts:
    (K, N) column-major fp8 weight, i.e. the transpose of row-major (N, K))."""

    def build(weights: list[torch.Tensor]) -> tuple[Run, int]:
        ops = vllm_ops()
        need_op("cutlass_scaled_mm")
        packed = []
        for w in weights:
            amax = w.abs().amax() if weight == "tensor" else w.abs().amax(dim=1)
            q, scale = quantize(w, amax if weight == "tensor" else amax[:, None])
            packed.append((q.t(), scale.reshape(-1).contiguous() if weight == "tensor" else scale.view(1, -1).contiguous()))
        quant = act_quant(act_per_token)

        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            xq, xs = quant(x)
            return ops.cutlass_scaled_mm(xq, packed[i][0], xs, packed[i][1], out_dtype=x.dtype)

        return run, weights[0].numel()

    return build


def block(kernel: str) -> Callable[[list[torch.Tensor]], tuple[Run, int]]:
    """(1, 128) activation groups x 128 x 128 weight tiles, through cutlass or vLLM's Triton kernel."""

    def build(weights: list[torch.Tensor]) -> tuple[Run, int]:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            per_token_group_quant_fp8,
            w8a8_triton_block_scaled_mm,
        )

        ops = vllm_ops()
        if kernel == "cutlass":
            need_op("cutlass_scaled_mm")
            if not ops.cutlass_scaled_mm_supports_block_fp8(capability()):
                raise RuntimeError(f"cutlass_scaled_mm_supports_block_fp8({capability()}) is False")
        packed = [quantize_blocks(w) for w in weights]

        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            wq, ws = packed[i]
            if kernel == "cutlass":
                xq, xs = per_token_group_quant_fp8(x, BLOCK, column_major_scales=True)
                return ops.cutlass_scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=x.dtype)
            xq, xs = per_token_group_quant_fp8(x, BLOCK)
            return w8a8_triton_block_scaled_mm(xq, wq, xs, ws, [BLOCK, BLOCK], output_dtype=x.dtype)

        return run, weights[0].numel()

    return build


def torch_scaled_mm(mode: str) -> Callable[[list[torch.Tensor]], tuple[Run, int]]:
    """torch._scaled_mm: per-tensor scales, row-wise (M, 1) x (1, N) scales, or vLLM's
    channel-wise fallback (unit scales, fp32 product, then both scales)."""

    def build(weights: list[torch.Tensor]) -> tuple[Run, int]:
        packed = []
        for w in weights:
            amax = w.abs().amax().view(1) if mode == "tensor" else w.abs().amax(dim=1, keepdim=True)
            q, scale = quantize(w, amax)
            packed.append((q.t(), scale.view(1, -1).contiguous()))
        quant = act_quant(per_token=mode != "tensor")
        one = torch.ones(1, dtype=torch.float32, device=weights[0].device)

        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            wq, ws = packed[i]
            xq, xs = quant(x)
            if mode == "tensor":
                return torch._scaled_mm(xq, wq, scale_a=xs.view(1), scale_b=ws.view(1), out_dtype=x.dtype)
            if mode == "rowwise":
                return torch._scaled_mm(xq, wq, scale_a=xs.view(-1, 1), scale_b=ws, out_dtype=x.dtype)
            out = torch._scaled_mm(xq, wq, scale_a=one, scale_b=one, out_dtype=torch.float32)
            return (out * xs.view(-1, 1) * ws).to(x.dtype)

        return run, weights[0].numel()

    return build


def marlin(weights: list[torch.Tensor]) -> tuple[Run, int]:
    """FP8 weight-only Marlin (per-channel scales), prepared as vLLM prepares a layer for it."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import (
        apply_fp8_marlin_linear,
        prepare_fp8_layer_for_marlin,
    )

    need_op("marlin_gemm")
    layers = []
    for w in weights:
        n, k = w.shape
        q, scale = quantize(w, w.abs().amax(dim=1, keepdim=True))
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(q, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.view(-1), requires_grad=False)
        layer.output_size_per_partition, layer.input_size_per_partition = n, k
        layer.orig_dtype, layer.logical_widths = w.dtype, [n]
        prepare_fp8_layer_for_marlin(layer, size_k_first=False)
        layers.append(layer)
    n, k = weights[0].shape

    def run(x: torch.Tensor, i: int) -> torch.Tensor:
        layer = layers[i]
        return apply_fp8_marlin_linear(x, layer.weight, layer.weight_scale, layer.workspace, n, k, None)

    return run, weights[0].numel()


VARIANTS: dict[str, Callable[[list[torch.Tensor]], tuple[Run, int]]] = {
    "bf16": bf16,
    "cutlass_token_tensor": cutlass(True, "tensor"),
    "cutlass_tensor_tensor": cutlass(False, "tensor"),
    "cutlass_token_channel": cutlass(True, "channel"),
    "cutlass_block": block("cutlass"),
    "triton_block": block("triton"),
    "torch_tensor": torch_scaled_mm("tensor"),
    "torch_rowwise": torch_scaled_mm("rowwise"),
    "torch_channel_dq": torch_scaled_mm("channel_dq"),
    "marlin_w8a16": marlin,
}


def capability() -> int:
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


# -- timing ------------------------------------------------------------------------------


def time_us(run: Run, x: torch.Tensor, copies: int) -> tuple[float, str]:
    """Median microseconds per call, and how it was timed ("graph", "eager" or "host")."""
    if x.device.type != "cuda":
        samples = []
        for index in range(2 + 3 * copies):
            start = time.perf_counter()
            run(x, index % copies)
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples[2:]), "host"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles, handles, workspaces
        for index in range(3):
            run(x, index % copies)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for index in range(CALLS_PER_GRAPH):
                run(x, index % copies)
        replay, how = graph.replay, "graph"
    except Exception:  # noqa: BLE001 (an op that cannot be captured is timed eagerly instead)
        torch.cuda.synchronize()

        def replay() -> None:
            for index in range(CALLS_PER_GRAPH):
                run(x, index % copies)

        how = "eager"
    replay()
    samples = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return statistics.median(samples), how


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = torch.linalg.vector_norm((out.float() - ref).flatten())
    return float(diff / torch.linalg.vector_norm(ref.flatten()))


def bench_shape(shape: Shape, variants: list[str], device: torch.device, seed: int) -> list[dict]:
    """Every variant at every M of one shape; failures become entries with their reason."""
    generator = torch.Generator(device=device).manual_seed(seed)
    copies = max(1, min(8, math.ceil(ROTATION_BYTES / (shape.n * shape.k * 2)))) if device.type == "cuda" else 1
    weights = [
        (torch.randn(shape.n, shape.k, generator=generator, device=device) * shape.k**-0.5).to(torch.bfloat16)
        for _ in range(copies)
    ]
    inputs = {m: torch.randn(m, shape.k, generator=generator, device=device).to(torch.bfloat16) for m in shape.ms}
    refs = {m: x.float() @ weights[0].float().t() for m, x in inputs.items()}
    results = []
    for variant in variants:
        entry = {"shape": shape.name, "n": shape.n, "k": shape.k, "variant": variant}
        try:
            run, weight_bytes = VARIANTS[variant](weights)
        except Exception as error:  # noqa: BLE001 (reported, the run goes on)
            results.extend({**entry, "m": m, "status": "unavailable", "reason": reason(error)} for m in shape.ms)
            continue
        for m, x in inputs.items():
            try:
                err = relative_error(run(x, 0), refs[m])
                us, how = time_us(run, x, copies)
                results.append({
                    **entry, "m": m, "status": "ok" if math.isfinite(err) and err < 0.1 else "wrong",
                    "us": us, "timing": how, "rel_err": err, "weight_bytes": weight_bytes,
                    "tb_per_s": weight_bytes / us / 1e6, "floor_us": weight_bytes / gpu_rates()[1] * 1e6,
                })  # fmt: skip
            except Exception as error:  # noqa: BLE001
                results.append({**entry, "m": m, "status": "failed", "reason": reason(error)})
        del run
    del weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def reason(error: BaseException) -> str:
    """The error's last line of text, plus where it was raised."""
    frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    where = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}{where}"[:300]


def decode_step_ms(results: list[dict], shapes: list[Shape]) -> dict[str, dict[str, float]]:
    """Per decode M and variant: one step's GEMM time (every layer's four projections and the
    lm_head, which stays bf16 under FP8), where all five shapes timed ok."""
    layers = {shape.name: shape.per_token for shape in shapes if shape.per_token}
    timed = {(r["shape"], r["m"], r["variant"]): r["us"] for r in results if r["status"] == "ok"}
    table: dict[str, dict[str, float]] = {}
    for m in DECODE_M:
        for variant in VARIANTS:
            parts = [
                timed.get((name, m, "bf16" if name == "lm_head" else variant)) for name in layers
            ]
            if all(part is not None for part in parts):
                table.setdefault(str(m), {})[variant] = sum(p * layers[n] for p, n in zip(parts, layers)) / 1e3
    return table


def expert_plan_ms(results: list[dict], shapes: list[Shape]) -> dict[str, dict[str, float]]:
    """Per expert M and variant: one plan's expert GEMM time (every layer's four projections in
    every flow step), where all four shapes timed ok."""
    counts = {shape.name: shape.per_plan for shape in shapes if shape.per_plan}
    timed = {(r["shape"], r["m"], r["variant"]): r["us"] for r in results if r["status"] == "ok"}
    table: dict[str, dict[str, float]] = {}
    for m in EXPERT_M:
        for variant in VARIANTS:
            parts = [timed.get((name, m, variant)) for name in counts]
            if counts and all(part is not None for part in parts):
                table.setdefault(str(m), {})[variant] = sum(p * counts[n] for p, n in zip(parts, counts)) / 1e3
    return table


def print_report(results: list[dict], steps: dict[str, dict[str, float]], plans: dict[str, dict[str, float]]) -> None:
    lines = ["| shape | M | variant | us | TB/s | x bf16 | rel err | timing |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    base = {(r["shape"], r["m"]): r["us"] for r in results if r["variant"] == "bf16" and r["status"] == "ok"}
    for r in results:
        if "us" not in r:
            continue
        speedup = base.get((r["shape"], r["m"]), float("nan")) / r["us"]
        lines.append(
            f"| {r['shape']} | {r['m']} | {r['variant']}{'' if r['status'] == 'ok' else ' WRONG'} | {r['us']:.1f} | "
            f"{r['tb_per_s']:.2f} | {speedup:.2f} | {r['rel_err']:.1e} | {r['timing']} |"
        )
    lines += ["", "Fastest correct FP8 variant per shape and M:", "", "| shape | M | bf16 us | best FP8 | us | x bf16 | rel err |",
              "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]  # fmt: skip
    for (shape, m), bf16_us in base.items():
        fp8 = [r for r in results if (r["shape"], r["m"]) == (shape, m) and r["variant"] != "bf16" and r["status"] == "ok"]
        if fp8:
            best = min(fp8, key=lambda r: r["us"])
            lines.append(f"| {shape} | {m} | {bf16_us:.1f} | {best['variant']} | {best['us']:.1f} | "
                         f"{bf16_us / best['us']:.2f} | {best['rel_err']:.1e} |")  # fmt: skip
    lines += ["", "Decode step GEMMs (all layers + bf16 lm_head), ms per token:", "", "| M | " + " | ".join(VARIANTS) + " |",
              "| ---: |" + " ---: |" * len(VARIANTS)]  # fmt: skip
    for m, row in steps.items():
        lines.append(f"| {m} | " + " | ".join(f"{row[v]:.3f}" if v in row else "-" for v in VARIANTS) + " |")
    lines += ["", f"Expert GEMMs of one plan (all layers x {FLOW_STEPS} flow steps), ms:", "",
              "| M | " + " | ".join(VARIANTS) + " |", "| ---: |" + " ---: |" * len(VARIANTS)]  # fmt: skip
    for m, row in plans.items():
        lines.append(f"| {m} | " + " | ".join(f"{row[v]:.2f}" if v in row else "-" for v in VARIANTS) + " |")
    missing: dict[tuple[str, str], set[str]] = {}
    for r in results:
        if r["status"] in ("unavailable", "failed"):
            missing.setdefault((r["variant"], r["reason"]), set()).add(r["shape"])
    if missing:
        lines += ["", "Not timed (variant: reason; shapes):"]
        lines += [f"- {variant}: {why}; {','.join(sorted(names))}" for (variant, why), names in sorted(missing.items())]
    print("\n".join(lines))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    parser.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    parser.add_argument("--prompt-tokens", type=int, default=16 * 186 + 90, help="prefill M (W16's prompt)")
    parser.add_argument("--patches", default="2880,11520", help="vision tower M: 4 and 16 new 1080p frames")
    parser.add_argument("--json-dir", type=Path, help="write fp8_gemm.json here")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    checkpoint = write_checkpoint(Path(tempfile.mkdtemp(prefix="gemm-cfg-")), full_size=not args.smoke, weights=False)
    config = AlpamayoConfig.from_checkpoint(checkpoint)
    prompt, patches = (24, (32,)) if args.smoke else (args.prompt_tokens, tuple(int(p) for p in args.patches.split(",")))
    shapes = backbone_shapes(config, prompt, patches) + expert_shapes(config)
    if args.shapes:
        wanted = args.shapes.split(",")
        if unknown := [name for name in wanted if name not in {s.name for s in shapes}]:
            parser.error(f"--shapes: unknown {unknown}; known: {[s.name for s in shapes]}")
        shapes = [s for s in shapes if s.name in wanted]
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    results: list[dict] = []
    # NOTE: variants outer, and the JSON rewritten after each: a variant that leaves a sticky
    # CUDA error (or crashes the process) loses only itself and what follows. Each shape's
    # weights come from a seed of their own, so every variant sees the same numbers.
    for variant in variants:
        for index, shape in enumerate(shapes):
            results += bench_shape(shape, [variant], device, seed=index)
        if args.json_dir:
            write_report(args.json_dir, device, shapes, results)
    print_report(results, decode_step_ms(results, shapes), expert_plan_ms(results, shapes))
    return 1 if any(r["status"] == "wrong" for r in results) else 0


def write_report(json_dir: Path, device: torch.device, shapes: list[Shape], results: list[dict]) -> None:
    json_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shapes": [vars(s) for s in shapes],
        "results": results,
        "decode_step_gemm_ms": decode_step_ms(results, shapes),
        "expert_plan_gemm_ms": expert_plan_ms(results, shapes),
    }
    (json_dir / "fp8_gemm.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
