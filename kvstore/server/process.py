"""Run a kvstore-server as a child process on loopback (demo, benchmarks, tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class DaemonProcess:
    """A kvstore-server subprocess on 127.0.0.1; the OS picks its port on the first start and it keeps it."""

    def __init__(self, data_dir: Path, log_dir: Path, args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.log_path = Path(log_dir) / f"{self.data_dir.name}.log"
        self.args = list(args or [])
        self.env = env or {}
        self.port = 0
        self.metrics_port: int | None = None
        self.data_port: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, extra_env: dict[str, str] | None = None, timeout_s: float = 30.0) -> DaemonProcess:
        port_file = self.data_dir.with_suffix(".port")
        port_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.server.main", "--data-dir", str(self.data_dir),
                 "--port", str(self.port), "--port-file", str(port_file), "--data-port", "0", *self.args],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env, **(extra_env or {})})
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore-server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"kvstore-server did not start within {timeout_s} s:\n{self.log()}")
            time.sleep(0.02)
        port, metrics_port, data_port = port_file.read_text().split("\n")[:3]
        self.port = int(port)
        self.metrics_port = int(metrics_port) if metrics_port.strip() else None
        self.data_port = int(data_port) if data_port.strip() else None
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait for the graceful shutdown; the exit code."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        return self.proc.returncode if self.proc else 0

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0
