"""Where a plan's GPU time goes (vision tower, the decoder layers by part, logits, sampler, the
rest) and what a slow `preprocess` does, from torch.profiler traces of whole plans.

One pipeline (bench_pipeline's workload and engine settings), warmed up, then:
1. `--timed-plans` plans without the profiler: preprocess and total p50/p90/p99, and how many
   plans fall in preprocessing's slow mode (over 2x its median): the base rate.
2. `--plans` plans, each under its own torch.profiler session (CPU + CUDA, shapes recorded).
   Kernels are attributed through the CPU range that launched them: vLLM's runner scopes
   (VLLM_CUSTOM_SCOPES_FOR_PROFILING: the vision encoder runs inside "gpu_model_runner:
   preprocess", the decoder layers inside "... forward", lm_head and the mask inside "...
   postprocess", sampling inside "... sample") and the pipeline's stage ranges. The first
   engine step of a plan is its prefill, the others decode steps. Decoder kernels are split
   into attention (qkv/o GEMMs, FlashAttention, K/V writes, rope), MLP (gate_up/down GEMMs,
   activation), norms, FP8 quantisation and other; a GEMM is named by its weight shape when its
   launch carries shapes (outside CUDA graphs, i.e. in prefill). Each stage also gets its GPU
   span (first kernel start to last kernel end): span minus busy is where the GPU waited.
3. For the plan whose preprocess was slowest and the median one: the CPU events inside the
   "pipeline.preprocess" range (CUDA runtime calls such as cudaMemcpyAsync, cudaHostAlloc,
   cudaStreamSynchronize; allocator and copy ops; time per thread; main-thread time in no
   traced op, i.e. Python, hashing and waits). The slowest plan's chrome trace goes to
   --json-dir (gzipped; Perfetto reads it).
4. `--preprocess-only` calls of the pipeline's two preprocessing halves (frame keys, then the
   frame cache) with no plan in between: whether the slow mode needs the rest of the plan.

    python -m bench.prefill_profile --full-size-dir /tmp/ckpt --json-dir $OUT   # on the H200
    python -m bench.prefill_profile --smoke --json-dir /tmp/profile             # vLLM on the CPU

Over 400 lines: one instrument whose four parts share one warmed-up pipeline, the kernel
attribution rules and the report; apart, each would rebuild the pipeline (a vLLM load) and
repeat the attribution.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from alpamayo_ros.core.config import AlpamayoConfig
from alpamayo_ros.core.frame_cache import frame_keys
from alpamayo_ros.core.pipeline import Pipeline
from alpamayo_ros.core.tiny_checkpoint import write_checkpoint
from bench.bench_pipeline import WORKLOADS, export_trace, greedy_settings, percentiles, synthetic_inputs, vllm_options

logger = logging.getLogger("prefill_profile")

#: vLLM runner scope -> stage of its kernels (innermost first)
RUNNER_STAGES = {
    "gpu_model_runner: preprocess": "vision",  # the multimodal encoder and input prep ("inputs" in decode)
    "gpu_model_runner: forward": "decoder",
    "gpu_model_runner: postprocess": "logits",
    "gpu_model_runner: sample": "sampler",
}
PIPELINE_STAGES = ("preprocess", "prompt", "backbone", "cfg_prefill", "expert", "action")
GEMM_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "gemv", "splitk", "marlin", "scaled_mm", "matmul")
#: CPU events worth listing inside a slow preprocess (prefix match)
PREPROCESS_MARKS = ("cuda", "aten::copy_", "aten::to", "aten::_to_copy", "aten::empty", "aten::pin_memory",
                    "aten::stack", "aten::cat", "aten::upsample", "aten::_upsample", "aten::contiguous")  # fmt: skip
SLOW_FACTOR = 2.0  # a preprocess over this many times the median is in the slow mode


def projection_names(config: AlpamayoConfig) -> dict[tuple[int, int], str]:
    """Weight shapes (N, K) of the backbone's fused linear layers -> part of the model."""
    text, vision = config.backbone.text, config.backbone.vision
    hidden, inter = text["hidden_size"], text["intermediate_size"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], config.backbone.head_dim
    v_hidden, v_inter = vision["hidden_size"], vision["intermediate_size"]
    merged = v_hidden * vision["spatial_merge_size"] ** 2  # the merger's input: 2x2 patches side by side
    return {
        ((heads + 2 * kv_heads) * head_dim, hidden): "attention.qkv_proj",
        (hidden, heads * head_dim): "attention.o_proj",
        (2 * inter, hidden): "mlp.gate_up_proj",
        (hidden, inter): "mlp.down_proj",
        (config.vocab_size, hidden): "lm_head",
        (3 * v_hidden, v_hidden): "vision.qkv",
        (v_inter, v_hidden): "vision.fc1",
        (v_hidden, v_inter): "vision.fc2",
        (v_hidden, v_hidden): "vision.proj",
        (merged, merged): "vision.merger.fc1",
        (vision["out_hidden_size"], merged): "vision.merger.fc2",
    }


