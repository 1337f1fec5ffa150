"""One tenant cannot evict another's blocks: in a 32 MiB store, tenant A writing
2,000 blocks it never read evicted all 200 of tenant B's. With `tenant_max_share` below 1 a tenant past
its share of the budget loses its own least recently used blocks first."""

from __future__ import annotations

import os

import pytest

from kvstore.block import KVLayout, Namespace

from .conftest import client_for, stats

pytestmark = pytest.mark.crash

LAYOUT = KVLayout(num_layers=4, kv_heads=2, head_dim=64, dtype="float16")  # 64 KiB blocks
ALICE = Namespace("shares", LAYOUT, block_tokens=32, salt="alice")
BOB = Namespace("shares", LAYOUT, block_tokens=32, salt="bob")
STORE = ["--capacity-bytes", "32MiB", "--segment-bytes", "4MiB", "--hot-tier-bytes", "0"]


def blocks(namespace: Namespace, n: int, seed: int):
    return [(b, os.urandom(namespace.block_bytes)) for b in namespace.blocks(range(seed, seed + n * 32))]


def test_a_tenant_past_its_share_evicts_its_own_blocks_not_anothers(daemons):
    daemon, = daemons(1, *STORE, "--tenant-max-share", "0.5")
    bobs = blocks(BOB, 200, 0)  # 12.5 MiB, inside B's half
    with client_for(daemon) as client:
        assert client.put(bobs, LAYOUT.num_layers).stored == 200
        alices = blocks(ALICE, 2000, 10**6)  # 125 MiB that A never reads
        for start in range(0, len(alices), 100):
            client.put(alices[start : start + 100], LAYOUT.num_layers)
        assert client.lookup([b for b, _ in bobs]) == 200, "B's blocks were evicted by A's"
        got = client.get([b for b, _ in bobs])
        assert [d.payload for d in got] == [p for _, p in bobs]
        newest = [b for b, _ in alices[-100:]]
        assert client.lookup(newest) == 100, "A keeps its most recent blocks"
    assert stats(daemon.address).value("kvstore_share_evictions_total") >= 2000 - 16 * 2**20 // ALICE.block_bytes


def test_without_a_share_one_tenant_may_use_the_whole_store(daemons):
    """The default (1.0): a tenant alone uses all of the budget, as before."""
    daemon, = daemons(1, *STORE)
    alices = blocks(ALICE, 400, 0)  # 25 MiB, more than half of 32 and under the high watermark
    with client_for(daemon) as client:
        assert client.put(alices, LAYOUT.num_layers).stored == 400
        assert client.lookup([b for b, _ in alices]) == 400
    assert stats(daemon.address).value("kvstore_share_evictions_total") == 0
