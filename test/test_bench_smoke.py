"""The GPU benchmark harness runs on the CPU with a tiny checkpoint, so it cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

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
