"""A huge Lookup with the access log on: 65,536 keys took 0.2 s of the event loop
and wrote 0.54 MB of log, while other clients' Gets went from 2 to 82 ms. The loop now only queues a
line's fields for a writer thread, one call logs at most KEYS_PER_CALL keys, and what is not logged is
counted."""

from __future__ import annotations

import grpc
import pytest

from kvstore.proto import method, pb
from kvstore.server.access_log import KEYS_PER_CALL
from kvstore.server.key_digest import KeyDigest

from .conftest import NS, client_for, items, raw_get, stats

pytestmark = pytest.mark.crash


def test_one_lookup_logs_at_most_its_cap_and_counts_the_rest(daemons, tmp_path):
    log = tmp_path / "access.log"
    daemon, = daemons(1, "--access-log", str(log))
    stored = items(seed=2112, n=4)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == 4
    keys = [b.key for b, _ in stored] + [bytes([i % 256, i // 256]) * 8 for i in range(65_536 - 4)]
    with grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 8 * 2**20)]) as channel:
        lookup = channel.unary_unary(method("Lookup"), pb.LookupRequest.SerializeToString, pb.LookupResponse.FromString)
        assert lookup(pb.LookupRequest(keys=keys), timeout=60).hits == 4
    assert [s.payload for s in raw_get(daemon.address, [b.key for b, _ in stored])] == [p for _, p in stored]
    assert stats(daemon.address).value("kvstore_access_log_dropped_lines") >= 65_536 - KEYS_PER_CALL
    assert daemon.stop() == 0
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    lookups = [line for line in lines if line[1] == "lookup"]
    assert len(lookups) == KEYS_PER_CALL, "one call logs at most its cap"
    assert [line[4] for line in lookups[:5]] == ["hit"] * 4 + ["missing"]
    assert sum(1 for line in lines if line[1] == "get" and line[4] == "hit") == 4, "every other line is written"
    assert sum(1 for line in lines if line[1] == "put" and line[4] == "stored") == 4


def test_a_removal_is_logged_before_it_commits_and_survives_kill_9(daemons, tmp_path):
    """A removal's line is written through, not queued: after kill -9 the log still names the deleted block."""
    log = tmp_path / "access.log"
    daemon, = daemons(1, "--access-log", str(log), "--durability", "fsync")
    stored = items(seed=2113, n=3)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == 3
    with grpc.insecure_channel(daemon.address) as channel:
        delete = channel.unary_unary(method("Delete"), pb.KeysRequest.SerializeToString, pb.CountResponse.FromString)
        assert delete(pb.KeysRequest(keys=[stored[1][0].key, b"x" * 16]), timeout=10).count == 1
    daemon.kill()
    digest = KeyDigest(daemon.data_dir / "log-digest.key")
    removes = [line.split("\t") for line in log.read_text().splitlines() if line.split("\t")[1] == "remove"]
    assert [(line[2], line[4]) for line in removes] == [(digest(stored[1][0].key), "deleted")], \
        "one line, for the block that was held, with why"
    daemon.start()
