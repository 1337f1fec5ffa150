"""`make demo` end to end, shortened: daemons, the model, the prefill engine, a restart."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_demo_serves_turns_from_the_cache_with_the_same_first_tokens():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # beside the other test worker on two cores
    out = subprocess.run([sys.executable, "-m", "engine.demo", "--sessions", "2", "--turns", "2"],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = re.search(r"(\d[\d,]*) of (\d[\d,]*) prompt tokens from the cache.*first tokens agree in (\d+) of (\d+)",
                        out.stdout)
    assert summary, out.stdout[-2000:]
    hit, total, same, requests = (int(g.replace(",", "")) for g in summary.groups())
    assert 0 < hit < total and same == requests == 4
    assert "SSD" in out.stdout and "restarted" in out.stdout
