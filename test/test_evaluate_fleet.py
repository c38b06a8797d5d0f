"""alpamayo-eval --ray on a real local Ray instance (2 CPUs, no dashboard) with the tiny checkpoint.

The evaluator runs as a child process in its own session, as a user runs it, so the test can
kill one of its Ray workers and check afterwards that no process of the run is left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alpamayo_ros.testing.circle_drive import CAM_INDICES, CAM_TOPICS, write_circle_bag

TICKS = 5  # 0.5 ... 2.5 s at 2 Hz: the ticks from 2.0 s on have 1.5 s of history, so 2 plans per bag
PLANS_PER_BAG = 2
DISPATCHED = re.compile(r"(\S+) -> worker (\d+) \(pid (\d+)\), attempt 1")


@pytest.fixture(scope="module")
def bags(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("fleet_bags")
    return [write_circle_bag(root / f"drive_{k}", seed=k) for k in range(4)]


@pytest.fixture(scope="module")
def corrupt_bag(bags, tmp_path_factory) -> Path:
    """A copy of a good bag whose MCAP file lost its second half (metadata.yaml intact)."""
    bag = tmp_path_factory.mktemp("corrupt") / "truncated"
    shutil.copytree(bags[0], bag)
    (mcap,) = bag.glob("*.mcap")
    data = mcap.read_bytes()
    mcap.write_bytes(data[: len(data) // 2])
    return bag


@pytest.fixture(scope="module")
def params_file(tiny_checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fleet_params") / "eval.yaml"
    path.write_text(
        "/**:\n  ros__parameters:\n"
        f"    model.checkpoint_path: {tiny_checkpoint}\n"
        f"    cameras:\n      topics: {json.dumps(CAM_TOPICS)}\n      indices: {CAM_INDICES}\n"
        "      transports: [compressed, compressed]\n"
        "    planning.rate_hz: 2.0\n    sampling.max_reasoning_tokens: 4\n"
        "    images:\n      width: 24\n      height: 16\n")
    return path


def eval_command(bags: list[Path], params_file: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "alpamayo_ros.eval.cli", *map(str, bags), "--params-file", str(params_file),
            "--out", str(out), "--max-ticks", str(TICKS), "--no-progress", *extra]


def start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """The evaluator in a session of its own: everything it starts (Ray) shares its process group."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


def finish(process: subprocess.Popen, timeout_s: float = 600) -> str:
    """Wait for the run, then check no process of its session is left (Ray shut down with it)."""
    try:
        log, _ = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:  # ray.shutdown() returns before its last children have exited
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return log
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail("processes of the evaluator's Ray instance outlived it:\n" + log[-3000:])
        time.sleep(0.5)


def per_t0(doc: dict) -> dict[str, list[dict]]:
    """Each bag's ticks without timings (which depend on the machine, not the inputs)."""
    return {b["bag"]: [{k: v for k, v in t.items() if k != "timings_ms"} for t in b["ticks"]] for b in doc["bags"]}


def test_two_workers_give_the_single_process_report_and_report_a_corrupt_bag(bags, corrupt_bag, params_file, tmp_path):
    inputs = [*bags[:2], corrupt_bag, *bags[2:]]
    # Float sums depend on torch's thread count (1e-5 m apart), so both runs get one thread and the
    # numbers must be identical. Set for the fleet too: Ray keeps an OMP_NUM_THREADS its driver
    # inherits, and this test process may carry one (a suite run once handed it 2).
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = start(eval_command(inputs, params_file, tmp_path / "single"), env=one_thread)
    single_log = finish(single)
    assert single.returncode == 1, single_log  # a failed bag makes the run fail, after the report is written
    fleet = start(eval_command(inputs, params_file, tmp_path / "ray", "--ray", "--workers", "2"), env=one_thread)
    fleet_log = finish(fleet)
    assert fleet.returncode == 1, fleet_log
    assert fleet_log.count("1 torch thread(s)") == 2, fleet_log  # what the workers ran with

    want = json.loads((tmp_path / "single" / "report.json").read_text())
    got = json.loads((tmp_path / "ray" / "report.json").read_text())
    assert [b["bag"] for b in got["bags"]] == [str(b) for b in bags]  # job order, the corrupt one left out
    assert per_t0(got) == per_t0(want)
    assert got["summary"] == want["summary"] and got["summary"]["count"] == PLANS_PER_BAG * len(bags)
    for doc in (want, got):
        (failed,) = doc["failed"]
        assert failed["bag"] == str(corrupt_bag) and failed["error"] and failed["attempts"] == 1
    workers = got["workers"]
    assert len(workers) == 2 and all(w["bags"] >= 1 for w in workers) and sum(w["bags"] for w in workers) == len(bags)
    assert sum(w["plans"] for w in workers) == got["summary"]["count"]
    assert got["busy_s"] == pytest.approx(sum(w["busy_s"] for w in workers), abs=0.01) and want["busy_s"] > 0
    assert all(w["plans_per_s"] > 0 and w["deaths"] == 0 for w in workers) and got["worker_deaths_retried"] == 0
    md = (tmp_path / "ray" / "report.md").read_text()
    assert "## Failed bags" in md and corrupt_bag.name in md and "## Ray workers" in md
    assert all((tmp_path / "ray" / p).is_file() for p in got["plots"])


