"""alpamayo-serve as a child process, for whoever needs a server next to them (benchmarks,
tests, a supervisor script): start it, wait until /health says ready, stop it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def serve_command() -> list[str]:
    """The installed console script when the package was installed with it, else `python -m`."""
    script = Path(sys.executable).with_name("alpamayo-serve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "alpamayo_ros.serve"]


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """One alpamayo-serve child on 127.0.0.1; its output goes to log_path.

    args: alpamayo-serve arguments besides --port (e.g. --checkpoint, --backend, --device).
    The port stays the same across stop()/start(), so clients can wait for a server's return.
    """

    def __init__(self, args: list[str], log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [*serve_command(), *args, "--port", str(self.port)]
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, ready_timeout_s: float = 600.0) -> ServerProcess:
        """Start and return once /health answers 200; RuntimeError (with the log's tail) if it
        exits or is not ready within ready_timeout_s."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"alpamayo-serve exited ({self.process.returncode}): {self._log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"alpamayo-serve not ready within {ready_timeout_s} s: {self._log_tail()}")

    def stop(self) -> None:
        """SIGTERM (uvicorn's graceful shutdown), SIGKILL if it has not ended after 30 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)

    def kill(self) -> None:
        """SIGKILL: the server gets no chance to close its connections."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(30)

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]
