"""Benchmark the planning pipeline (the same `Pipeline.plan` the node calls), per stage.

Workloads (issue 7): W16 = cameras 0,1,2,6 x 4 frames of 1080x1920 RGB, 1 sample, reasoning forced
to exactly 40 tokens, 10 Euler steps; W4 = the front camera only; "-fp8" = FP8 backbone weights
and FP8 expert weights (kernel chosen for the GPU; --expert-quantization picks one, or none);
"-s16" = 16 samples of each plan (upstream's num_traj_samples=16, the setting behind minADE@16);
"-s16-cascade" = the same with vllm.cascade_attention "on" (the rows' shared prompt attended once
per decode step; set against W16-s16 in one run).
Inputs stream as a node sees them at a 10 Hz plan rate: each plan brings one new frame per camera
and shares the other three with the plan before (so frame caches work as in the node);
"-fresh" = every frame of every plan is new (nothing can be reused).
Every backend named in --backends runs the same inputs in the same process, so the printed ratios
are same-run figures. `--smoke` runs a tiny random checkpoint on the CPU (CI keeps it from rotting).

`--speculation N` (vLLM only) measures speculative reasoning drafting N tokens per step from the
plan history instead, on one stream of windows, in four regimes: (a) none = no speculation (its
own engine, the reference); then on one engine with vllm.speculation.method "plans": (b) same =
the history holds this window's own reasoning (the upper bound: the last plan reasoned the same),
(c) wrong = every draft is wrong from its first token (the overhead), (d) half = every draft is
right for half its length. Each regime reports decode and total p50, drafted and accepted tokens
per plan, and whether its reasoning ids and trajectories equal (a)'s (`--exact`: exit 1 if not, or
if (b) accepted no draft, as when the engine scheduled none);
then one window is sampled twice (temperature 0.6, one seed) from the same history, to see
whether seeded sampling repeats under speculation, and twice on (a)'s engine, to see whether it
repeats without (the second plan of a window finds its prompt in vLLM's prefix cache either way),
and planned greedily twice there, to see whether a plan repeats at all.

    python bench/bench_pipeline.py --smoke
    python bench/bench_pipeline.py --workload W16 --backends vllm,hf --runs 50 --full-size-dir /tmp/ckpt
    python bench/bench_pipeline.py --workload W16,W16-fp8 --speculation 4 --runs 30 --full-size-dir /tmp/ckpt

Over 400 lines: one script, so one device call measures every workload and regime in one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: the repository root, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from alpamayo_ros.core.config import AlpamayoConfig
from alpamayo_ros.core.frame_key import frame_key
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.tiny_checkpoint import write_checkpoint
from alpamayo_ros.core.types import (
    EXPERT_QUANTIZATIONS,
    FRAME_SPACING_S,
    NUM_HISTORY_POSES,
    SPECULATION_PROPOSERS,
    DrivingInput,
    SamplingSettings,
)
from bench.host_probes import GcPauses, PreprocessUsage, host_facts, host_line, summarize_host

logger = logging.getLogger("bench")
#: Largest gzipped chrome trace kept (a device call brings back only so much).
TRACE_LIMIT_BYTES = 16 * 2**20

#: (copy bandwidth B/s, bf16 GEMM FLOP/s) per GPU name fragment. The H200's were measured on the
#: lent machine (device tool KINDS.md); the H100 SXM has the same chip's compute and 3.35 of the
#: H200's 4.8 TB/s nominal, taken at the same 90% the H200 reaches.
GPU_RATES = {"H200": (4.3e12, 790e12), "H100": (3.0e12, 790e12)}


def gpu_rates() -> tuple[str, float, float]:
    """(GPU kind, bytes/s, FLOP/s) the floors are computed for: this process's GPU if known, else the H200."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    kind = next((kind for kind in GPU_RATES if kind in name), "H200")
    return (kind, *GPU_RATES[kind])


@dataclass(frozen=True)
class Workload:
    cameras: tuple[int, ...]
    frames: int = 4
    height: int = 1080
    width: int = 1920
    reasoning_tokens: int = 40
    quantization: str | None = None
    expert_quantization: str = "none"  # core.types.EXPERT_QUANTIZATIONS
    stream: bool = True  # consecutive plans share all but one frame per camera
    samples: int = 1  # trajectories (reasoning rows) per plan
    cascade_attention: str = "off"  # core.types.CASCADE_MODES (vLLM, GPU)