def test_a_killed_worker_loses_nothing(bags, params_file, tmp_path):
    fleet = start(eval_command(bags, params_file, tmp_path / "ray", "--ray", "--workers", "2"))
    lines, killed = [], None
    for line in fleet.stdout:  # kill the first worker that is handed a bag
        lines.append(line)
        match = DISPATCHED.search(line)
        if match:
            killed = int(match.group(3))
            os.kill(killed, signal.SIGKILL)
            break
    log = "".join(lines) + finish(fleet)
    assert killed is not None, log
    assert fleet.returncode == 0, log
    doc = json.loads((tmp_path / "ray" / "report.json").read_text())
    assert sorted(b["bag"] for b in doc["bags"]) == sorted(map(str, bags))  # every bag scored, once
    assert doc["failed"] == [] and doc["summary"]["count"] == PLANS_PER_BAG * len(bags)
    assert doc["worker_deaths_retried"] == 1 and sum(w["deaths"] for w in doc["workers"]) == 1
    dead = next(w for w in doc["workers"] if killed in w["pids"])
    # replaced by a fresh worker: up, or still starting when the other worker had scored every bag
    assert dead["deaths"] == 1 and (len(dead["pids"]) == 2) != dead["replacement_starting"]
    assert f"pid {killed}) died" in log


def test_evaluator_and_workers_import_without_ros(tmp_path):
    """rclpy, the ROS message packages and our messages made unimportable: the evaluator still loads."""
    code = (
        "import importlib.abc, sys\n"
        "HIDDEN = ('rclpy', 'rosidl_runtime_py', 'rosidl_parser', 'alpamayo_ros_msgs', 'sensor_msgs', 'nav_msgs',\n"
        "          'std_msgs', 'geometry_msgs', 'builtin_interfaces', 'rosgraph_msgs', 'diagnostic_msgs', 'rcl_interfaces')\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in HIDDEN:\n"
        "            raise ModuleNotFoundError(f'hidden: {name}')\n"
        "sys.meta_path.insert(0, Hide())\n"
        "import alpamayo_ros.eval.evaluate, alpamayo_ros.eval.jobs, alpamayo_ros.eval.fleet, alpamayo_ros.eval.report\n"
        "try:\n"
        "    import rclpy\n"
        "except ModuleNotFoundError:\n"
        "    print('ros hidden')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("ros hidden")


def test_ctrl_c_keeps_the_finished_bags(bags, params_file, tmp_path):
    """SIGINT after the first bag is scored: exit 130, that bag in the report, the rest listed as not evaluated."""
    fleet = start(eval_command(bags, params_file, tmp_path / "ray", "--ray", "--workers", "1"))
    lines, finished = [], None
    for line in fleet.stdout:
        lines.append(line)
        match = re.search(r"(\S+): \d+ ticks, \d+ plans on worker", line)
        if match:
            finished = match.group(1)
            fleet.send_signal(signal.SIGINT)
            break
    log = "".join(lines) + finish(fleet)
    assert finished is not None and fleet.returncode == 130, log
    doc = json.loads((tmp_path / "ray" / "report.json").read_text())
    assert doc["interrupted"] and finished in [b["bag"] for b in doc["bags"]]
    assert doc["summary"]["count"] >= PLANS_PER_BAG and doc["failed"] == []
    assert sorted([b["bag"] for b in doc["bags"]] + doc["unfinished"]) == sorted(map(str, bags))
    assert "Interrupted" in (tmp_path / "ray" / "report.md").read_text()
