"""bench/bench_serve.py runs on the CPU with a tiny checkpoint, so the GPU command cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_serve_smoke_reports_remote_overhead(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_serve.py"), "--smoke", "--runs", "2", "--warmup", "0",
         "--json-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "serve-smoke.json").read_text())
    assert (report["backend"], report["device"], report["runs"]) == ("hf", "cpu", 2)
    remote_measures = ("wall", "total", "overhead", "remote.resize", "remote.encode", "serve.parse")
    shm_measures = (*remote_measures, "remote.shm_write", "serve.resize")  # the server resizes shm frames
    for path, measures in (("remote_shm_ms", shm_measures), ("remote_delta_ms", remote_measures),
                           ("remote_full_ms", remote_measures), ("in_process_ms", ("wall", "total"))):
        for measure in measures:
            assert 0 < report[path][measure]["p50"] <= report[path][measure]["p99"], (path, measure)
    for mode in ("shm", "delta", "full"):  # the client's wall time holds the server's plan, plus what the remote path adds
        assert report[f"remote_{mode}_ms"]["wall"]["p50"] > report[f"remote_{mode}_ms"]["total"]["p50"]
        assert report[f"remote_{mode}_ratio_p50"] > 0
    # the second plan of the stream sends only its new frames; through shared memory, none in the body
    assert report["remote_shm_frames_sent_p50"] == report["remote_delta_frames_sent_p50"] < report["remote_full_frames_sent_p50"]
    assert report["remote_shm_bytes_sent_p50"] < report["remote_delta_bytes_sent_p50"] < report["remote_full_bytes_sent_p50"]
    assert "remote / in-process" in result.stdout
    # the server's pipeline is timed stage by stage beside the in-process one; shm reads are timed apart
    for path in ("in_process_ms", "remote_shm_ms", "remote_delta_ms", "remote_full_ms"):
        assert {"preprocess", "prompt", "backbone", "expert", "action"} <= set(report[path]), path
    assert 0 < report["remote_shm_ms"]["serve.shm_read"]["p50"] <= report["remote_shm_ms"]["serve.parse"]["p50"]


def test_serve_stages_probe_reports_every_stage_of_each_mode(tmp_path: Path) -> None:
    """bench/serve_stages.py (the model-free probe of the serving path) runs against a baseline
    tree as well: here this tree twice, so both columns come from the same code."""
    out = tmp_path / "stages.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve_stages.py"), "--workload", "smoke", "--runs", "2", "--warmup", "1",
         "--torch-threads", "1", "--baseline-src", str(ROOT), "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    medians = json.loads(out.read_text())["medians"]
    assert set(medians) == {"before", "after"}
    for column in medians.values():
        assert set(column["modes"]) == {"shm", "delta", "full"} and column["in_process_ms"] > 0
        shm, delta = column["modes"]["shm"], column["modes"]["delta"]
        assert shm["remote.shm_write"] > 0 and shm["serve.shm_read"] > 0 and shm["serve.resize"] > 0
        assert delta["remote.shm_write"] == 0 and delta["serve.resize"] == 0  # resized on the client instead
        for mode in column["modes"].values():
            assert mode["wall"] >= mode["preprocess"] > 0
    assert "**overhead**" in result.stdout