WORKLOADS = {
    "W16": Workload(cameras=(0, 1, 2, 6)),
    "W16-fresh": Workload(cameras=(0, 1, 2, 6), stream=False),
    "W16-s16": Workload(cameras=(0, 1, 2, 6), samples=16),
    "W16-s16-cascade": Workload(cameras=(0, 1, 2, 6), samples=16, cascade_attention="on"),
    "W16-fp8": Workload(cameras=(0, 1, 2, 6), quantization="fp8", expert_quantization="fp8"),
    "W4": Workload(cameras=(1,)),
    "smoke": Workload(cameras=(0, 1), height=270, width=480, reasoning_tokens=8),
    "smoke-s3": Workload(cameras=(0, 1), height=270, width=480, reasoning_tokens=8, samples=3),
}


def synthetic_inputs(workload: Workload, seed: int) -> Iterator[DrivingInput]:
    """Endless plans of random frames and a straight 10 m/s history (content does not change
    the cost); with workload.stream, each plan is the previous window moved on by one frame.
    Frames carry their keys as the drive loop keys them: each new frame hashed once, here, off
    the timed plan."""
    rng = np.random.default_rng(seed)
    shape = (len(workload.cameras), workload.frames, workload.height, workload.width, 3)
    spacing_ns = int(FRAME_SPACING_S * 1e9)
    history_x = 10.0 * 0.1 * np.arange(-(NUM_HISTORY_POSES - 1), 1, dtype=np.float32)
    xyz = np.stack([history_x, np.zeros_like(history_x), np.zeros_like(history_x)], axis=-1)
    rot = np.broadcast_to(np.eye(3, dtype=np.float32), (NUM_HISTORY_POSES, 3, 3)).copy()
    images = rng.integers(0, 256, size=shape, dtype=np.uint8)
    t0_ns = 10_000_000_000
    keys: list[list[str]] = [[] for _ in workload.cameras]  # per camera, oldest first
    while True:
        stamps = t0_ns - spacing_ns * np.arange(workload.frames - 1, -1, -1, dtype=np.int64)
        for row, camera in enumerate(workload.cameras):  # the frames new to this window
            keys[row] += [frame_key(camera, int(stamps[col]), images[row, col]) for col in range(len(keys[row]), workload.frames)]
        yield DrivingInput(
            images=images,
            camera_indices=workload.cameras,
            frame_stamps_ns=np.broadcast_to(stamps, shape[:2]).copy(),
            t0_ns=t0_ns,
            ego_history_xyz=xyz,
            ego_history_rot=rot,
        ).with_frame_keys([key for row in keys for key in row])
        t0_ns += spacing_ns
        if workload.stream:
            new = rng.integers(0, 256, size=(shape[0], 1, *shape[2:]), dtype=np.uint8)
            images = np.concatenate([images[:, 1:], new], axis=1)
            keys = [row[1:] for row in keys]
        else:
            images = rng.integers(0, 256, size=shape, dtype=np.uint8)
            keys = [[] for _ in workload.cameras]


