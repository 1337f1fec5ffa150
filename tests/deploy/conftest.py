"""A real Prometheus on loopback, started per test and terminated with it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

START_S = 60.0  # a hang guard: Prometheus is up in a second or two


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Prometheus:
    """`prometheus` on 127.0.0.1 with the given scrape config, its TSDB in a temporary directory."""

    def __init__(self, config: str, root: Path) -> None:
        binary = shutil.which("prometheus")
        assert binary, "no prometheus binary: run `deploy/peers.sh prometheus` (make test-deploy does)"
        root.mkdir(parents=True, exist_ok=True)
        (root / "prometheus.yml").write_text(config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"], stdout=log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()

    def wait_ready(self) -> Prometheus:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited at start-up:\n{self.log()}"
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"prometheus did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def api(self, path: str, **params) -> dict:
        reply = httpx.get(self.url + path, params=params, timeout=30)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", f"{path} {params}: {reply.text}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector `expr` evaluates to now (a scalar as one sample)."""
        data = self.api("/api/v1/query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        return data["result"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()


@pytest.fixture
def prometheus(tmp_path):
    """prometheus(config) starts one; every one started is terminated (and reaped) at the end of the test."""
    started: list[Prometheus] = []

    def start(config: str) -> Prometheus:
        started.append(Prometheus(config, tmp_path / f"prometheus{len(started)}"))
        return started[-1].wait_ready()

    yield start
    for server in started:
        server.stop()
