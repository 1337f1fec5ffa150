"""Prefetches into the client's host tier (kvstore/client/prefetch.py) from real daemons on loopback.

A writer without a host tier stores the blocks, so that only a prefetch can bring them into the reader's.
Every wait is for a condition, bounded by a hang guard.
"""

from __future__ import annotations

import os

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import AsyncKVClient, ClientConfig, KVClient
from tests.waiting import wait_for, wait_for_async

pytestmark = pytest.mark.integration

NS = Namespace("prefetch-test", KVLayout(num_layers=2, kv_heads=1, head_dim=32, dtype="float16"), block_tokens=16)


def conversation(n_blocks: int, seed: int):
    tokens = range(seed * 1_000_000, seed * 1_000_000 + n_blocks * NS.block_tokens)
    return [(block, os.urandom(NS.block_bytes)) for block in NS.blocks(tokens)]


def reader_config(daemons, slots: int = 8, **overrides) -> ClientConfig:
    return ClientConfig(tuple(d.address for d in daemons), host_tier_bytes=slots * NS.block_bytes,
                        host_block_bytes=NS.block_bytes, timeout_s=2.0, down_backoff_s=0.1, max_down_backoff_s=0.3,
                        **overrides)


def stored(daemons, *conversations) -> None:
    with KVClient([d.address for d in daemons]) as writer:  # no host tier of its own
        for items in conversations:
            assert writer.put(items, NS.num_layers).stored == len(items)


def test_prefetched_blocks_are_read_from_the_host_tier(daemons):
    cluster = daemons(2)
    items = conversation(6, seed=1)
    stored(cluster, items)
    blocks = [b for b, _ in items]
    with KVClient(reader_config(cluster)) as reader:
        assert reader.block_sources(blocks)[0] != "host"
        assert reader.prefetch(blocks) == 6
        wait_for(lambda: reader.stats.prefetched == 6, "the prefetch landing")
        assert reader.block_sources(blocks) == ["host"] * 6
        assert reader.prefetch(blocks) == 0, "held already: nothing to fetch"
        assert [bytes(got.payload) for got in reader.get(blocks)] == [p for _, p in items]
        assert reader.stats.tier_hits == {"host": 6}
        assert reader.stats.prefetch_used == 6
        assert reader.stats.prefetch_missed == reader.stats.prefetch_wasted == 0
        assert reader.stats.hit_blocks == 0, "the prefetch's own Gets are no hits"


def test_an_unread_prefetch_evicted_is_wasted_and_past_prefetch_bytes_blocks_are_refused(daemons):
    cluster = daemons(1)
    prefetched, read = conversation(5, seed=2), conversation(2, seed=3)
    stored(cluster, prefetched, read)
    with KVClient(reader_config(cluster, slots=2, prefetch_bytes=2 * NS.block_bytes)) as reader:
        assert reader.prefetch([b for b, _ in prefetched]) == 2  # a host slot each, two in flight at most
        assert reader.stats.prefetch_refused == 3
        wait_for(lambda: reader.stats.prefetched == 2, "the prefetch landing")
        # kept in the host tier, whose slots hold only unread prefetches: the first read block takes the oldest
        # one's; the second passes the other over and takes the first read block's
        assert len(reader.get([b for b, _ in read])) == 2
        assert reader.stats.prefetch_wasted == 1 and reader.stats.prefetch_used == 0
        assert reader.prefetch([b for b, _ in prefetched[2:4]]) == 2, "the budget is free again"


@pytest.mark.kills_daemons  # left dead on purpose: a dead daemon is what it tests
def test_a_prefetch_from_a_dead_daemon_is_a_counted_miss_never_an_exception(daemons):
    cluster = daemons(1)
    items = conversation(3, seed=4)
    stored(cluster, items)
    cluster[0].kill()
    with KVClient(reader_config(cluster)) as reader:
        assert reader.prefetch([b for b, _ in items]) == 3
        wait_for(lambda: reader.stats.prefetch_missed == 3, "the failed prefetch counted")
        assert reader.stats.prefetched == 0 and reader.stats.shard_errors[cluster[0].address] >= 1
        assert reader.prefetch([b for b, _ in items]) == 3, "nothing held back by the failure"
        wait_for(lambda: reader.stats.prefetch_missed == 6, "the prefetch from the down daemon missed too")


def test_blocks_larger_than_a_host_slot_are_skipped_and_counted(daemons):
    cluster = daemons(1)
    items = conversation(2, seed=5)
    stored(cluster, items)
    config = ClientConfig((cluster[0].address,), host_tier_bytes=4 * NS.block_bytes,
                          host_block_bytes=NS.block_bytes // 2)
    with KVClient(config) as reader:
        assert reader.prefetch([b for b, _ in items]) == 2  # the block size shows only once they arrive
        wait_for(lambda: reader.stats.prefetch_too_large == 2, "the oversized blocks counted")
        assert reader.prefetch([b for b, _ in items]) == 0 and reader.stats.prefetch_too_large == 4
        assert reader.stats.prefetched == 0 and len(reader.host) == 0


async def test_cancel_prefetch_takes_queued_blocks_back(daemons):
    cluster = daemons(1)
    items = conversation(4, seed=6)
    stored(cluster, items)
    blocks = [b for b, _ in items]
    async with AsyncKVClient(reader_config(cluster)) as reader:
        # The worker runs on this loop: between these two plain calls it cannot have started.
        assert reader.prefetch(blocks) == 4
        assert reader.cancel_prefetch(blocks[2:]) == 2
        assert reader.stats.prefetch_cancelled == 2
        await wait_for_async(lambda: not reader.prefetcher.pending, "the prefetch landing")
        assert reader.stats.prefetched == 2
        assert reader.host is not None and [b.key in reader.host for b in blocks] == [True, True, False, False]
        assert reader.cancel_prefetch(blocks) == 0, "nothing left to stop"
