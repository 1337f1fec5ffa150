"""Ordinary start-up mistakes end the daemon in one line on stderr that says what to change, with exit status 2
and no traceback (kvstore/startup.py); without --data-dir it says that it uses ./data."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's code, from any working directory


def daemon(*args: str, cwd: Path) -> list[str]:
    """Start kvstore-server with `args` (its normal log at WARNING, so that stderr holds only what goes wrong);
    the lines it printed on stderr, once it ended with status 2."""
    run = subprocess.run([sys.executable, "-m", "kvstore.server.main", "--log-level", "warning", "--port", "0",
                          "--data-port", "0", "--data-socket", "off", *args],
                         capture_output=True, text=True, timeout=60, cwd=cwd, env=ENV, stdin=subprocess.DEVNULL)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    return run.stderr.splitlines()


@pytest.fixture
def taken_port():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--data-port"])
def test_a_port_in_use_is_named_with_its_flag(flag, taken_port, tmp_path):
    (line,) = daemon("--data-dir", str(tmp_path / "d"), flag, str(taken_port), cwd=tmp_path)
    assert f"127.0.0.1:{taken_port}" in line and flag in line and "in use" in line


def test_a_data_dir_that_cannot_be_made(tmp_path):
    (line,) = daemon("--data-dir", "/proc/kvstore", cwd=tmp_path)
    assert "/proc/kvstore" in line and "--data-dir" in line


def test_a_data_dir_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("")
    (line,) = daemon("--data-dir", str(tmp_path / "afile"), cwd=tmp_path)
    assert str(tmp_path / "afile") in line and "a file is there, not a directory" in line and "--data-dir" in line


def test_without_data_dir_it_says_it_uses_data(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.server.main", "--port", "0", "--data-port", "0",
                             "--exit-on-stdin-eof"], cwd=tmp_path, env=ENV, stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        said = []
        for line in proc.stderr:  # until it serves (or ends)
            said.append(line)
            if "serving on" in line:
                break
        notice = [line for line in said if "data directory" in line]
        assert notice and str(tmp_path / "data") in notice[0] and "the default" in notice[0], "".join(said)
    finally:
        proc.stdin.close()  # --exit-on-stdin-eof: it shuts down as on SIGTERM
        assert proc.wait(30) == 0
        proc.stderr.close()
