"""Start `alpamayo-egodriver` as a child process and wait until its port is open (demo, bench, tests)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

READY_PREFIX = "alpamayo-egodriver listening on "


@dataclass
class EgodriverProcess:
    """A running service: its process, its address, and the stderr it wrote (its log)."""

    process: subprocess.Popen
    address: str
    log: list[str] = field(default_factory=list)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_egodriver(args: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 300.0,
                    log_path: Path | None = None) -> EgodriverProcess:  # fmt: skip
    """Run `python -m alpamayo_ros.sim.cli ARGS --port 0` and return once it listens.

    Raises RuntimeError with the log's tail when it exits or does not listen within timeout_s.
    """
    command = [sys.executable, "-m", "alpamayo_ros.sim.cli", *args, "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})})  # fmt: skip
    log: list[str] = []

    def drain() -> None:  # keep the pipe from filling; the log is read on failure
        with open(log_path, "a") if log_path else open(os.devnull, "w") as out:
            for line in process.stderr:
                log.append(line)
                out.write(line)
                out.flush()

    threading.Thread(target=drain, daemon=True).start()
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    address = None
    while address is None and process.poll() is None and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line.startswith(READY_PREFIX):
            address = line[len(READY_PREFIX):].strip()
    if address is None:
        process.kill()
        process.wait()
        tail = "".join(log[-20:])
        raise RuntimeError(f"alpamayo-egodriver did not start within {timeout_s:.0f} s (exit {process.returncode}):\n{tail}")
    return EgodriverProcess(process=process, address=address, log=log)
