"""The GPU benchmark harness runs on the CPU with a tiny checkpoint, so it cannot rot."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_smoke_writes_per_stage_percentiles(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_pipeline.py"), "--smoke", "--backends", "hf",
         "--runs", "2", "--warmup", "0", "--json-dir", str(tmp_path), "--profile-dir", str(tmp_path / "profile")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "smoke.json").read_text())
    stages = report["backends"]["hf"]["stages_ms"]
    for stage in ("preprocess", "prompt", "backbone", "backbone.prefill", "backbone.decode", "expert", "action",
                  "total"):
        assert stages[stage]["p50"] > 0, stage
        assert stages[stage]["p50"] <= stages[stage]["p99"]
    backbone_parts = sum(stages[f"backbone.{part}"]["p50"] for part in ("prefill", "decode", "kv_handoff"))
    assert backbone_parts <= stages["backbone"]["p50"] * 1.01  # sub-stages of the backbone stage
    assert report["backends"]["hf"]["generated_tokens"] == [8]  # forced exact reasoning length
    # streamed windows: plan 1 preprocesses 2 cameras x 4 frames, plan 2 only the 2 new frames
    assert (report["backends"]["hf"]["frames_reused"], report["backends"]["hf"]["frames_preprocessed"]) == (6, 10)
    assert report["roofline_floor_ms"]["total"] > 0
    assert "| hf | total |" in result.stdout
    assert len(report["backends"]["hf"]["gc"]["gc_ms_per_plan"]) == 2  # collections looked for in each timed plan
    profile = (tmp_path / "profile" / "smoke-hf-profile.txt").read_text()  # one traced plan, stage ranges named
    assert all(f"pipeline.{stage}" in profile for stage in ("preprocess", "backbone", "expert", "action"))


def test_bench_smoke_runs_several_samples_per_plan(tmp_path: Path) -> None:
    """The W16-s16 shape in small: every plan returns one reasoning row per sample."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_pipeline.py"), "--smoke", "--workload", "smoke-s3",
         "--backends", "hf", "--runs", "2", "--warmup", "0", "--json-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "smoke-s3.json").read_text())
    assert report["samples"] == 3
    assert report["backends"]["hf"]["generated_tokens"] == [8]  # every row forced to 8 tokens
    assert report["backends"]["hf"]["stages_ms"]["expert"]["p50"] > 0