def kernel_kind(name: str, launcher: Any, projections: dict[tuple[int, int], str]) -> str:
    """attention.* / mlp.* / norm / quant / gemm / other, from the kernel name and its launch's shapes."""
    lowered = name.lower()
    if any(mark in lowered for mark in GEMM_MARKS) or (launcher is not None and launcher.name in ("aten::mm", "aten::addmm")):
        shapes = [tuple(s) for s in (getattr(launcher, "input_shapes", None) or []) if len(s) == 2]
        # NOTE: aten::linear holds the weight as (N, K); mm, addmm and cutlass_scaled_mm as
        # (K, N). Orientation matters: vision fc1 and fc2 are each other's transpose.
        linear = launcher is not None and launcher.name == "aten::linear"
        for shape in shapes:
            part = projections.get(shape if linear else shape[::-1])
            if part:
                return part
        return "gemm"
    if any(mark in lowered for mark in ("flash", "fmha", "attn", "attention", "reshape_and_cache", "rotary", "rope")):
        return "attention.core"
    if "quant" in lowered:
        return "quant"
    if any(mark in lowered for mark in ("rms", "norm", "rsqrt")):
        return "norm"
    if any(mark in lowered for mark in ("silu", "act_and_mul", "gelu")):
        return "mlp.act"
    return "other"


class Scopes:
    """The trace's runner scopes and pipeline ranges, to find those enclosing a host time.

    By time, not by the op tree: the profiler drops some ops from its tree (an op with one
    child of its own name), and kernels launched under a dropped op would lose their stage.
    Runner scopes follow each other (never nested), so a bisection finds the one open.
    """

    def __init__(self, ops: list[Any]) -> None:
        runner = sorted((e.time_range.start, e.time_range.end, e.name) for e in ops if e.name in RUNNER_STAGES)
        self.runner_starts = [start for start, _, _ in runner]
        self.runner = runner
        self.pipeline = [(e.time_range.start, e.time_range.end, e.name) for e in ops if e.name.startswith("pipeline.")]
        #: engine steps: each runs one "gpu_model_runner: preprocess" scope
        self.steps = [start for start, _, name in runner if name == "gpu_model_runner: preprocess"]

    def runner_at(self, time_us: float) -> str | None:
        index = bisect.bisect_right(self.runner_starts, time_us) - 1
        if index >= 0 and time_us <= self.runner[index][1]:
            return RUNNER_STAGES[self.runner[index][2]]
        return None

    def pipeline_at(self, time_us: float) -> str:
        inside = [(start, name) for start, end, name in self.pipeline if start <= time_us <= end]
        return max(inside)[1].removeprefix("pipeline.") if inside else "outside"

    def step_at(self, time_us: float) -> int:
        return bisect.bisect_right(self.steps, time_us) - 1


