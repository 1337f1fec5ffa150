"""`kvstore analytics` on input it cannot use: one clear line naming the file, and an exit code."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("make, says", [
    (lambda d: d / "missing.jsonl", "cannot read"),
    (lambda d: d, "Is a directory"),
])
def test_a_trace_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, make, says):
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(make(tmp_path))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_timestamps_going_backwards_name_the_line(tmp_path):
    trace = tmp_path / "backwards.jsonl"
    trace.write_text('{"timestamp": 5, "input_length": 600, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 1, "input_length": 600, "hash_ids": [1, 3]}\n')
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(trace)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"{trace}:2: timestamp 1 goes back from 5" in done.stderr
