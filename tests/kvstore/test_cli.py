"""The admin CLI against a real daemon, as a script would use it."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
PROMPT = "The quick brown fox jumps over the lazy dog; " * 4  # 180 bytes -> 11 blocks of 16


def kvstore(*args):
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, timeout=60)


def test_put_lookup_get_stats_fsck(daemons, tmp_path):
    daemon, = daemons(1)
    servers = ["--servers", daemon.address]
    assert "0 of 11 leading blocks" in kvstore("lookup", *servers, "--text", PROMPT).stdout
    put = kvstore("put", *servers, "--text", PROMPT, "--class", "agent")
    assert put.returncode == 0 and "stored 11" in put.stdout
    assert "11 of 11 leading blocks cached (176 tokens)" in kvstore("lookup", *servers, "--text", PROMPT).stdout
    other_tenant = kvstore("lookup", *servers, "--text", PROMPT, "--salt", "tenant-b")
    assert "0 of 11" in other_tenant.stdout
    got = kvstore("get", *servers, "--text", PROMPT, "--layers", "1:3", "--out", str(tmp_path / "out"))
    assert got.returncode == 0 and "11 of 11 leading blocks read and verified" in got.stdout
    assert len(list((tmp_path / "out").glob("*.kv"))) == 11
    stats = kvstore("stats", *servers, "--json")
    assert json.loads(stats.stdout)[daemon.address]["kvstore_blocks{traffic_class=agent}"] == 11
    assert "kvstore_puts_total" in kvstore("stats", *servers, "--grep", "puts").stdout
    daemon.stop()
    fsck = kvstore("fsck", str(daemon.data_dir))
    assert fsck.returncode == 0 and "11 index entries, 11 verified, 0 problems" in fsck.stdout


def test_bad_usage_and_unreachable_daemons(tmp_path):
    assert kvstore("lookup", "--servers", "127.0.0.1:1", "--text", "short").returncode == 2
    assert kvstore("lookup", "--servers", "nohost", "--tokens", "1,2").returncode == 2
    assert kvstore("fsck", str(tmp_path)).returncode == 2
    unreachable = kvstore("put", "--servers", "127.0.0.1:1", "--text", PROMPT, "--timeout", "0.5")
    assert unreachable.returncode == 1 and "failed 11" in unreachable.stdout
    assert kvstore("stats", "--servers", "127.0.0.1:1", "--timeout", "0.5").returncode == 1
