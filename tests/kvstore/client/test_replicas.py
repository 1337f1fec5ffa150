"""Copies of hot blocks over three real daemons: made on the next members in rendezvous order, read from
any holder with the reads spread, verified as always; and none where the daemons ask for none."""

import os

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.client.placement import ranked
from tests.waiting import wait_for

pytestmark = pytest.mark.multihost  # several daemons and clients copying between them: make test-multihost

NS = Namespace("replica-test", KVLayout(num_layers=2, kv_heads=1, head_dim=64, dtype="float16"), block_tokens=16)


def prompt(n_blocks: int, seed: int):
    tokens = [seed * 1_000_000 + i for i in range(n_blocks * NS.block_tokens)]
    return [(b, os.urandom(NS.block_bytes)) for b in NS.blocks(tokens)]


def read_bytes(client: KVClient) -> dict[str, float]:
    return {name: stats.value("kvstore_read_bytes_total") for name, stats in client.server_stats().items()}


def config(cluster) -> ClientConfig:
    return ClientConfig(tuple(d.address for d in cluster), timeout_s=2.0, down_backoff_s=0.1, max_down_backoff_s=0.3)


@pytest.mark.integration
def test_a_hot_prefix_is_copied_to_the_next_members_and_its_reads_spread(daemons):
    cluster = daemons(3, "--hot-replicas", "3", "--hot-reads", "3", "--hot-window-s", "60")
    items = prompt(2, seed=1)  # a shared system prompt: two blocks every request reads
    blocks = [b for b, _ in items]
    with KVClient(config(cluster)) as client:
        client.put(items, NS.num_layers)
        for _ in range(3):  # the third read makes them hot
            assert [d.payload for d in client.get(blocks)] == [p for _, p in items]
        wait_for(lambda: all(len(client._async.replicas.holders.get(b.key, ())) >= 2 for b in blocks),
                 "the copies made")
        for block in blocks:  # on the owner's two successors, which every client computes alike
            members = ranked(block.key, list(client._async.shards), 3)
            assert client._async.replicas.holders[block.key] == frozenset(members[1:])
        assert client.stats.copies_made == 4
        before = read_bytes(client)
        for _ in range(30):
            assert [bytes(d.payload) for d in client.get(blocks)] == [p for _, p in items]
        served = [read_bytes(client)[d] - before[d] for d in before]
        assert all(s > 0 for s in served)  # every member serves the hot prefix now, not just its owners
        assert max(served) / (sum(served) / 3) < 1.3
        assert client.stats.copy_reads >= 20  # at least the third member's share, all of it copies


@pytest.mark.integration
def test_a_copy_that_is_gone_is_read_elsewhere_after_one_miss(daemons):
    cluster = daemons(2, "--hot-replicas", "2", "--hot-reads", "2", "--hot-window-s", "60")
    items = prompt(1, seed=2)
    (block, payload), = items
    with KVClient(config(cluster)) as client, KVClient(config(cluster)) as other:
        client.put(items, NS.num_layers)
        client.get([block]), client.get([block])
        wait_for(lambda: client._async.replicas.holders.get(block.key), "the copy made")
        (holder,) = client._async.replicas.holders[block.key]
        with KVClient(ClientConfig((holder,))) as direct:
            assert direct.delete([block]) == 1  # the copy evicted under the client's feet
        results = [client.get([block]) for _ in range(4)]
        assert sum(1 for r in results if not r) <= 1  # at most the one read that found the copy gone
        assert not client._async.replicas.holders[block.key]
        assert all(bytes(r[0].payload) == payload for r in results if r)
        assert other.get([block])[0].header.key == block.key


@pytest.mark.integration
def test_no_copies_unless_the_daemons_ask(daemons):
    cluster = daemons(2)
    items = prompt(2, seed=3)
    with KVClient(config(cluster)) as client:
        client.put(items, NS.num_layers)
        for _ in range(50):
            client.get([b for b, _ in items])
        # a get orders its copies before it returns: none queued or being made means none are coming
        wait_for(lambda: not client._async.copier.orders._copying, "the copies ordered made")
        assert client.stats.copies_made == 0 and not client._async.replicas.holders