def device_events(events: list[Any]) -> tuple[list[Any], bool]:
    """CUDA kernels (and memcpy/memset) if the trace has any, else the CPU's leaf ops (vLLM on
    the CPU: its ops are the work), and whether they are GPU events. A range recorded on the GPU
    (record_function's GPU copy: "gpu_model_runner: forward", a compiled graph's call) spans
    kernels, it is not one: counted, it doubled a stage's busy time into "other"."""
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    if kernels:
        return kernels, True
    leaves = [e for e in events if e.device_type == DeviceType.CPU and not e.cpu_children and "::" in e.name]
    return leaves, False


RUNTIME_CALL = re.compile(r"cu(da)?[A-Z]")  # CUDA runtime and driver calls: cudaLaunchKernel, cuLaunchKernelEx, ...


def launch_links(events: list[Any]) -> tuple[list[Any], dict[int, Any], Callable[[Any], Any]]:
    """The trace's CPU ops and ranges, its runtime calls by correlation id (a kernel's id is its
    launch's), and a function from a kernel to the op that launched it (None if not found).

    torch records the kernel -> op link on each event from 2.12 on (linked_correlation_id);
    older versions (2.11 on the GPU machines) use it only while parsing, so there runtime calls
    are told by name, and a launch's op is the innermost op open on its thread when it ran.
    """
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    if not cpu or hasattr(cpu[0], "linked_correlation_id"):
        by_id = {e.id: e for e in cpu if not e.linked_correlation_id}
        launches = {e.id: e for e in cpu if e.linked_correlation_id}
        return list(by_id.values()), launches, lambda kernel: by_id.get(kernel.linked_correlation_id)
    launches = {e.id: e for e in cpu if RUNTIME_CALL.match(e.name)}
    ops = [e for e in cpu if not RUNTIME_CALL.match(e.name)]
    threads: dict[int, list[Any]] = defaultdict(list)
    for op in sorted(ops, key=lambda e: e.time_range.start):
        threads[op.thread].append(op)
    starts = {thread: [op.time_range.start for op in line] for thread, line in threads.items()}

    def launcher_of(kernel: Any) -> Any:
        launch = launches.get(kernel.id)
        if launch is None or launch.thread not in threads:
            return None
        line, at = threads[launch.thread], launch.time_range.start
        index = bisect.bisect_right(starts[launch.thread], at) - 1
        # the latest-starting op still open at the launch is the innermost one
        for op in line[max(0, index - 255) : index + 1][::-1]:
            if op.time_range.end >= at:
                return op
        return None

    return ops, launches, launcher_of


def summarize_plan(events: list[Any], projections: dict[tuple[int, int], str]) -> dict:
    """GPU time (ms) per stage and kind, spans, engine steps and kernel totals of one plan's trace."""
    # ops and ranges (id: their own numbering), and runtime calls such as cudaLaunchKernel or
    # cudaGraphLaunch (id: the CUPTI correlation their kernels carry as id too)
    ops, launches, launcher_of = launch_links(events)
    scopes = Scopes(ops)
    work, on_gpu = device_events(events)
    busy: dict[str, float] = defaultdict(float)
    spans: dict[str, list[float]] = {}
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in work:
        launcher = launcher_of(event) if on_gpu else event  # the op: its shapes
        launch = launches.get(event.id) if on_gpu else event
        launched_us = (launch or launcher or event).time_range.start
        runner = scopes.runner_at(launched_us)
        if runner is not None:
            phase = "prefill" if scopes.step_at(launched_us) <= 0 else "decode"
            stage = f"{phase}.{'inputs' if phase == 'decode' and runner == 'vision' else runner}"
        else:
            stage = scopes.pipeline_at(launched_us)
            stage = "backbone.other" if stage == "backbone" else stage
        duration_ms = (event.time_range.end - event.time_range.start) / 1e3
        busy[stage] += duration_ms
        span = spans.setdefault(stage, [event.time_range.start, event.time_range.end])
        span[0], span[1] = min(span[0], event.time_range.start), max(span[1], event.time_range.end)
        if runner in ("vision", "decoder", "logits"):
            kinds[stage][kernel_kind(event.name, launcher, projections)] += duration_ms
        kernels[event.name][0] += duration_ms
        kernels[event.name][1] += 1
    return {
        "gpu_events": on_gpu,
        "engine_steps": len(scopes.steps),
        "busy_ms": dict(busy),
        "span_ms": {stage: (end - start) / 1e3 for stage, (start, end) in spans.items()},
        "kinds_ms": {stage: dict(parts) for stage, parts in kinds.items()},
        "kernels": {name: {"ms": ms, "count": count} for name, (ms, count) in kernels.items()},
    }