def test_tp_bench_runs_as_a_module_of_the_bench_package(tmp_path: Path) -> None:
    """`python -m bench.tp_bench` (as bench/tp_run.sh runs it on the H200s) imports bench_pipeline
    through the package and names a bad --workload before it touches a GPU."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.tp_bench", "--tp", "1", "--checkpoint", str(tmp_path / "ckpt"),
         "--out", str(tmp_path / "tp1.json"), "--workload", "W16,W99"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--workload: unknown ['W99']" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "tp1.json").exists()


def test_fp8_gemm_bench_checks_fp8_against_fp32_and_names_missing_ops(tmp_path: Path) -> None:
    """`python -m bench.fp8_gemm_bench --smoke`: the torch._scaled_mm paths really quantise
    (FP8-sized error, not bf16's), vLLM ops absent from this build are reported with their
    name instead of failing the run, the expert's four GEMMs add up to a plan's figure, and a
    bad --variants is refused before any work."""
    expert = ("expert.qkv", "expert.o", "expert.gate_up", "expert.down")
    result = subprocess.run(
        [sys.executable, "-m", "bench.fp8_gemm_bench", "--smoke", "--shapes", ",".join(("o_proj", "down_proj", *expert)),
         "--variants", "bf16,torch_tensor,torch_rowwise,cutlass_token_tensor,marlin_w8a16", "--json-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "fp8_gemm.json").read_text())
    by_variant: dict[str, list[dict]] = {}
    for entry in report["results"]:
        by_variant.setdefault(entry["variant"], []).append(entry)
    assert {(e["shape"], e["m"]) for e in by_variant["bf16"]} == {
        (shape, m) for shape in ("o_proj", "down_proj") for m in (1, 2, 4, 8, 16, 24)
    } | {(shape, m) for shape in expert for m in (64, 128, 1024)}
    assert all(e["status"] == "ok" and e["rel_err"] < 1e-2 and e["us"] > 0 for e in by_variant["bf16"])
    for variant in ("torch_tensor", "torch_rowwise"):
        assert all(e["status"] == "ok" and 1e-3 < e["rel_err"] < 0.1 for e in by_variant[variant]), variant
    for variant, op in (("cutlass_token_tensor", "cutlass_scaled_mm"), ("marlin_w8a16", "marlin_gemm")):
        assert all(e["status"] == "unavailable" and op in e["reason"] for e in by_variant[variant]), variant
    step = report["decode_step_gemm_ms"]["1"]
    assert step["bf16"] > 0 and step["torch_tensor"] > 0 and "cutlass_token_tensor" not in step
    assert "Fastest correct FP8 variant" in result.stdout
    layers = report["shapes"][-1]["per_plan"]  # the tiny expert's layers x 10 flow steps
    timed = {(e["shape"], e["m"]): e["us"] for e in by_variant["torch_rowwise"]}
    plan = report["expert_plan_gemm_ms"]["64"]
    assert plan["torch_rowwise"] == pytest.approx(sum(timed[(shape, 64)] for shape in expert) * layers / 1e3)
    assert "cutlass_token_tensor" not in plan and "Expert GEMMs of one plan" in result.stdout

    refused = subprocess.run(
        [sys.executable, "-m", "bench.fp8_gemm_bench", "--smoke", "--variants", "bf16,fp4", "--json-dir", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert refused.returncode == 2 and "--variants: unknown ['fp4']" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "x").exists()


def test_prefill_profile_attributes_a_plans_work_to_its_stages(tmp_path: Path) -> None:
    """`python -m bench.prefill_profile --smoke` (vLLM on the CPU): every profiled plan's work
    lands in the vision tower, the decoder of the prefill and of the decode steps, the expert;
    the preprocess window's CPU events and the slowest plan's trace are written."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.prefill_profile", "--smoke", "--warmup", "1", "--timed-plans", "2", "--plans", "2",
         "--preprocess-only", "2", "--json-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "prefill_profile-smoke.json").read_text())
    plans = report["profiled"]["plans"]
    assert len(plans) == 2 and len(report["timed"]["preprocess_ms"]) == 2
    for plan in plans:
        assert plan["engine_steps"] >= 8  # the prefill step and one per further reasoning token
        for stage in ("prefill.vision", "prefill.decoder", "decode.decoder", "expert", "preprocess"):
            assert plan["busy_ms"][stage] > 0, stage
        assert plan["busy_ms"]["prefill.vision"] <= plan["span_ms"]["prefill.vision"] + 1e-6
        window = plan["preprocess_cpu"]
        assert window["wall_ms"] > 0 and 0 <= window["main_thread_untraced_ms"] <= window["wall_ms"]
        assert window["calls"]  # the copies and resize of the frames at least
    assert set(report["preprocess_only"]) == {"frame_keys", "frame_cache", "total"}
    trace = tmp_path / "prefill_profile-smoke-slowest.trace.json.gz"
    assert trace.stat().st_size < 16 * 2**20
    with gzip.open(trace, "rt") as handle:
        assert json.load(handle)["traceEvents"]
    assert "Top 25 kernels" in result.stdout


def test_prefill_profile_names_gpu_kernels_by_launch_shapes_and_name(tmp_path: Path) -> None:
    """What the CPU smoke cannot show: GPU GEMMs named by their weight shape in the launching
    op's layout (aten::mm and cutlass_scaled_mm (K, N), aten::linear (N, K)), other kernels by name."""
    from types import SimpleNamespace

    from alpamayo_ros.core.config import AlpamayoConfig
    from alpamayo_ros.core.tiny_checkpoint import write_checkpoint
    from bench.prefill_profile import kernel_kind, projection_names

    config = AlpamayoConfig.from_checkpoint(write_checkpoint(tmp_path, full_size=True, weights=False))
    names = projection_names(config)

    def launch(op: str, *shapes: list[int]) -> SimpleNamespace:
        return SimpleNamespace(name=op, input_shapes=list(shapes))

    gemm = "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN"
    assert kernel_kind(gemm, launch("aten::mm", [3066, 4096], [4096, 6144]), names) == "attention.qkv_proj"
    assert kernel_kind(gemm, launch("aten::mm", [3066, 4096], [4096, 4096]), names) == "attention.o_proj"
    assert kernel_kind(gemm, launch("aten::mm", [3066, 12288], [12288, 4096]), names) == "mlp.down_proj"
    scaled = launch("_C::cutlass_scaled_mm", [3066, 24576], [3066, 4096], [4096, 24576], [3066, 1], [1], [])
    assert kernel_kind("void cutlass::device_kernel<Sm90GemmFp8>", scaled, names) == "mlp.gate_up_proj"
    assert kernel_kind(gemm, launch("aten::mm", [2880, 1152], [1152, 4304]), names) == "vision.fc1"
    assert kernel_kind(gemm, launch("aten::mm", [2880, 4304], [4304, 1152]), names) == "vision.fc2"
    assert kernel_kind(gemm, launch("aten::linear", [2880, 1152], [4304, 1152]), names) == "vision.fc1"
    assert kernel_kind(gemm, launch("cudaGraphLaunch"), names) == "gemm"  # replayed graph: no shapes
    assert kernel_kind("void flash::FlashAttnFwdSm90<...>", None, names) == "attention.core"
    assert kernel_kind("void vllm::reshape_and_cache_flash_kernel<...>", None, names) == "attention.core"
    assert kernel_kind("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", None, names) == "norm"
    assert kernel_kind("void vllm::act_and_mul_kernel<silu>", None, names) == "mlp.act"
    assert kernel_kind("void vllm::dynamic_per_token_scaled_fp8_quant_kernel<...>", None, names) == "quant"
    assert kernel_kind("void at::native::elementwise_kernel<...>", None, names) == "other"


def test_fp8_block_quantisation_round_trips_within_fp8_error() -> None:
    """The 128 x 128 weight tiles fed to the block kernels: scales rounded up at ragged edges,
    dequantised values within e4m3's relative step of the bf16 weight."""
    import torch

    from bench.fp8_gemm_bench import BLOCK, quantize_blocks

    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    q, scale = quantize_blocks(weight)
    assert q.dtype == torch.float8_e4m3fn and q.shape == weight.shape and scale.shape == (2, 3)
    expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:200, :300]
    error = torch.linalg.vector_norm(q.float() * expanded - weight) / torch.linalg.vector_norm(weight)
    assert 1e-3 < float(error) < 0.07