def percentiles(values: list[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=np.float64)
    return {f"p{q}": float(np.percentile(array, q)) for q in (50, 90, 99)}


def greedy_settings(workload: Workload) -> SamplingSettings:
    """The workload's sampling: greedy, reasoning forced to its token count, 10 flow steps."""
    return SamplingSettings(
        num_samples=workload.samples,
        temperature=0.0,
        max_reasoning_tokens=workload.reasoning_tokens,
        min_reasoning_tokens=workload.reasoning_tokens,
        flow_steps=10,
    )


def run_backend(pipeline: Pipeline, workload: Workload, runs: int, warmup: int, profile: Path | None = None) -> dict:
    """Time `runs` plans after `warmup`; per-stage percentiles from Plan.timings_ms.

    profile: then trace one more plan with torch.profiler and write its op tables there.
    """
    settings = greedy_settings(workload)
    stages: dict[str, list[float]] = {}
    generated: list[int] = []
    in_use_peak = 0.0
    stream = synthetic_inputs(workload, seed=0)
    collected = []  # per timed plan: its preprocess ms and usage, and the collections inside it
    with GcPauses() as pauses, PreprocessUsage(pipeline) as usage:
        for index in range(warmup + runs):
            inputs = next(stream)
            if index == warmup:
                hits, misses = pipeline.frames.hits, pipeline.frames.misses
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            plan = (pipeline.warm_up if index == 0 else pipeline.plan)(inputs, settings)  # as the node
            end = time.perf_counter()
            if torch.cuda.is_available():
                free, total = torch.cuda.mem_get_info()
                in_use_peak = max(in_use_peak, (total - free) / 2**30)
            if index < warmup:
                continue
            if len(plan.generated_ids) != workload.samples:
                raise RuntimeError(f"plan {index}: {len(plan.generated_ids)} rows for {workload.samples} samples")
            generated.extend(len(row) for row in plan.generated_ids)
            for stage, ms in plan.timings_ms.items():
                stages.setdefault(stage, []).append(ms)
            stages.setdefault("wall", []).append((end - start) * 1e3)
            collected.append({"preprocess_ms": plan.timings_ms["preprocess"], "gc": pauses.within(start, end),
                              "preprocess_usage": usage.last()})
    result = {
        "stages_ms": {stage: percentiles(values) for stage, values in stages.items()},
        "generated_tokens": sorted(set(generated)),
        "runs": runs,
        "frames_reused": pipeline.frames.hits - hits,
        "frames_preprocessed": pipeline.frames.misses - misses,
        "gc": summarize_host(collected),
        "host": host_facts(),
    }
    if torch.cuda.is_available():
        result["gpu_in_use_peak_gib"] = in_use_peak
    if profile is not None:  # after the counters: the traced plan is not one of the timed ones
        write_profile(lambda: pipeline.plan(next(stream), settings), profile)
    return result


def roofline(config: AlpamayoConfig, workload: Workload, prompt_tokens: int, image_patches: int) -> dict:
    """Lower bounds for the workload on this GPU (gpu_rates), from bytes moved and FLOPs."""
    _, bandwidth, flops = gpu_rates()
    text = config.backbone.text
    hidden, layers, inter = text["hidden_size"], text["num_hidden_layers"], text["intermediate_size"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], config.backbone.head_dim
    layer_params = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    vocab = config.vocab_size
    weight_bytes = 2 if workload.quantization is None else 1
    decode_bytes = (layers * layer_params + vocab * hidden) * weight_bytes
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16
    decode_ms = (decode_bytes + kv_bytes_per_token * prompt_tokens) / bandwidth * 1e3
    prefill_flops = 2 * layers * layer_params * prompt_tokens + 4 * layers * heads * head_dim * prompt_tokens**2 / 2
    vision = config.backbone.vision
    v_hidden, v_inter, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    vision_params = depth * (4 * v_hidden * v_hidden + 2 * v_hidden * v_inter)
    vision_flops = 2 * vision_params * image_patches
    expert = config.expert
    expert_layer = expert.hidden_size * expert.head_dim * (2 * expert.num_heads + 2 * expert.num_kv_heads)
    expert_params = expert.num_layers * (expert_layer + 3 * expert.hidden_size * expert.intermediate_size)
    prefix_kv = kv_bytes_per_token * prompt_tokens * expert.num_layers / layers  # read once: rows share it
    expert_weight_bytes = 2 if workload.expert_quantization == "none" else 1
    expert_bytes_ms = 10 * (expert_params * expert_weight_bytes + prefix_kv) / bandwidth * 1e3
    # with many rows the expert is bound by FLOPs: 64 tokens per row through every weight, and
    # their attention to the prefix
    tokens = 64 * workload.samples
    attention_flops = 4 * expert.num_layers * expert.num_heads * expert.head_dim * tokens * prompt_tokens
    expert_flops_ms = 10 * (2 * expert_params * tokens + attention_flops) / flops * 1e3
    # decode: weights once per step, every row's K/V
    decode_ms += kv_bytes_per_token * prompt_tokens * (workload.samples - 1) / bandwidth * 1e3
    floors = {
        "vision": vision_flops / flops * 1e3,
        "prefill": prefill_flops / flops * 1e3,
        "decode": decode_ms * workload.reasoning_tokens,
        "expert": max(expert_bytes_ms, expert_flops_ms),
    }
    floors["backbone"] = floors["vision"] + floors["prefill"] + floors["decode"]
    # names of the pipeline's backbone sub-stages (Plan.timings_ms) these floors bound
    floors["backbone.prefill"] = floors["vision"] + floors["prefill"]
    floors["backbone.decode"] = floors["decode"]
    floors["total"] = floors["backbone"] + floors["expert"]
    return floors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny random checkpoint on the CPU")
    parser.add_argument("--workload", default="W16", help=f"comma list of {sorted(WORKLOADS)}")
    parser.add_argument("--backends", default="vllm,hf", help="comma list; ratios are against the first")
    parser.add_argument("--runs", type=int, default=50, help="timed runs of the first backend")
    parser.add_argument("--compare-runs", type=int, default=20, help="timed runs of the other backends")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, help="existing checkpoint directory")
    parser.add_argument("--full-size-dir", type=Path, help="write a full-size random checkpoint here (on this machine)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="vLLM KV cache on the GPU (the node's default)")
    parser.add_argument("--token-mask", action="store_true",
                        help="vLLM: the <i*> mask as the TokenMask logits processor, not in the model (the default)")
    parser.add_argument("--eager-vision", action="store_true",
                        help="vLLM: the vision tower eagerly, without its CUDA graphs (the default on CUDA)")
    parser.add_argument("--speculation", type=int, default=0, metavar="N",
                        help="vLLM: measure speculative reasoning drafting N tokens per step (regimes none, same, "
                        "wrong, half; see the module doc) instead of comparing backends")
    parser.add_argument("--speculation-proposer", choices=SPECULATION_PROPOSERS, default="auto",
                        help="--speculation: where drafts are looked up (device: on the GPU, vLLM scheduling "
                        "asynchronously; host: on the host, vLLM scheduling synchronously; auto: the node's default)")
    parser.add_argument("--exact", action="store_true",
                        help="with --speculation: exit 1 when a regime's reasoning ids differ from no speculation "
                        "or regime 'same' accepted no draft")
    parser.add_argument("--expert-quantization", choices=EXPERT_QUANTIZATIONS,
                        help="the expert's weights in every workload (default: the workload's; -fp8 ones: fp8)")
    parser.add_argument("--json-dir", type=Path, help="write <workload>.json here")
    parser.add_argument("--profile-dir", type=Path,
                        help="after the timed runs, trace one more plan per backend (--speculation: per regime, with "
                        "its gzipped chrome trace) with torch.profiler and write its tables here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    names = args.workload.split(",")
    if args.smoke:  # the tiny workloads named, else the plain one
        names = [name for name in names if name.startswith("smoke")] or ["smoke"]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        parser.error(f"--workload: unknown {unknown}; known: {sorted(WORKLOADS)}")
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.checkpoint:
        checkpoint = args.checkpoint
    elif args.full_size_dir:
        start = time.perf_counter()
        checkpoint = write_checkpoint(args.full_size_dir, full_size=True, weights=True, dtype=getattr(torch, dtype), device=args.device)
        logger.info("full-size random checkpoint written in %.1f s", time.perf_counter() - start)
    else:
        checkpoint = write_checkpoint(Path(tempfile.mkdtemp(prefix="bench-ckpt-")), dtype=getattr(torch, dtype))
    config = AlpamayoConfig.from_checkpoint(checkpoint)
    status = 0
    for name in names:
        if args.speculation:
            results = bench_speculation(name, args, checkpoint, dtype)
            print_speculation_report(results)
            regimes = results["regimes"]
            if args.exact and (not all(r["ids_equal"] for r in regimes.values()) or not regimes["same"]["accepted_per_plan"]):
                status = 1
        else:
            results = bench_workload(name, args, checkpoint, config, dtype)
            print_report(results)
        if args.json_dir:
            args.json_dir.mkdir(parents=True, exist_ok=True)
            suffix = "-speculation" if args.speculation else ""
            (args.json_dir / f"{name}{suffix}.json").write_text(json.dumps(results, indent=1))
    return status


def bench_workload(name: str, args: argparse.Namespace, checkpoint: Path, config: AlpamayoConfig, dtype: str) -> dict:
    """Every backend on one workload, one after the other in this process."""
    workload = expert_weights(WORKLOADS[name], args)
    results: dict = {"workload": name, "samples": workload.samples, "device": args.device, "dtype": dtype,
                     "expert_quantization": workload.expert_quantization, "backends": {}}
    if torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name()
    backends = args.backends.split(",")
    if workload.quantization:
        backends = [b for b in backends if b == "vllm"]  # HF has no online FP8 path here
    for position, backend in enumerate(backends):
        options = vllm_options(args, workload) if backend == "vllm" else {}
        # what earlier pipelines of this process still hold (a closed in-process vLLM engine may
        # keep some); this pipeline's own peak is above it
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        start = time.perf_counter()
        pipeline = Pipeline.from_checkpoint(checkpoint, backend=backend, device=args.device, dtype=dtype,
                                            backend_options=options, expert_quantization=workload.expert_quantization)
        load_s = time.perf_counter() - start
        results["expert_fp8_kernel"] = pipeline.expert.fp8_kernel
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        runs = args.runs if position == 0 else min(args.runs, args.compare_runs)
        profile = args.profile_dir / f"{name}-{backend}-profile.txt" if args.profile_dir else None
        measured = run_backend(pipeline, workload, runs, args.warmup, profile)
        measured["load_s"] = load_s
        measured["engine_options"] = options
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            measured["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            measured["gpu_held_before_load_gib"] = before / 2**30
            measured["gpu_own_peak_allocated_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
            measured["gpu_in_use_gib"] = (total - free) / 2**30
            measured["expert_memory"] = pipeline.expert_sampler.memory_gib()
        results["backends"][backend] = measured
        pipeline.close()
        del pipeline
        free_memory()
    images = len(workload.cameras) * workload.frames
    # 1080x1920 frames: 20x36 patches, 180 tokens each after the 2x2 merge (smoke: indicative only)
    prompt_tokens = images * 186 + 90  # image tokens + frame/camera text per image, plus the fixed text
    encoded = len(workload.cameras) if workload.stream else images  # new frames per plan
    results["roofline_floor_ms"] = roofline(config, workload, prompt_tokens, encoded * 720)
    results["roofline_gpu"] = gpu_rates()[0]
    return results


def free_memory() -> None:
    """Give a closed and dropped pipeline's GPU memory back before the next one loads: its
    engine's objects form reference cycles that only a collection frees."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def expert_weights(workload: Workload, args: argparse.Namespace) -> Workload:
    """The workload with the expert's weights --expert-quantization asks for, if it does."""
    if args.expert_quantization is None:
        return workload
    return dataclasses.replace(workload, expert_quantization=args.expert_quantization)


def vllm_options(args: argparse.Namespace, workload: Workload) -> dict:
    """The vLLM engine settings of a benchmark run (CPU: the small eager engine of the tests)."""
    if not args.device.startswith("cuda"):
        return {"enforce_eager": True, "kv_cache_gib": 1, "mask_in_model": not args.token_mask}
    return {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_gib": args.kv_cache_gib,
        "quantization": workload.quantization,
        "mask_in_model": not args.token_mask,
        "cascade_attention": workload.cascade_attention,
        "vision_cuda_graphs": not args.eager_vision,
    }


#: --speculation regimes after "none": (what the history holds before each plan, right ids per draft)
SPECULATION_REGIMES = {"same": "own", "wrong": 0, "half": "half"}


def bench_speculation(name: str, args: argparse.Namespace, checkpoint: Path, dtype: str) -> dict:
    """The four regimes of the module doc on one stream: (a) on an engine without speculation,
    (b)-(d) on one drafting args.speculation tokens per step from the plan history, which is
    set before each plan from (a)'s reasoning of that window (greedy: the same ids any
    regime must give)."""
    from alpamayo_ros.core.vllm_adapter.speculation import PROMPT_TAIL, scripted_row

    workload = expert_weights(WORKLOADS[name], args)
    draft = args.speculation
    settings = greedy_settings(workload)
    count = args.warmup + args.runs
    results: dict = {"workload": name, "device": args.device, "dtype": dtype, "draft_tokens": draft,
                     "proposer": args.speculation_proposer, "reasoning_tokens": workload.reasoning_tokens,
                     "samples": workload.samples, "regimes": {},
                     "vllm_use_v2_model_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "auto"),
                     "host": host_facts()}  # fmt: skip
    if torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name()

    def timed(pipeline: Pipeline, before_plan: Callable[[int], None] | None, regime: str) -> tuple[list, dict, dict]:
        """The stream's plans, the timed ones' stage ms, and what the host did during them (host_probes)."""
        plans, stages, collected = [], {}, []
        with GcPauses() as pauses, PreprocessUsage(pipeline) as usage:
            for index, inputs in zip(range(count), synthetic_inputs(workload, seed=0)):
                if before_plan is not None:
                    before_plan(index)
                start = time.perf_counter()
                plan = (pipeline.warm_up if index == 0 else pipeline.plan)(inputs, settings)  # as the node
                plans.append(plan)
                if index >= args.warmup:
                    for stage, ms in plan.timings_ms.items():
                        stages.setdefault(stage, []).append(ms)
                    collected.append({"preprocess_ms": plan.timings_ms["preprocess"],
                                      "gc": pauses.within(start, time.perf_counter()), "preprocess_usage": usage.last()})
        if args.profile_dir:  # the last window planned once more, its history as before, traced
            if before_plan is not None:
                before_plan(count - 1)
            window = next(itertools.islice(synthetic_inputs(workload, seed=0), count - 1, None))
            stem = args.profile_dir / f"{name}-speculation-{regime}"
            write_profile(lambda: pipeline.plan(window, settings), stem.with_suffix(".txt"), stem.with_suffix(".trace.json.gz"))
        return plans, stages, summarize_host(collected)

    def summary(plans: list, stages: dict, reference: list | None) -> dict:
        timed_plans = plans[args.warmup :]
        entry = {
            "stages_ms": {stage: percentiles(values) for stage, values in stages.items()},
            "drafted_per_plan": float(np.mean([p.drafted_tokens for p in timed_plans])),
            "accepted_per_plan": float(np.mean([p.accepted_tokens for p in timed_plans])),
            "ids_equal": True,
            "max_xyz_diff_m": 0.0,
            # per timed plan, for the step-cost fit (decode_step_fit)
            "plans": {"decode_ms": stages["backbone.decode"], "drafted": [p.drafted_tokens for p in timed_plans],
                      "accepted": [p.accepted_tokens for p in timed_plans]},
        }  # fmt: skip
        if reference is not None:
            entry["ids_equal"] = all(p.generated_ids == r.generated_ids for p, r in zip(plans, reference))
            # every plan's, warm-up included: one plan apart from the rest, or all alike?
            entry["xyz_diff_m"] = [float(np.abs(p.xyz - r.xyz).max()) for p, r in zip(plans, reference)]
            entry["max_xyz_diff_m"] = max(entry["xyz_diff_m"])
        return entry

    options = vllm_options(args, workload)
    pipeline = Pipeline.from_checkpoint(checkpoint, backend="vllm", device=args.device, dtype=dtype, backend_options=options,
                                        expert_quantization=workload.expert_quantization)
    reference, stages, collections = timed(pipeline, None, "none")
    results["regimes"]["none"] = {**summary(reference, stages, None), "gc": collections}
    print_regime("none", results["regimes"]["none"])
    prompts = [
        pipeline.driving_prompt(inputs, pipeline.preprocess(inputs)).input_ids.tolist()
        for _, inputs in zip(range(count), synthetic_inputs(workload, seed=0))
    ]
    window = next(synthetic_inputs(workload, seed=0))
    sampled = dataclasses.replace(settings, temperature=0.6, seed=7)

    def planned_twice(pipeline: Pipeline, before_plan: Callable[[], None], how: SamplingSettings = sampled) -> dict:
        """The window planned twice (by default with seeded sampling at temperature 0.6): the same plan?"""
        repeats = []
        for _ in range(2):
            before_plan()
            repeats.append(pipeline.plan(window, how))
        first, second = (plan.generated_ids for plan in repeats)
        return {
            "ids_equal": first == second,
            "first_difference": first_difference(first, second),
            # with equal ids, nonzero only if the backbone's K/V or the expert vary between runs
            "max_xyz_diff_m": float(np.abs(repeats[0].xyz - repeats[1].xyz).max()),
            "drafted": [plan.drafted_tokens for plan in repeats],
            "accepted": [plan.accepted_tokens for plan in repeats],
        }

    # greedy too: a plan that does not repeat greedily is not deterministic, whatever the drafts
    results["greedy_repeat_without_speculation"] = planned_twice(pipeline, lambda: None, settings)
    # the same, each plan computing its whole prompt: tells a prefix-cache hit's rounding apart
    try:
        results["greedy_repeat_cold"] = planned_twice(pipeline, pipeline.backbone.reset_prefix_cache, settings)
    except RuntimeError as error:  # vLLM refused the reset (a block still held): say so, keep the regimes
        results["greedy_repeat_cold"] = {"error": str(error)}
    results["seeded_repeat_without_speculation"] = planned_twice(pipeline, lambda: None)
    pipeline.close()
    del pipeline
    free_memory()

    options = {**options, "speculation_method": "plans", "speculation_draft_tokens": draft,
               "speculation_proposer": args.speculation_proposer}  # fmt: skip
    pipeline = Pipeline.from_checkpoint(checkpoint, backend="vllm", device=args.device, dtype=dtype, backend_options=options,
                                        expert_quantization=workload.expert_quantization)
    history = pipeline.backbone.plan_history
    wrong = pipeline.tokenizer.ids.traj_start  # an <i*> id: masked, so never right
    for regime, right in SPECULATION_REGIMES.items():

        def before_plan(index: int, right=right) -> None:
            history.clear()
            rows = reference[index].generated_ids
            if right == "own":
                history.record(prompts[index][-PROMPT_TAIL:], rows)
            else:
                ahead = draft // 2 if right == "half" else right
                history.record([], [scripted_row(prompts[index], row, ahead, wrong) for row in rows])

        plans, stages, collections = timed(pipeline, before_plan, regime)
        results["regimes"][regime] = {**summary(plans, stages, reference), "gc": collections}
        print_regime(regime, results["regimes"][regime])

    def first_window_history() -> None:
        history.clear()
        history.record(prompts[0][-PROMPT_TAIL:], reference[0].generated_ids)

    results["seeded_repeat"] = planned_twice(pipeline, first_window_history)
    pipeline.close()
    results["decode_step_fit"] = decode_step_fit(results)
    return results


def first_difference(first: list[list[int]], second: list[list[int]]) -> list[int | None] | None:
    """Per sample row, the first token index where two plans' ids differ (the shorter length if
    one row is a prefix of the other, None for an equal row); None when the plans are equal."""
    if first == second:
        return None
    return [
        None if a == b else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(first, second)
    ]


def xyz_diffs(entry: dict) -> str:
    """A regime's per-plan trajectory differences from no speculation, warm-up first."""
    return " ".join(f"{d:.1e}" for d in entry.get("xyz_diff_m", []))


def print_regime(regime: str, entry: dict) -> None:
    """A regime's line as soon as it is measured: a run cut short by its time limit still tells."""
    stages = entry["stages_ms"]
    diffs = xyz_diffs(entry)
    print(
        f"regime {regime}: decode p50 {stages['backbone.decode']['p50']:.1f} ms, total p50 {stages['total']['p50']:.1f} ms, "
        f"drafted/accepted per plan {entry['drafted_per_plan']:.1f}/{entry['accepted_per_plan']:.1f}, ids equal "
        f"{entry['ids_equal']}, dxyz per plan (m) {diffs or '-'}",
        flush=True,
    )


def print_speculation_report(results: dict) -> None:
    """One markdown table: each regime's decode and total p50 against no speculation."""
    lines = [
        f"## {results['workload']} speculation ({results['draft_tokens']} draft tokens, proposer "
        f"{results.get('proposer', 'host')}) on "
        f"{results.get('gpu', results['device'])} ({results['dtype']})",
        "",
        "| regime | decode p50 ms | total p50 ms | total / none | drafted/plan | accepted/plan | ids equal | max dxyz m |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = results["regimes"]["none"]["stages_ms"]["total"]["p50"]
    for regime, entry in results["regimes"].items():
        stages = entry["stages_ms"]
        total = stages["total"]["p50"]
        lines.append(
            f"| {regime} | {stages['backbone.decode']['p50']:.1f} | {total:.1f} | {total / base:.3f} | "
            f"{entry['drafted_per_plan']:.1f} | {entry['accepted_per_plan']:.1f} | {entry['ids_equal']} | "
            f"{entry['max_xyz_diff_m']:.2e} |"
        )
    repeat, plain = results["seeded_repeat"], results["seeded_repeat_without_speculation"]
    greedy, cold = results["greedy_repeat_without_speculation"], results["greedy_repeat_cold"]
    lines.append("")
    fit = results["decode_step_fit"]
    if fit is not None:
        lines.append(
            f"- decode per plan = {fit['constant_ms']:.1f} ms + {fit['step_ms']:.2f} ms x steps (least squares over "
            f"{fit['plans']} speculating plans, steps = {results['reasoning_tokens'] - 1} - accepted); without "
            f"speculation {fit['plain_step_ms']:.2f} ms a step"
        )
    lines.extend(f"- {regime}: {host_line(entry['gc'])}" for regime, entry in results["regimes"].items())
    lines.extend(
        f"- {regime}: dxyz per plan (m, warm-up first) {xyz_diffs(entry)}"
        for regime, entry in results["regimes"].items() if "xyz_diff_m" in entry
    )
    lines.append(f"- VLLM_USE_V2_MODEL_RUNNER: {results.get('vllm_use_v2_model_runner', 'auto')}")
    lines.append(
        f"- seeded sampling (temperature 0.6) twice from the same history: ids equal {repeat['ids_equal']} "
        f"(first differing token per row {repeat['first_difference']}), drafted {repeat['drafted']}, "
        f"accepted {repeat['accepted']}; without speculation: ids equal {plain['ids_equal']} "
        f"(first differing token per row {plain['first_difference']}); greedy twice without speculation: "
        f"ids equal {greedy['ids_equal']}, max dxyz {greedy['max_xyz_diff_m']:.2e} m; the same with the prefix cache "
        + (f"reset before each plan: {cold['error']}" if "error" in cold else
           f"reset before each plan: ids equal {cold['ids_equal']}, max dxyz {cold['max_xyz_diff_m']:.2e} m")
    )
    print("\n".join(lines))
    sys.stdout.flush()


def decode_step_fit(results: dict) -> dict | None:
    """decode ms = constant + step_ms x decode steps, fitted over every speculating plan of one
    sample (a step past the first token either decodes one token or verifies a draft; each
    accepted draft token saves one): whether a speculating engine pays per step, per plan, or
    both. None where it cannot be fitted (several samples, or the steps never vary)."""
    if results.get("samples", 1) != 1 or "reasoning_tokens" not in results:
        return None
    steps, decode = [], []
    for regime, entry in results["regimes"].items():
        if regime != "none" and "plans" in entry:
            steps += [results["reasoning_tokens"] - 1 - accepted for accepted in entry["plans"]["accepted"]]
            decode += entry["plans"]["decode_ms"]
    if len(set(steps)) < 2:
        return None
    step_ms, constant_ms = np.polyfit(steps, decode, 1)
    plain = results["regimes"]["none"]["stages_ms"]["backbone.decode"]["p50"] / (results["reasoning_tokens"] - 1)
    return {"constant_ms": float(constant_ms), "step_ms": float(step_ms), "plans": len(steps), "plain_step_ms": plain}


def write_profile(plan: Callable[[], object], path: Path, trace: Path | None = None) -> None:
    """Where one plan's time goes: host ops and device kernels, with the pipeline's stage ranges;
    with trace, also its chrome trace (gzipped), for the order of its steps."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        plan()
    events = profiler.key_averages()
    device_sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    tables = [
        "# pipeline stages (record_function ranges) and host ops by total time",
        events.table(sort_by="cpu_time_total", row_limit=60, max_name_column_width=90),
        f"# ops and kernels by {device_sort}",
        events.table(sort_by=device_sort, row_limit=60, max_name_column_width=90),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(tables))
    logger.info("profile of one plan written to %s", path)
    if trace is not None:
        note = export_trace(profiler, trace)
        logger.info("%s", note or f"its chrome trace written to {trace}")


def export_trace(prof: Any, path: Path) -> str:
    """Write prof's chrome trace gzipped to path; '' or why it was left out."""
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(raw))
        path.parent.mkdir(parents=True, exist_ok=True)
        with raw.open("rb") as source, gzip.open(path, "wb", compresslevel=6) as target:
            target.write(source.read())
    if path.stat().st_size > TRACE_LIMIT_BYTES:
        size = path.stat().st_size
        path.unlink()
        return f"trace left out: {size / 2**20:.1f} MiB gzipped > {TRACE_LIMIT_BYTES / 2**20:.0f} MiB"
    return ""


def print_report(results: dict) -> None:
    """Markdown tables: per-stage p50/p90/p99 per backend, ratios against the first backend."""
    backends = list(results["backends"])
    expert = results.get("expert_fp8_kernel")
    weights = f", FP8 expert ({expert})" if expert else ""
    lines = [f"## {results['workload']} on {results.get('gpu', results['device'])} ({results['dtype']}{weights})", ""]
    lines.append("| backend | stage | p50 ms | p90 ms | p99 ms | floor ms | floor/p50 |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    floors = results["roofline_floor_ms"]
    for backend in backends:
        for stage, p in results["backends"][backend]["stages_ms"].items():
            floor = floors.get(stage)
            frac = f"{floor / p['p50']:.2f}" if floor and p["p50"] > 0 else ""
            floor_text = f"{floor:.1f}" if floor else ""
            lines.append(f"| {backend} | {stage} | {p['p50']:.1f} | {p['p90']:.1f} | {p['p99']:.1f} | {floor_text} | {frac} |")
    if len(backends) > 1:
        first = results["backends"][backends[0]]["stages_ms"]["total"]["p50"]
        for other in backends[1:]:
            ratio = results["backends"][other]["stages_ms"]["total"]["p50"] / first
            lines.append("")
            lines.append(f"{other} total p50 / {backends[0]} total p50 = **{ratio:.2f}x**")
    for backend in backends:
        info = results["backends"][backend]
        extra = ", ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in info.items()
            if isinstance(v, (int, float)) and k != "runs"
        )
        lines.append(f"- {backend}: runs={info['runs']}, generated tokens={info['generated_tokens']}, {extra}")
        lines.append(f"  {host_line(info['gc'])}")
        if "expert_memory" in info:
            memory = info["expert_memory"]
            lines.append(f"  expert sampler: {memory['shapes']} shapes, static states {memory['states_gib']:.3f} GiB, "
                         f"graph pool {memory['graphs_gib']:.3f} GiB")
    print("\n".join(lines))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
