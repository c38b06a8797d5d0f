"""bench/bench_discovery.py on the CPU: real node processes matched by the rig under two Fast DDS
transport settings, one trial each, so the bench behind the README's transport advice cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from alpamayo_ros.testing.rig import TRANSPORTS

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [TRANSPORTS, "UDPv4"]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.bench_discovery", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_each_setting_gets_its_trial_and_a_row(tmp_path: Path, tiny_checkpoint: Path) -> None:
    report_path = tmp_path / "report.json"
    args = ["--trials", "1", "--checkpoint", str(tiny_checkpoint), "--out", str(tmp_path / "run"),
            "--json", str(report_path)]
    for setting in SETTINGS:
        args += ["--transports", setting]
    result = bench(*args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    report = json.loads(report_path.read_text())
    assert list(report["settings"]) == SETTINGS
    for setting, row in report["settings"].items():
        assert row["trials"] == 1 and row["unmatched"] == 0, (setting, row)
        assert len(row["times_s"]) == 1, (setting, row)
        assert f"| `{setting}` |" in result.stdout
    assert not list((tmp_path / "run").glob("unmatched-*.log"))


def test_zero_trials_is_refused_by_name(tmp_path: Path) -> None:
    result = bench("--trials", "0", "--out", str(tmp_path))
    assert result.returncode == 2
    assert "--trials" in result.stderr
