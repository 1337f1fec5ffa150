"""One verification pass on a same-host Get, and what finds corruption the daemon no longer checks for there.

The daemon does not check the bytes it reads from a segment file straight into a client's shared region; the
client checks every layer it receives. These tests break a block where each path would meet it and hold the
guarantee (docs/design.md section 10, invariant 1): the client gets a miss, never the bad bytes; it reports the
block (Verify), and the daemon drops it once its own check, in memory no client can write, agrees; a block
the client's own memory spoiled is kept; the scrub drops a corrupt block nobody reads.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.proto import method, pb
from kvstore.server.auth import new_token, token_entry
from kvstore.stats import Stats
from tests.waiting import wait_for

from .conftest import NS, client_for, items, raw_get, stats
from .test_corruption import flip, locate_records

pytestmark = pytest.mark.crash

DEADLINE_S = 60.0  # generous: a bound on a wait for the daemon, never what decides a test


def get_into_shared_memory(client: KVClient, stored) -> tuple[list[bytes], list[bytes]]:
    """A same-host Get of `stored` into a shared buffer: the payloads of the leading run it returned, and
    what the buffer holds afterwards."""
    memory = client.shared_buffer(len(stored) * NS.block_bytes)
    buffers = [memory[i * NS.block_bytes : (i + 1) * NS.block_bytes] for i in range(len(stored))]
    got = client.get([block for block, _ in stored], into=buffers)
    return [bytes(data.payload) for data in got], [bytes(buffer) for buffer in buffers]


def flip_payload(daemon, key: bytes, layer: int) -> None:
    where = locate_records(daemon.data_dir)[key]
    flip(where.path, where.offset + where.header.layer_offset(layer) + 7)


def test_a_block_corrupt_on_disk_read_into_shared_memory_is_a_miss_and_dropped_once_reported(daemons):
    daemon, = daemons(1, "--hot-tier-bytes", "0")  # every read from the segment file, straight into the region
    stored = items(500, 3)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == 3
    daemon.stop()
    flip_payload(daemon, stored[1][0].key, layer=2)
    daemon.start()

    with client_for(daemon) as client:
        hit, _ = get_into_shared_memory(client, stored)
        assert hit == [stored[0][1]], "the hit ends before the corrupt block: its bytes are never returned"
        assert client.stats.miss_causes["checksum"] == 1
    assert stats(daemon.address).value("kvstore_region_read_bytes_total") > 0, "the Get went through shared memory"
    # The client waits for its reports in flight as it closes.
    assert (client.stats.corrupt_reported, client.stats.corrupt_confirmed) == (1, 1)
    assert stats(daemon.address).value("kvstore_verify_corrupt_total", copy="ssd") == 1
    served = raw_get(daemon.address, [block.key for block, _ in stored])
    assert [s.status for s in served] == [pb.OK, pb.MISSING, pb.OK], "dropped: no reader meets it again"
    assert [served[0].payload, served[2].payload] == [stored[0][1], stored[2][1]]
    with client_for(daemon) as client:
        assert client.present([block for block, _ in stored]) == [True, False, True]


def test_a_corrupt_dram_tier_copy_is_a_miss_and_the_report_discards_it(daemons):
    # The first record the DRAM tier takes (the put's own copy) has a byte flipped: memory gone bad.
    daemon, = daemons(1, env={"KVSTORE_FAULTS": "hot_tier.put=flip@1"})
    stored = items(510, 1)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == 1
        hit, _ = get_into_shared_memory(client, stored)
        assert hit == [] and client.stats.miss_causes["checksum"] == 1
    assert (client.stats.corrupt_reported, client.stats.corrupt_confirmed) == (1, 1)
    assert stats(daemon.address).value("kvstore_verify_corrupt_total", copy="dram") == 1
    assert stats(daemon.address).value("kvstore_verify_corrupt_total", copy="ssd") == 0
    with client_for(daemon) as client:
        hit, _ = get_into_shared_memory(client, stored)
        assert hit == [stored[0][1]], "the bad copy is gone; the segment file's good one is served"
        assert client.stats.miss_causes["checksum"] == 0
    assert "dropping corrupt block" not in daemon.log()


BIG = Namespace("verify-big", KVLayout(num_layers=4, kv_heads=8, head_dim=128, dtype="float16"), block_tokens=256)


def test_a_client_that_spoils_its_own_region_reports_its_misses_and_no_block_is_lost(daemons):
    """4 MiB blocks, and a thread of the client writing over its shared buffer while it reads into it."""
    daemon, = daemons(1, "--hot-tier-bytes", "0")
    stored = [(b, os.urandom(BIG.block_bytes)) for b in BIG.blocks(range(4 * BIG.block_tokens))]
    with client_for(daemon) as client:
        assert client.put(stored, BIG.num_layers).stored == 4
        memory = client.shared_buffer(4 * BIG.block_bytes)
        buffers = [memory[i * BIG.block_bytes : (i + 1) * BIG.block_bytes] for i in range(4)]
        done = threading.Event()

        def scribble() -> None:
            junk = bytes(range(256)) * (BIG.layer_bytes // 256)
            while not done.is_set():
                for start in range(0, len(memory), BIG.layer_bytes):
                    memory[start : start + BIG.layer_bytes] = junk

        writer = threading.Thread(target=scribble, daemon=True)
        writer.start()
        try:
            deadline = time.monotonic() + DEADLINE_S
            while not client.stats.miss_causes["checksum"]:
                assert time.monotonic() < deadline, "no Get ever met the scribbled bytes"
                client.get([block for block, _ in stored], into=buffers)
        finally:
            done.set()
            writer.join(10)
    assert client.stats.corrupt_reported >= 1, "the misses were reported"
    assert client.stats.corrupt_confirmed == 0, "the daemon's own copies are good"
    assert stats(daemon.address).value("kvstore_verified_blocks_total") >= 1
    assert "dropping corrupt block" not in daemon.log()
    served = raw_get(daemon.address, [block.key for block, _ in stored])
    assert [s.payload for s in served] == [payload for _, payload in stored]


def test_the_scrub_drops_a_corrupt_block_nobody_reads(daemons):
    daemon, = daemons(1, "--scrub-bytes-per-s", "1GiB", "--scrub-pause-s", "0.05")
    stored = items(520, 6)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == 6
    # Damaged while the daemon runs (start-up would find a bad header itself): a payload byte, and a header's.
    flip_payload(daemon, stored[2][0].key, layer=3)
    where = locate_records(daemon.data_dir)[stored[4][0].key]
    flip(where.path, where.offset + 60)  # the traffic class: the header's checksum fails

    def counted(name: str) -> float:
        return stats(daemon.address).value(name)

    wait_for(lambda: counted("kvstore_scrub_corrupt_total") >= 2, "the scrub finding both")
    passes = counted("kvstore_scrub_passes_total")
    wait_for(lambda: counted("kvstore_scrub_passes_total") >= passes + 2, "a whole scrub pass after the drops")
    assert counted("kvstore_scrub_corrupt_total") == 2, "good blocks are never dropped"
    assert counted("kvstore_scrub_bytes_total") > 0 and counted("kvstore_misses_total") == 0, "nobody read them"
    with client_for(daemon) as client:
        assert client.present([block for block, _ in stored]) == [True, True, False, True, False, True]
    served = raw_get(daemon.address, [block.key for block, _ in stored])
    assert [s.payload for i, s in enumerate(served) if i not in (2, 4)] == \
        [payload for i, (_, payload) in enumerate(stored) if i not in (2, 4)]
    assert daemon.stop() == 0


# -- who may report what ----------------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=4, kv_heads=2, head_dim=32, dtype="float16")
ALICE = Namespace("verify", LAYOUT, block_tokens=16, salt="alice")
BOB = Namespace("verify", LAYOUT, block_tokens=16, salt="bob")
TOKENS = {name: new_token() for name in ("alice", "bob", "writer", "ops")}


def call(daemon, name: str, request, response, token: str):
    with grpc.insecure_channel(daemon.address) as channel:
        return channel.unary_unary(method(name), None, response.FromString)(
            request.SerializeToString(), metadata=(("authorization", f"Bearer {token}"),), timeout=10)


def verify(daemon, keys: list[bytes], token: str) -> int:
    return call(daemon, "Verify", pb.KeysRequest(keys=keys), pb.CountResponse, token).count


def verified_blocks(daemon) -> float:
    response = call(daemon, "Stats", pb.StatsRequest(), pb.StatsResponse, TOKENS["ops"])
    return Stats.from_pb(response).value("kvstore_verified_blocks_total")


def test_verify_reaches_only_the_callers_tenants(daemons, tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(token_entry("alice", TOKENS["alice"], [ALICE.tenant], ["read", "write"])
                    + token_entry("bob", TOKENS["bob"], [BOB.tenant], ["read", "write"])
                    + token_entry("writer", TOKENS["writer"], [BOB.tenant], ["write"])
                    + token_entry("ops", TOKENS["ops"], None, ["admin"]))
    daemon, = daemons(1, "--auth-tokens", str(path), "--hot-tier-bytes", "0")
    (block,) = BOB.blocks(range(16))
    with KVClient(ClientConfig((daemon.address,), token=TOKENS["bob"])) as client:
        assert client.put([(block, bytes(BOB.block_bytes))], LAYOUT.num_layers).stored == 1
    daemon.stop()
    flip_payload(daemon, block.key, layer=1)
    daemon.start()

    assert verify(daemon, [block.key] * 3, TOKENS["alice"]) == 0, "another tenant's block is as absent"
    with pytest.raises(grpc.RpcError) as refused:
        verify(daemon, [block.key], TOKENS["writer"])
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, "Verify is a reader's call"
    with KVClient(ClientConfig((daemon.address,), token=TOKENS["bob"])) as client:
        assert client.present([block]) == [True], "nothing was checked, let alone dropped"
    assert verified_blocks(daemon) == 0
    assert verify(daemon, [block.key], TOKENS["bob"]) == 1
    with KVClient(ClientConfig((daemon.address,), token=TOKENS["bob"])) as client:
        assert client.present([block]) == [False]



MALLORY = Namespace("verify", LAYOUT, block_tokens=16, salt="mallory")


def test_one_principals_verify_loop_is_held_to_its_budget_and_anothers_report_is_still_checked(daemons, tmp_path):
    # A rate of one byte a second: each principal's bucket allows one check, then none for hours; what is
    # checked here is decided by the budget alone, never by how fast the test runs.
    path = tmp_path / "tokens.toml"
    path.write_text(token_entry("mallory", TOKENS["alice"], [MALLORY.tenant], ["read"])
                    + token_entry("bob", TOKENS["bob"], [BOB.tenant], ["read"])
                    + token_entry("writer", TOKENS["writer"], [MALLORY.tenant, BOB.tenant], ["write"])
                    + token_entry("ops", TOKENS["ops"], None, ["admin"]))
    daemon, = daemons(1, "--auth-tokens", str(path), "--hot-tier-bytes", "0", "--verify-bytes-per-s", "1",
                      "--verify-recheck-s", "0")
    own = MALLORY.blocks(range(8 * 16))
    (reported,) = BOB.blocks(range(16))
    with KVClient(ClientConfig((daemon.address,), token=TOKENS["writer"])) as client:
        assert client.put([(block, bytes(MALLORY.block_bytes)) for block in own], LAYOUT.num_layers).stored == 8
        assert client.put([(reported, bytes(BOB.block_bytes))], LAYOUT.num_layers).stored == 1
    daemon.stop()
    flip_payload(daemon, reported.key, layer=1)
    daemon.start()

    for _ in range(4):  # a read-only token naming its own good blocks in a loop
        assert verify(daemon, [block.key for block in own], TOKENS["alice"]) == 0
    assert verified_blocks(daemon) == 1, "one check's worth of budget, whatever the loop asked"
    skipped = Stats.from_pb(call(daemon, "Stats", pb.StatsRequest(), pb.StatsResponse, TOKENS["ops"]))
    assert skipped.value("kvstore_verify_skipped_total", reason="rate") == 31
    assert verify(daemon, [reported.key], TOKENS["bob"]) == 1, "another principal's report is checked"
    with KVClient(ClientConfig((daemon.address,), token=TOKENS["bob"])) as client:
        assert client.present([reported]) == [False], "and the corrupt block dropped"
