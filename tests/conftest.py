"""Shared fixtures: real kvstore-server daemons on loopback, started and stopped per test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


class Daemon:
    """A kvstore-server subprocess on 127.0.0.1 with a port chosen by the OS."""

    def __init__(self, data_dir: Path, log_dir: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.log_path = log_dir / f"{data_dir.name}.log"
        self.args = args
        self.env = env or {}
        self.port = 0  # after the first start the daemon keeps its port, so clients see it return
        self.metrics_port: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, extra_env: dict[str, str] | None = None, wait: bool = True) -> "Daemon":
        port_file = self.data_dir.with_suffix(".port")
        port_file.unlink(missing_ok=True)
        env = {**os.environ, **self.env, **(extra_env or {})}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.server.main", "--data-dir", str(self.data_dir),
             "--port", str(self.port), "--port-file", str(port_file), *self.args],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        if wait:
            deadline = time.monotonic() + 30
            while not port_file.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvstore-server exited with {self.proc.returncode}:\n{self.log()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"kvstore-server did not start:\n{self.log()}")
                time.sleep(0.02)
            ports = port_file.read_text().split("\n")
            self.port = int(ports[0])
            self.metrics_port = int(ports[1]) if ports[1].strip() else None
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=20)
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


@pytest.fixture
def daemons(tmp_path):
    """daemons(n, *args) starts n daemons; all are stopped (or killed) at the end of the test."""
    started: list[Daemon] = []

    def start(n: int = 1, *args: str, env: dict[str, str] | None = None) -> list[Daemon]:
        new = []
        for _ in range(n):
            daemon = Daemon(tmp_path / f"daemon{len(started)}", tmp_path, list(args), env)
            started.append(daemon)
            new.append(daemon.start())
        return new

    yield start
    for daemon in started:
        try:
            daemon.stop()
        except Exception:
            daemon.kill()