def preprocess_window(events: list[Any]) -> dict:
    """CPU events inside the plan's pipeline.preprocess range: listed calls by total time,
    time per thread, and main-thread time outside any traced op."""
    ranges = [e for e in events if e.device_type == DeviceType.CPU and e.name == "pipeline.preprocess"]
    if not ranges:
        return {}
    window = ranges[0]
    start, end = window.time_range.start, window.time_range.end
    inside = [e for e in events if e.device_type == DeviceType.CPU and e is not window
              and start <= e.time_range.start and e.time_range.end <= end]  # fmt: skip
    calls: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    threads: dict[int, float] = defaultdict(float)
    for event in inside:
        ms = (event.time_range.end - event.time_range.start) / 1e3
        if event.name.startswith(PREPROCESS_MARKS):
            entry = calls[event.name]
            entry[0] += ms
            entry[1] += 1
            entry[2] = max(entry[2], ms)
        if event.cpu_parent is None or event.cpu_parent is window:
            threads[event.thread] += ms
    covered = sum((c.time_range.end - c.time_range.start) for c in window.cpu_children) / 1e3
    wall = (end - start) / 1e3
    return {
        "wall_ms": wall,
        "main_thread_untraced_ms": wall - covered,
        "calls": {name: {"ms": ms, "count": count, "max_ms": top} for name, (ms, count, top) in
                  sorted(calls.items(), key=lambda item: -item[1][0])},  # fmt: skip
        "threads_ms": {str(thread): ms for thread, ms in threads.items()},
    }


def preprocess_halves(pipeline: Pipeline, stream: Any, count: int) -> dict:
    """The two halves of Pipeline.preprocess timed apart (frame keys: hashing; frame cache:
    upload, resize, pinned stack) on the stream's next windows, nothing else in between."""
    keys_ms, cache_ms = [], []
    for _ in range(count):
        inputs = next(stream)
        cameras, frames = inputs.images.shape[:2]
        flat = inputs.images.reshape(cameras * frames, *inputs.images.shape[2:])
        start = time.perf_counter()
        keys = frame_keys(inputs)
        middle = time.perf_counter()
        pipeline.frames.preprocess(flat, keys)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        keys_ms.append((middle - start) * 1e3)
        cache_ms.append((time.perf_counter() - middle) * 1e3)
    return {"frame_keys": percentiles(keys_ms), "frame_cache": percentiles(cache_ms),
            "total": percentiles([a + b for a, b in zip(keys_ms, cache_ms)])}  # fmt: skip