def test_expert_parity_checks_every_fast_path_and_the_fp8_expert(tmp_path: Path) -> None:
    """`python -m bench.expert_parity --smoke`: per-row copies and vLLM-style blocks, each in full
    precision and with FP8 weights against its own float32 truth; on the CPU every path is exact."""
    out = tmp_path / "parity.json"
    result = subprocess.run([sys.executable, "-m", "bench.expert_parity", "--smoke", "--runs", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0 and "parity ok" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["fp8_kernel"] == "dequant" and report["failed"] == []
    for rows in ("rows_1", "rows_16"):
        case = report[rows]
        assert all(case[f"{name}_error"] < 1e-5 for name in ("plain", "vllm_paged", "fp8_plain", "fp8_vllm_paged"))
        assert 1e-4 < case["fp8_vs_bf16_truth_relative"] < 0.1  # the FP8 truth really is another weight set


def test_gc_pauses_are_attributed_to_their_plan_and_its_preprocess() -> None:
    """A collection forced inside a 'plan' is recorded there with its generation; one inside a
    slow preprocess counts as such, one outside any plan is not attributed."""
    import gc
    import time

    from bench.host_probes import GcPauses, summarize_host

    plans = []
    with GcPauses() as pauses:
        gc.collect(2)  # between plans: belongs to none
        for preprocess_ms, collect in ((1.0, False), (1.0, False), (50.0, True)):
            start = time.perf_counter()
            if collect:
                gc.collect(2)
            plans.append({"preprocess_ms": preprocess_ms, "gc": pauses.within(start, time.perf_counter())})
    assert [len(plan["gc"]) for plan in plans] == [0, 0, 1]
    assert plans[2]["gc"][0]["generation"] == 2 and plans[2]["gc"][0]["at_ms"] < 50.0
    summary = summarize_host(plans)
    assert summary["collections"] == {"0": 0, "1": 0, "2": 1}
    assert (summary["slow_preprocess_plans"], summary["slow_preprocess_plans_with_gc_inside"]) == (1, 1)


def test_preprocess_usage_records_each_call_and_leaves_the_method_as_it_was() -> None:
    """Every preprocess call while entered gets its own usage; a call that touches fresh memory
    shows the page faults, and summarize_host sets slow and fast calls' medians side by side."""
    import mmap

    from bench.host_probes import PreprocessUsage, host_line, summarize_host

    class Owner:
        def preprocess(self, megabytes: int) -> int:
            if not megabytes:
                return 0
            with mmap.mmap(-1, megabytes << 20) as fresh:  # anonymous pages: one fault per page touched
                for offset in range(0, megabytes << 20, mmap.PAGESIZE):
                    fresh[offset] = 1
            return megabytes

    owner = Owner()
    with PreprocessUsage(owner) as usage:
        assert [owner.preprocess(mb) for mb in (0, 0, 64)] == [0, 0, 64]
    assert "preprocess" not in vars(owner)  # the class's method again
    assert len(usage.calls) == 3 and usage.last() is usage.calls[2]
    pages = (64 << 20) // mmap.PAGESIZE
    assert usage.calls[2]["minor_faults"] >= pages // 2 > usage.calls[0]["minor_faults"]
    plans = [{"preprocess_ms": ms, "gc": [], "preprocess_usage": u} for ms, u in zip((1.0, 1.0, 50.0), usage.calls)]
    medians = summarize_host(plans)["preprocess_usage_median"]
    assert medians["slow"]["minor_faults"] == usage.calls[2]["minor_faults"]
    assert medians["fast"]["minor_faults"] < medians["slow"]["minor_faults"]
    assert "slow preprocess median" in host_line(summarize_host(plans))


@pytest.mark.parametrize("torch_records_links", [True, False])
def test_prefill_profile_finds_the_op_that_launched_each_kernel(torch_records_links: bool) -> None:
    """A kernel's launching op, from the link torch keeps on each event (2.12 on) or, on older
    torch (the GPU machines' 2.11), from the launch's correlation id and the innermost op open on
    the launching thread; both ways give the same op, and the runtime calls are not ops."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.prefill_profile import launch_links

    def event(name: str, id: int, start: float, end: float, *, thread: int = 1, device=DeviceType.CPU, link: int = 0):
        fields = dict(name=name, id=id, thread=thread, device_type=device, time_range=SimpleNamespace(start=start, end=end))
        if torch_records_links:
            fields["linked_correlation_id"] = link
        return SimpleNamespace(**fields)

    linear = event("aten::linear", 1, 0.0, 50.0)
    mm = event("aten::mm", 2, 10.0, 20.0)  # inside linear: the innermost op of launch 900
    add = event("aten::add", 3, 30.0, 40.0)  # a sibling after it
    other = event("aten::mm", 4, 10.0, 20.0, thread=2)  # same time, another thread
    launches = [event("cudaLaunchKernel", 900, 12.0, 13.0, link=2), event("cuLaunchKernelEx", 901, 32.0, 33.0, link=3),
                event("cudaLaunchKernel", 902, 45.0, 46.0, link=1)]  # fmt: skip
    kernels = [event("nvjet_gemm", 900, 14.0, 30.0, device=DeviceType.CUDA, link=2),
               event("add_kernel", 901, 34.0, 35.0, device=DeviceType.CUDA, link=3),
               event("copy_kernel", 902, 47.0, 48.0, device=DeviceType.CUDA, link=1),
               event("orphan", 999, 60.0, 61.0, device=DeviceType.CUDA, link=77)]  # fmt: skip
    ops, by_id, launcher_of = launch_links([linear, mm, add, other, *launches, *kernels])
    assert sorted(id(op) for op in ops) == sorted(id(op) for op in (linear, mm, add, other))
    assert {key: e.name for key, e in by_id.items()} == {900: "cudaLaunchKernel", 901: "cuLaunchKernelEx", 902: "cudaLaunchKernel"}
    assert [launcher_of(k) for k in kernels] == [mm, add, linear, None]


def test_prefill_profile_counts_kernels_not_the_ranges_around_them() -> None:
    """GPU-side ranges (a runner scope's or a compiled graph's) enclose kernels: only the kernels
    are work; without CUDA events the CPU's leaf ops are."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.prefill_profile import device_events

    def event(name: str, device, annotation: bool = False, children=()):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation, cpu_children=list(children))

    kernel = event("nvjet_gemm", DeviceType.CUDA)
    scope = event("gpu_model_runner: forward", DeviceType.CUDA, annotation=True)
    mm = event("aten::mm", DeviceType.CPU)
    linear = event("aten::linear", DeviceType.CPU, children=[mm])
    assert device_events([scope, kernel, linear, mm]) == ([kernel], True)
    assert device_events([linear, mm]) == ([mm], False)
