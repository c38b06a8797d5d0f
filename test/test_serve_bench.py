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
