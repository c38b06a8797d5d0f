"""bench_pipeline's speculation mode runs on the CPU with a tiny checkpoint, so the regimes the
H200 measures cannot rot: each drafts what it says and leaves the reasoning ids unchanged."""

import json
import subprocess
import sys
from pathlib import Path

from bench.bench_pipeline import first_difference

ROOT = Path(__file__).resolve().parents[1]


def test_first_difference_names_the_token_per_row() -> None:
    """What the seeded-repeat report prints when two plans of one window differ."""
    assert first_difference([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 7, 6]]) == [None, 1]
    assert first_difference([[1, 2]], [[1, 2, 3]]) == [2]
    assert first_difference([[1], [2]], [[1], [2]]) is None


def test_speculation_regimes_draft_what_they_say(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_pipeline.py"), "--smoke", "--speculation", "2",
         "--runs", "2", "--warmup", "0", "--exact", "--json-dir", str(tmp_path),
         "--profile-dir", str(tmp_path / "profile")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "smoke-speculation.json").read_text())
    regimes = report["regimes"]
    assert list(regimes) == ["none", "same", "wrong", "half"]
    assert all(entry["ids_equal"] for entry in regimes.values())
    assert regimes["none"]["drafted_per_plan"] == 0
    same, wrong, half = regimes["same"], regimes["wrong"], regimes["half"]
    assert same["accepted_per_plan"] == same["drafted_per_plan"] > 0
    assert wrong["accepted_per_plan"] == 0 < wrong["drafted_per_plan"]
    assert 0 < half["accepted_per_plan"] < half["drafted_per_plan"]
    for entry in regimes.values():
        assert entry["stages_ms"]["backbone.decode"]["p50"] > 0 and entry["max_xyz_diff_m"] < 1e-3
    assert "| half |" in result.stdout
    # each timed plan's decode and counts, and the line fitted through the speculating ones
    assert all(len(entry["plans"]["decode_ms"]) == len(entry["plans"]["accepted"]) == 2 for entry in regimes.values())
    assert [sum(regimes["same"]["plans"]["drafted"]) / 2] == [same["drafted_per_plan"]]
    fit = report["decode_step_fit"]
    steps = [report["reasoning_tokens"] - 1 - a for r in ("same", "wrong", "half") for a in regimes[r]["plans"]["accepted"]]
    decode = [ms for r in ("same", "wrong", "half") for ms in regimes[r]["plans"]["decode_ms"]]
    residual = [ms - fit["constant_ms"] - fit["step_ms"] * n for n, ms in zip(steps, decode)]
    assert fit["plans"] == 6 and abs(sum(residual)) < 1e-6 * max(decode)  # least squares: residuals sum to 0
    assert "ms x steps (least squares over 6 speculating plans" in result.stdout
    repeat = report["seeded_repeat"]  # temperature 0.6, a seed, the same history twice
    assert repeat["ids_equal"] and len(set(repeat["drafted"])) == 1 and repeat["drafted"][0] > 0
    assert repeat["first_difference"] is None
    plain = report["seeded_repeat_without_speculation"]
    assert plain["ids_equal"] and plain["drafted"] == [0, 0]
    greedy = report["greedy_repeat_without_speculation"]
    assert greedy["ids_equal"] and greedy["first_difference"] is None and greedy["drafted"] == [0, 0]
    assert greedy["max_xyz_diff_m"] == 0.0  # one engine, one window, greedy: the same plan to the bit
    cold = report["greedy_repeat_cold"]  # the same, each plan computing its whole prompt
    assert cold["ids_equal"] and cold["max_xyz_diff_m"] == 0.0 and cold["drafted"] == [0, 0]
    assert "the same with the prefix cache reset before each plan: ids equal True" in result.stdout
    assert (tmp_path / "profile" / "smoke-speculation-half.txt").is_file()  # one traced plan per regime
    assert (tmp_path / "profile" / "smoke-speculation-none.trace.json.gz").stat().st_size > 0
