"""The admin CLI against a real daemon, as a script would use it."""

import json
import os
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
    assert put.returncode == 0 and "stored 11" in put.stdout and len(put.stdout.splitlines()) == 1
    verbose = kvstore("put", *servers, "--text", PROMPT, "--class", "agent", "--verbose")
    assert "already present 11" in verbose.stdout and len(verbose.stdout.splitlines()) == 12  # and the keys
    assert "11 of 11 leading blocks cached (176 tokens)" in kvstore("lookup", *servers, "--text", PROMPT).stdout
    other_tenant = kvstore("lookup", *servers, "--text", PROMPT, "--salt", "tenant-b")
    assert "0 of 11" in other_tenant.stdout
    got = kvstore("get", *servers, "--text", PROMPT, "--layers", "1:3", "--out", str(tmp_path / "out"))
    assert got.returncode == 0 and "11 of 11 leading blocks read and verified" in got.stdout
    assert len(list((tmp_path / "out").glob("*.kv"))) == 11
    stats = kvstore("stats", *servers, "--json")
    assert {"name": "kvstore_blocks", "labels": {"traffic_class": "agent"}, "value": 11} \
        in json.loads(stats.stdout)[daemon.address]
    assert "kvstore_puts_total" in kvstore("stats", *servers, "--grep", "puts").stdout
    running = kvstore("fsck", str(daemon.data_dir), "--no-payload")
    assert "warning: a kvstore-server is using" in running.stderr and "index entries" in running.stdout
    daemon.stop()
    fsck = kvstore("fsck", str(daemon.data_dir))
    assert fsck.returncode == 0 and "11 index entries, 11 verified, 0 problems" in fsck.stdout
    assert "warning" not in fsck.stderr



def test_an_encoded_get_of_a_layer_range_writes_exactly_those_layers(daemons, tmp_path):
    daemon, = daemons(1)
    layout = ["--servers", daemon.address, "--text", PROMPT, "--codec", "zstd"]  # lossless: bytes compare
    layer_bytes = 2 * 16 * 2 * 64 * 2  # the CLI's default layout: K and V, 16 tokens, 2 heads of 64, bfloat16
    payloads = [os.urandom(4 * layer_bytes) for _ in range(11)]
    (tmp_path / "payloads").write_bytes(b"".join(payloads))
    put = kvstore("put", *layout, "--payload-file", str(tmp_path / "payloads"), "--verbose")
    assert put.returncode == 0 and "stored 11" in put.stdout, put
    keys = put.stdout.splitlines()[1:]
    got = kvstore("get", *layout, "--layers", "1:3", "--out", str(tmp_path / "out"))
    assert got.returncode == 0 and "11 of 11 leading blocks read and verified" in got.stdout, got
    assert [(tmp_path / "out" / f"{key}.kv").read_bytes() for key in keys] == \
        [payload[layer_bytes : 3 * layer_bytes] for payload in payloads]

def test_bad_usage_and_unreachable_daemons(tmp_path):
    assert kvstore("lookup", "--servers", "127.0.0.1:1", "--text", "short").returncode == 2
    assert kvstore("lookup", "--servers", "nohost", "--tokens", "1,2").returncode == 2
    assert kvstore("fsck", str(tmp_path)).returncode == 2
    unreachable = kvstore("put", "--servers", "127.0.0.1:1", "--text", PROMPT, "--timeout", "0.5")
    assert unreachable.returncode == 1 and "failed 11" in unreachable.stdout
    assert kvstore("stats", "--servers", "127.0.0.1:1", "--timeout", "0.5").returncode == 1
    lookup = kvstore("lookup", "--servers", "127.0.0.1:1", "--text", PROMPT, "--timeout", "0.5")
    assert lookup.returncode == 1 and "127.0.0.1:1 did not answer" in lookup.stderr  # not "0 of 11 cached"


def test_a_secured_cluster_from_the_command_line(daemons, tmp_path):
    """Tenant digests and tokens made with the CLI; a daemon that checks them; the CLI as a tenant and as ops."""
    tenant = kvstore("tenant", "acme-salt").stdout.strip()
    assert len(tenant) == 32 and kvstore("tenant", "other-salt").stdout.strip() != tenant
    tokens = tmp_path / "tokens.toml"
    engine = kvstore("token", "new", "--name", "acme-engine", "--tenants", tenant, "--verbs", "read,write",
                     "--append", str(tokens))
    ops = kvstore("token", "new", "--name", "ops", "--tenants", "*", "--verbs", "read,admin", "--append", str(tokens))
    engine_token, ops_token = engine.stdout.splitlines()[0], ops.stdout.splitlines()[0]
    assert engine_token not in tokens.read_text()
    assert kvstore("token", "new", "--name", "x", "--tenants", "beef", "--verbs", "read").returncode == 2
    daemon, = daemons(1, "--auth-tokens", str(tokens))
    servers = ["--servers", daemon.address, "--text", PROMPT, "--salt", "acme-salt"]
    assert "stored 0" in kvstore("put", *servers).stdout  # no token
    assert "stored 11" in kvstore("put", *servers, "--token", engine_token).stdout
    assert "11 of 11" in kvstore("lookup", *servers, "--token", engine_token).stdout
    other = ["--servers", daemon.address, "--text", PROMPT, "--salt", "other-salt", "--token", engine_token]
    assert "stored 0" in kvstore("put", *other).stdout  # a tenant the token does not reach
    assert kvstore("stats", "--servers", daemon.address, "--token", engine_token).returncode == 1
    stats = subprocess.run([sys.executable, "-m", "kvstore.cli", "stats", "--servers", daemon.address, "--json"],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "KVSTORE_TOKEN": ops_token})
    assert {"name": "kvstore_blocks", "labels": {"traffic_class": "chat"}, "value": 11} \
        in json.loads(stats.stdout)[daemon.address]


def test_every_command_says_why_a_daemon_failed_and_exits_non_zero(daemons, tmp_path):
    """A daemon down and a token refused each give their own reason on stderr and exit 1, never a count of
    misses with exit 0."""
    tokens = tmp_path / "tokens.toml"
    kvstore("token", "new", "--name", "ops", "--tenants", "*", "--verbs", "read,write,admin", "--append", str(tokens))
    daemon, = daemons(1, "--auth-tokens", str(tokens))
    down = ["--servers", "127.0.0.1:1", "--timeout", "0.5"]
    bad_token = ["--servers", daemon.address, "--token", "not-a-token"]
    for servers, reason in ((down, "127.0.0.1:1 did not answer"), (bad_token, "refused the call")):
        for command in ("put", "lookup", "get"):
            run = kvstore(command, *servers, "--text", PROMPT)
            assert run.returncode == 1 and reason in run.stderr and "Traceback" not in run.stderr, (command, run)
        stats = kvstore("stats", *servers)
        assert stats.returncode == 1 and reason in stats.stderr
        assert ("(refused the call)" if servers is bad_token else "(unreachable)") in stats.stdout
