"""`kvstore analytics` on input it cannot use: one clear line naming the file, and an exit code."""

import gzip
import json
import os
import pty
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


def replay_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "analytics", *args], capture_output=True, text=True,
                          timeout=60, **kwargs)


def good_lines(count: int) -> list[bytes]:
    return [json.dumps({"timestamp": i, "input_length": 1100, "hash_ids": [1, 2 + i % 2, 9 + i]}).encode()
            for i in range(count)]


@pytest.mark.parametrize("content, says", [
    (bytes(range(256)) * 40, "not text (a NUL byte at column 1): a binary file?"),
    (bytes(range(128, 256)) * 40, "not UTF-8 text (byte 0x80 at column 1): a binary file?"),
    (gzip.compress(b'{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n'), "a gzip-compressed file: decompress"),
], ids=["binary", "not-utf8", "gzip"])
def test_a_binary_trace_is_one_line_naming_it_and_exit_2(tmp_path, content, says):
    trace = tmp_path / "trace.bin"
    trace.write_bytes(content)
    done = replay_cli("replay", str(trace), "--policies", "lru", "--capacity", "2")
    assert done.returncode == 2 and f"{trace}:1: " in done.stderr and says in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_skip_bad_skips_and_counts_lines_that_are_not_utf8(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = good_lines(6)
    trace.write_bytes(b"\n".join(lines[:2] + [b"\xff\xfe not text", lines[2], b'{"timestamp": \xc3\x28}'] + lines[3:]))
    assert replay_cli("replay", str(trace), "--policies", "lru", "--capacity", "2").returncode == 2
    done = replay_cli("replay", str(trace), "--policies", "lru", "--capacity", "2", "--skip-bad")
    assert done.returncode == 0, done.stderr
    assert "6 requests" in done.stdout and "2 bad lines skipped" in done.stdout
    assert f"skipped {trace}:3: not UTF-8 text" in done.stderr and f"skipped {trace}:5: not UTF-8 text" in done.stderr


def test_an_access_log_line_that_is_not_utf8_is_named_or_skipped(tmp_path):
    log = tmp_path / "access.log"
    log.write_bytes(b"1000\tlookup\t9f2c\t-\thit\t-\t0\n\xff\xfe\n1001\tlookup\t77ab\t-\tmissing\t-\t0\n")
    failed = replay_cli("log", str(log))
    assert failed.returncode == 2 and f"{log}:2: not UTF-8 text" in failed.stderr and "Traceback" not in failed.stderr
    skipped = replay_cli("log", str(log), "--skip-bad")
    assert skipped.returncode == 0 and "1 bad lines skipped" in skipped.stdout


def test_no_progress_bar_unless_stderr_is_a_terminal(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(b"\n".join(good_lines(20)) + b"\n")
    piped = replay_cli("replay", str(trace), "--policies", "lru,sieve", "--capacity", "2")
    assert piped.returncode == 0 and "\r" not in piped.stderr
    assert "lru at 2: 20 requests in" in piped.stderr, "a line per replay instead"
    # on a terminal, the bar is rewritten in place
    leader, follower = pty.openpty()
    try:
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(trace), "--policies",
                               "lru", "--capacity", "2"], stdout=subprocess.PIPE, stderr=follower, timeout=60)
        os.close(follower)
        follower = None
        written = b""
        while chunk := _read(leader):
            written += chunk
    finally:
        os.close(leader)
        if follower is not None:
            os.close(follower)
    assert done.returncode == 0 and b"\r  2/2 replays, 40/40 requests" in written  # lru and belady


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # the terminal's other end is closed: all read
        return b""


def test_the_access_log_report_weighs_blocks_and_tokens_and_labels_each(tmp_path):
    rows = [("lookup", "a1", "-", "hit", "-", 0), ("lookup", "a2", "-", "hit", "-", 0),
            ("lookup", "a3", "-", "missing", "-", 0), ("lookup", "a4", "-", "missing", "-", 0),  # a call: 2 of 4
            ("lookup", "b1", "-", "hit", "-", 0), ("lookup", "b2", "-", "hit", "-", 0),
            ("lookup", "b3", "-", "hit", "-", 0),  # another: 3 of 3
            *[("get", key, "chat", "hit", "dram", 4096) for key in ("a1", "a2", "b1")],
            ("get", "b2", "chat", "expired", "-", 0),
            *[("get", key, "agent", "hit", "ssd", 4096) for key in ("c1", "c2")],
            ("put", "a3", "chat", "stored", "-", 5000), ("put", "a4", "chat", "exists", "-", 0)]
    log = tmp_path / "access.log"
    log.write_text("".join(f"{1000 + i}\t" + "\t".join(map(str, row)) + "\n" for i, row in enumerate(rows)))
    out = tmp_path / "log.json"
    done = replay_cli("log", str(log), "--block-tokens", "16", "--json", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    # 5 of the 7 blocks looked up were found; each is a full block of 16 tokens: 80 of 112 tokens
    assert (report["lookup_hits"], report["blocks_looked_up"]) == (5, 7)
    assert (report["lookup_tokens_found"], report["tokens_looked_up"]) == (80, 112)
    assert report["block_hit_rate"] == report["token_hit_rate"] == 5 / 7
    chat = report["by_class"]["chat"]
    assert (chat["hits"], chat["misses"], chat["tokens_served"], chat["tokens_asked"]) == (3, 1, 48, 64)
    assert chat["token_hit_rate"] == 0.75 and report["by_class"]["agent"]["token_hit_rate"] == 1.0
    assert "71.43% of blocks (blocks found in the cached leading run / blocks looked up)" in done.stdout
    assert "71.43% of tokens (80 tokens found / 112 looked up, at 16 a block" in done.stdout
    assert "75.00% of blocks read (served / asked), 75.00% of tokens (48 / 64)" in done.stdout
    assert "may not be flushed yet" in done.stdout, "just written: its daemon could still be running"
    assert replay_cli("log", str(log), "--block-tokens", "0").returncode == 2


def test_a_capacity_of_unknown_unit_says_so_and_a_size_asks_for_the_block_size():
    from kvstore.analytics.cli import parse_capacities

    with pytest.raises(ValueError, match="'10pc': unknown unit"):
        parse_capacities("10pc", 1000, 4096)
    with pytest.raises(ValueError, match="give --block-bytes"):
        parse_capacities("64MiB", 1000, 0)
    assert parse_capacities("10%,50,1MiB", 1000, 2**16) == [("10%", 100), ("50", 50), ("1MiB", 16)]