def profile_plans(pipeline: Pipeline, stream: Any, settings: Any, count: int, projections: dict, trace: Path | None) -> dict:
    """count plans, one profiler session each; the slowest-preprocess plan's trace kept."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True):  # the first session sets up CUPTI: not kept
        pipeline.plan(next(stream), settings)
    plans, slowest = [], None
    for index in range(count):
        with profile(activities=activities, record_shapes=True) as prof:
            plan = pipeline.plan(next(stream), settings)
        events = list(prof.events())
        entry = {"timings_ms": dict(plan.timings_ms), **summarize_plan(events, projections),
                 "preprocess_cpu": preprocess_window(events)}  # fmt: skip
        plans.append(entry)
        preprocess_ms = plan.timings_ms["preprocess"]
        if slowest is None or preprocess_ms > slowest[0]:
            slowest = (preprocess_ms, index, prof)
        logger.info("profiled plan %d: preprocess %.1f ms, total %.1f ms", index, preprocess_ms, plan.timings_ms["total"])
    result: dict = {"plans": plans}
    if slowest is not None:
        result["slowest_preprocess_plan"] = slowest[1]
        if trace is not None:
            result["trace_note"] = export_trace(slowest[2], trace) or str(trace.name)
    return result


def timed_plans(pipeline: Pipeline, stream: Any, settings: Any, count: int) -> dict:
    stages: dict[str, list[float]] = defaultdict(list)
    for _ in range(count):
        plan = pipeline.plan(next(stream), settings)
        for stage, ms in plan.timings_ms.items():
            stages[stage].append(ms)
    median = statistics.median(stages["preprocess"])
    return {
        "stages_ms": {stage: percentiles(values) for stage, values in stages.items()},
        "preprocess_ms": stages["preprocess"],
        "slow_preprocess_plans": sum(ms > SLOW_FACTOR * median for ms in stages["preprocess"]),
    }


def mean_over(plans: list[dict], field: str) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for plan in plans:
        for key, value in plan[field].items():
            totals[key] += value / len(plans)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def print_report(report: dict) -> None:
    plans = report["profiled"]["plans"]
    lines = [f"## {report['workload']} on {report['device']}: GPU time per plan (mean of {len(plans)} profiled plans)", ""]
    busy, span = mean_over(plans, "busy_ms"), mean_over(plans, "span_ms")
    lines += ["| stage | busy ms | span ms |", "| --- | ---: | ---: |"]
    lines += [f"| {stage} | {ms:.2f} | {span.get(stage, 0.0):.2f} |" for stage, ms in busy.items()]
    walls = defaultdict(list)
    for plan in plans:
        for stage, ms in plan["timings_ms"].items():
            walls[stage].append(ms)
    lines += ["", "Wall (Plan.timings_ms, profiled plans, median): " + ", ".join(
        f"{stage} {statistics.median(v):.1f}" for stage, v in walls.items())]  # fmt: skip
    for stage in ("prefill.vision", "prefill.decoder", "prefill.logits", "decode.decoder", "decode.logits"):
        parts = [p["kinds_ms"].get(stage, {}) for p in plans]
        merged = mean_over([{"k": part} for part in parts], "k")
        if merged:
            lines.append(f"- {stage}: " + ", ".join(f"{kind} {ms:.2f}" for kind, ms in merged.items()))
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for plan in plans:
        for name, entry in plan["kernels"].items():
            totals[name][0] += entry["ms"] / len(plans)
            totals[name][1] += entry["count"] / len(plans)
    lines += ["", "Top 25 kernels (ms and launches per plan):", "", "| ms | count | kernel |", "| ---: | ---: | --- |"]
    for name, (ms, count) in sorted(totals.items(), key=lambda item: -item[1][0])[:25]:
        lines.append(f"| {ms:.2f} | {count:.0f} | {name[:110]} |")
    timed = report["timed"]
    lines += ["", f"Unprofiled plans: preprocess p50/p90/p99 " + "/".join(
        f"{timed['stages_ms']['preprocess'][q]:.1f}" for q in ("p50", "p90", "p99")) +
        f" ms, slow (> {SLOW_FACTOR}x median) {timed['slow_preprocess_plans']} of {len(timed['preprocess_ms'])}; total p50 "
        f"{timed['stages_ms']['total']['p50']:.1f} ms"]  # fmt: skip
    halves = report["preprocess_only"]
    lines.append("Preprocess alone, p50/p90/p99 ms: " + "; ".join(
        f"{part} " + "/".join(f"{halves[part][q]:.1f}" for q in ("p50", "p90", "p99")) for part in halves))  # fmt: skip
    for label, index in report["preprocess_compare"].items():
        window = plans[index]["preprocess_cpu"]
        if not window:
            continue
        calls = ", ".join(f"{n} {c['ms']:.1f}/{c['count']}" for n, c in list(window["calls"].items())[:10])
        lines.append(f"- {label} preprocess (plan {index}): wall {window['wall_ms']:.1f} ms, main thread untraced "
                     f"{window['main_thread_untraced_ms']:.1f} ms, threads {len(window['threads_ms'])}; calls ms/count: {calls}")
    if "trace_note" in report["profiled"]:
        lines.append(f"- trace of the slowest preprocess plan: {report['profiled']['trace_note']}")
    print("\n".join(lines))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint, vLLM on the CPU")
    parser.add_argument("--workload", default="W16", help=f"one of {sorted(WORKLOADS)}")
    parser.add_argument("--full-size-dir", type=Path, help="full-size random checkpoint (written if absent)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timed-plans", type=int, default=30, help="plans without the profiler first")
    parser.add_argument("--plans", type=int, default=8, help="plans profiled, one session each")
    parser.add_argument("--preprocess-only", type=int, default=30, help="preprocess-only calls at the end")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--token-mask", action="store_true", help="mask with TokenMask, not in the model")
    parser.add_argument("--json-dir", type=Path, help="write prefill_profile-<workload>.json and the trace here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    name = "smoke" if args.smoke else args.workload
    if name not in WORKLOADS:
        parser.error(f"--workload: unknown {name!r}; known: {sorted(WORKLOADS)}")
    if args.plans < 1 or args.timed_plans < 1:
        parser.error(f"--plans and --timed-plans: must be >= 1, got {args.plans} and {args.timed_plans}")
    if args.smoke:
        args.device = "cpu"
        checkpoint, dtype = write_checkpoint(Path(tempfile.mkdtemp(prefix="profile-ckpt-"))), "float32"
    else:
        if args.full_size_dir is None:
            parser.error("--full-size-dir: required without --smoke")
        checkpoint, dtype = args.full_size_dir, "bfloat16"
        if not (checkpoint / "config.json").exists():
            write_checkpoint(checkpoint, full_size=True, weights=True, dtype=torch.bfloat16, device=args.device)
    # NOTE: vLLM reads this once, at its first runner step: its runner scopes become profiler ranges
    os.environ.setdefault("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")
    workload = WORKLOADS[name]
    config = AlpamayoConfig.from_checkpoint(checkpoint)
    pipeline = Pipeline.from_checkpoint(checkpoint, backend="vllm", device=args.device, dtype=dtype,
                                        backend_options=vllm_options(args, workload))  # fmt: skip
    settings, stream = greedy_settings(workload), synthetic_inputs(workload, seed=0)
    for _ in range(args.warmup):
        pipeline.plan(next(stream), settings)
    report: dict = {"workload": name, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    report["timed"] = timed_plans(pipeline, stream, settings, args.timed_plans)
    trace = args.json_dir / f"prefill_profile-{name}-slowest.trace.json.gz" if args.json_dir else None
    report["profiled"] = profile_plans(pipeline, stream, settings, args.plans, projection_names(config), trace)
    order = sorted(range(args.plans), key=lambda i: report["profiled"]["plans"][i]["timings_ms"]["preprocess"])
    report["preprocess_compare"] = {"slowest": order[-1], "median": order[len(order) // 2]}
    report["preprocess_only"] = preprocess_halves(pipeline, stream, args.preprocess_only)
    print_report(report)
    if args.json_dir:
        args.json_dir.mkdir(parents=True, exist_ok=True)
        (args.json_dir / f"prefill_profile-{name}.json").write_text(json.dumps(report, indent=1))
    pipeline.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
