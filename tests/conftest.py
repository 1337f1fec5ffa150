"""Shared fixtures: real kvstore-server daemons on loopback, started and stopped per test."""

from __future__ import annotations

import pytest

from kvstore.server.process import DaemonProcess


@pytest.fixture
def daemons(tmp_path):
    """daemons(n, *args) starts n daemons; all are stopped (or killed) at the end of the test."""
    started: list[DaemonProcess] = []

    def start(n: int = 1, *args: str, env: dict[str, str] | None = None) -> list[DaemonProcess]:
        new = []
        for _ in range(n):
            daemon = DaemonProcess(tmp_path / f"daemon{len(started)}", tmp_path, list(args), env)
            started.append(daemon)
            new.append(daemon.start())
        return new

    yield start
    for daemon in started:
        try:
            daemon.stop()
        except Exception:
            daemon.kill()
