import hashlib
import json
import subprocess
import sys

import pytest

from kvstore.analytics.trace import (
    CONVERSATION_TRACE,
    CONVERSATION_TRACE_SHA256,
    Request,
    TraceError,
    conversation_turns,
    read_trace,
)

pytestmark = pytest.mark.unit

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}


def write(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ('[1, 2]', "not a JSON object"),
    (json.dumps({**GOOD, "hash_ids": [0]}), "1 hash_ids for 1000"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "input_length"}), "missing 'input_length'"),
    (json.dumps({**GOOD, "timestamp": -1}), "timestamp"),
    (json.dumps({**GOOD, "hash_ids": [0, "x"]}), "list of integers"),
])
def test_bad_lines_name_their_line_and_what_is_wrong(tmp_path, line, message):
    path = write(tmp_path, [json.dumps(GOOD), line, json.dumps(GOOD)])
    with pytest.raises(TraceError, match=f"trace.jsonl:2: .*{message}"):
        list(read_trace(path))
    errors: list[str] = []
    assert len(list(read_trace(path, skip_bad=True, errors=errors))) == 2 and len(errors) == 1


def test_the_cli_replays_a_trace_and_fails_precisely(tmp_path):
    lines = [json.dumps({"timestamp": i * 1000, "input_length": 2048, "output_length": 1,
                         "hash_ids": [0, 1 + i % 3, 10 + i % 3, 20 + i % 3]}) for i in range(30)]
    path = write(tmp_path, lines)
    out = tmp_path / "out.json"
    plot = tmp_path / "out.png"
    run = subprocess.run([sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(path), "--capacity",
                          "50%,6", "--json", str(out), "--plot", str(plot), "--reuse"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["unique_full_blocks"] == 10 and [r["capacity_blocks"] for r in report["rows"]] == [5, 6]
    assert report["infinite"]["hit_blocks"] == 4 * 30 - 10
    assert all(r["belady"]["token_hit_rate"] >= r["lru"]["token_hit_rate"] for r in report["rows"])
    assert plot.stat().st_size > 10_000 and "reuse distance" in run.stdout
    bad = write(tmp_path, lines[:3] + ["{oops"] + lines[3:])
    failed = subprocess.run([sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(bad)],
                            capture_output=True, text=True)
    assert failed.returncode == 2 and "trace.jsonl:4" in failed.stderr
    skipped = subprocess.run([sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(bad), "--skip-bad",
                              "--capacity", "5"], capture_output=True, text=True)
    assert skipped.returncode == 0 and "1 bad lines skipped" in skipped.stdout
    path.write_text("\n".join(lines) + "\n")
    advised = subprocess.run([sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(path), "--capacity", "5",
                              "--continuation-signal", "0.9", "--json", str(out)], capture_output=True, text=True)
    assert advised.returncode == 0 and "right 90% of the time" in advised.stdout
    assert json.loads(out.read_text())["continuation_signal"] == 0.9
    not_a_probability = subprocess.run([sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(path),
                                        "--continuation-signal", "1.5"], capture_output=True, text=True)
    assert not_a_probability.returncode == 2 and "not a probability" in not_a_probability.stderr


def test_conversation_turns_follow_the_prompts_that_hold_an_earlier_prompt():
    def request(*ids: int) -> Request:
        return Request(0, 512 * len(ids) + 100, 10, (*ids, 999))  # full blocks, then a partial one

    trace = [
        request(0, 1, 2),        # a first turn
        request(0, 1, 2, 3, 4),  # holds the first: turn 1
        request(0, 5),           # another conversation under the same system prompt (block 0)
        request(0, 1, 2, 3),     # holds the first, not the second: a branch at turn 1
        request(0, 1, 2, 3, 4, 6),  # holds the second (and the branch): turn 2
        request(0),              # the system prompt alone: a first turn, and nobody's predecessor
        request(0, 7),           # block 0 was the last prompt's end, but first blocks do not count
    ]
    assert conversation_turns(trace) == [0, 1, 0, 1, 2, 0, 0]


def test_the_shipped_conversation_trace_is_the_published_one():
    with open(CONVERSATION_TRACE, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == CONVERSATION_TRACE_SHA256
    requests = list(read_trace(CONVERSATION_TRACE))
    assert len(requests) == 12_031  # traces/README.md
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in requests)
