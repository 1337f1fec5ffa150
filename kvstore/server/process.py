"""Run a kvstore-server as a child process on loopback (demo, benchmarks, tests)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIND_ATTEMPTS = 10  # starts tried when the daemon's port turns out taken


class DaemonProcess:
    """A kvstore-server subprocess on 127.0.0.1, on a port it keeps across restarts.

    The port is picked below the OS's ephemeral range: a port the OS picked (port 0) is one that any
    outgoing connection may take as its source port while the daemon is down, and the restart would then
    find it in use."""

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
        first = self.port == 0
        for attempt in range(BIND_ATTEMPTS):
            if first:
                self.port = _unused_port()
            try:
                return self._start(extra_env, timeout_s)
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == BIND_ATTEMPTS - 1:
                    raise
                time.sleep(0.0 if first else 0.5)  # another process took it: a new port, or a moment
        raise AssertionError("unreachable")

    def _start(self, extra_env: dict[str, str] | None, timeout_s: float) -> DaemonProcess:
        port_file = self.data_dir.with_suffix(".port")
        port_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.server.main", "--data-dir", str(self.data_dir),
                 "--port", str(self.port), "--port-file", str(port_file), "--data-port", "0",
                 "--exit-on-stdin-eof", "true", *self.args],
                stdin=subprocess.PIPE,  # held open until stop() or kill(): if this process dies, the daemon ends
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env, **(extra_env or {})})
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if self.proc.poll() is not None:
                self._close_stdin()
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
        self._close_stdin()

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait for the graceful shutdown; the exit code."""
        try:
            if self.proc and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    return self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.report_stacks()
                    self.kill()
                    raise
            return self.proc.returncode if self.proc else 0
        finally:
            self._close_stdin()

    def report_stacks(self) -> None:
        """Have the daemon write where its threads and asyncio tasks are into its log (kvstore.server.main,
        report_stacks_on_signals): for a daemon about to be killed because it did not stop."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig in (signal.SIGUSR2, signal.SIGUSR1):
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=2)  # time to write the stacks; it is killed next either way
        except subprocess.TimeoutExpired:
            pass

    def _close_stdin(self) -> None:
        if self.proc and self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def rss_bytes(self) -> int:
        if self.proc is None:
            raise RuntimeError("the daemon has not been started")
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0


def _unused_port() -> int:
    """A free TCP port on 127.0.0.1 below the ephemeral range (another process may still take it: the
    start retries)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    while True:
        port = random.randrange(10000, max(10001, low))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
