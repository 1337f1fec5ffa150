"""Promotion (kvstore/server/promotion.py): blocks on SSD copied into the DRAM tier before a Get asks for them.

In-process stores (conftest.py) hold the worker where a test needs it to wait: a Get in flight is
`with store.gets_in_flight:`, as the transports count theirs. Real daemons check the rest end to end:
Advise and Lookup over gRPC, the next Get's tier, and a Get whose client never reads, on either transport,
not holding promotion back. The only clocks are hang guards: every wait is for a condition.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct

import grpc
import pytest

from kvstore import wire
from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.proto import method, pb
from kvstore.record import build_record
from kvstore.server.block_reader import OpenBlock
from kvstore.stats import Stats
from tests.pki import make_pki
from tests.waiting import wait_for, wait_for_async

from .conftest import put_all, records

HANG_GUARD_S = 30.0  # liveness only


def metric(store, name: str, **labels: str) -> float:
    return Stats(store.metrics.samples()).value(name, **labels)


async def let_others_run() -> None:
    """Give every other task on the loop its turns (not a clock: a worker free to act acts within these)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def on_ssd_only(store, recs) -> list[bytes]:
    """Store `recs` and drop their DRAM copies (a put keeps one), as a restart would; their keys."""
    await put_all(store, recs)
    keys = [block.key for block, *_ in recs]
    for key in keys:
        store.hot.discard(key)
    return keys


async def tier_of(store, key: bytes) -> str:
    """Where a read of `key` is served from ("dram" or "ssd"); the read is closed at once."""
    found = await store.open_block(key)
    assert isinstance(found, OpenBlock)
    store.close_block(found)
    return found.tier


@pytest.fixture
async def promoting(open_store):
    """promoting(**config) -> an opened BlockStore with its promotion worker running, as the daemon runs it."""
    workers = []

    async def make(**overrides):
        store = await open_store(**overrides)
        workers.append(asyncio.create_task(store.promoter.run()))
        return store

    yield make
    for worker in workers:
        worker.cancel()
    await asyncio.gather(*workers, return_exceptions=True)


# -- in process ----------------------------------------------------------------------------------------------


@pytest.mark.unit
async def test_advice_promotes_in_prefix_order_up_to_the_budget_and_reads_find_them_in_dram(promoting):
    recs = records(6)
    record_bytes = len(recs[0][1]) + len(recs[0][3])
    store = await promoting(promote_bytes=3 * record_bytes + record_bytes // 2)
    keys = await on_ssd_only(store, recs[1:])
    await put_all(store, recs[:1])  # the first block is in DRAM already: held there (in the budget), not read again
    keys = [recs[0][0].key, *keys]

    assert store.advise(keys, continues=True) == 6
    assert metric(store, "kvstore_promotion_in_dram_blocks_total") == 1
    await wait_for_async(lambda: metric(store, "kvstore_promoted_blocks_total") + metric(
        store, "kvstore_promotion_dropped_blocks_total") == 5, "promotion of the advised blocks")
    assert metric(store, "kvstore_promoted_blocks_total", reason="advice") == 2
    assert metric(store, "kvstore_promoted_bytes_total", reason="advice") == 2 * record_bytes
    assert metric(store, "kvstore_promotion_dropped_blocks_total", cause="budget") == 3
    assert [key in store.hot for key in keys] == [True, True, True, False, False, False], "the prefix, in order"
    store.refresh_gauges()
    assert metric(store, "kvstore_promoted_unread_bytes") == 3 * record_bytes

    assert await tier_of(store, keys[1]) == "dram"
    assert await tier_of(store, keys[1]) == "dram"
    assert metric(store, "kvstore_promoted_used_blocks_total") == 1, "counted at the first read only"
    assert store.hot.prefetched_bytes == 2 * record_bytes
    assert await tier_of(store, keys[3]) == "ssd"


@pytest.mark.unit
async def test_a_get_in_flight_holds_promotion_and_advice_that_ended_or_a_delete_take_keys_back(promoting):
    store = await promoting()
    keys = await on_ssd_only(store, records(4))
    with store.gets_in_flight:  # a Get being served: reads come first
        assert store.advise(keys, continues=True) == 4
        await let_others_run()
        assert len(store.promoter) == 4 and metric(store, "kvstore_promoted_blocks_total") == 0
        assert not any(key in store.hot for key in keys)
        store.advise(keys[:1], continues=False)
        assert await store.delete(keys[1:2]) == 1
        assert list(keys[2:]) == [key for key in keys if key in store.promoter]
        assert metric(store, "kvstore_promotion_cancelled_blocks_total") == 2
        with store.gets_in_flight:  # two at once: the first ending is not enough
            pass
        await let_others_run()
        assert metric(store, "kvstore_promoted_blocks_total") == 0
    await wait_for_async(lambda: metric(store, "kvstore_promoted_blocks_total", reason="advice") == 2,
                         "promotion once the Get ended")
    assert [key in store.hot for key in keys] == [False, False, True, True]
    assert len(store.promoter) == 0


@pytest.mark.unit
async def test_a_get_waiting_on_its_client_does_not_hold_promotion_back_and_one_making_progress_does(promoting):
    store = await promoting()
    keys = await on_ssd_only(store, records(4))
    gets = store.gets_in_flight
    with gets:  # a Get whose client has stopped reading
        with gets.waiting_on_client():
            with gets:  # and another, making progress
                store.advise(keys[:2], continues=True)
                await let_others_run()
                assert metric(store, "kvstore_promoted_blocks_total") == 0
            await wait_for_async(lambda: metric(store, "kvstore_promoted_blocks_total") == 2,
                                 "promotion while the only Get waits on its client")
        store.advise(keys[2:], continues=True)  # its client reads again: the Get goes on
        await let_others_run()
        assert metric(store, "kvstore_promoted_blocks_total") == 2
    await wait_for_async(lambda: metric(store, "kvstore_promoted_blocks_total") == 4, "promotion once it ended")
    assert (gets.count, gets.waiting) == (0, 0)


@pytest.mark.unit
async def test_lookup_with_promote_promotes_the_hit_prefix(promoting):
    store = await promoting()
    keys = await on_ssd_only(store, records(5))
    asked = keys[:3] + [os.urandom(16)] + keys[4:]  # a hole after three blocks: the hit is three long
    assert store.lookup(asked) == 3 and len(store.promoter) == 0, "a plain lookup promotes nothing"
    assert store.lookup(asked, promote=True) == 3
    await wait_for_async(lambda: metric(store, "kvstore_promoted_blocks_total", reason="lookup") == 3,
                         "promotion of the hit")
    assert [key in store.hot for key in keys] == [True, True, True, False, False]


@pytest.mark.unit
async def test_promote_bytes_zero_turns_promotion_off(promoting):
    store = await promoting(promote_bytes=0)
    keys = await on_ssd_only(store, records(2))
    assert store.advise(keys, continues=True) == 2 and store.lookup(keys, promote=True) == 2
    assert len(store.promoter) == 0
    assert not any(key in store.hot for key in keys)


@pytest.mark.unit
async def test_past_the_queue_bound_keys_are_dropped_and_counted(promoting):
    store = await promoting(promote_queue_keys=2)
    keys = await on_ssd_only(store, records(5))
    with store.gets_in_flight:
        assert store.promoter.enqueue(keys, "advice") == 2
        assert metric(store, "kvstore_promotion_dropped_blocks_total", cause="queue_full") == 3


def tenant_namespace(salt: str) -> Namespace:
    return Namespace("promotion-test", KVLayout(num_layers=4, kv_heads=1, head_dim=16, dtype="float16"),
                     block_tokens=8, salt=salt)


@pytest.mark.unit
async def test_one_tenants_unread_promotions_take_only_its_share_and_are_let_go_with_age(promoting, clock):
    mallory_recs = records(6, seed=1, namespace=tenant_namespace("mallory"))
    victim_recs = records(2, seed=2, namespace=tenant_namespace("victim"))
    record_bytes = len(mallory_recs[0][1]) + len(mallory_recs[0][3])
    store = await promoting(promote_bytes=4 * record_bytes, promote_max_age_s=60)
    mallory = await on_ssd_only(store, mallory_recs)
    victim = await on_ssd_only(store, victim_recs)

    def settled() -> float:
        return metric(store, "kvstore_promoted_blocks_total") + metric(store, "kvstore_promotion_dropped_blocks_total")

    assert store.lookup(mallory, promote=True) == 6  # its own blocks, never to be read
    await wait_for_async(lambda: settled() == 6, "the first tenant's promotions")
    assert metric(store, "kvstore_promotion_dropped_blocks_total", cause="budget") == 2, "alone: the whole budget"
    assert store.lookup(victim, promote=True) == 2
    await wait_for_async(lambda: settled() == 8, "the second tenant's promotions")
    assert metric(store, "kvstore_promoted_blocks_total") == 6, "the second tenant's are not dropped"
    assert metric(store, "kvstore_promotion_released_blocks_total", cause="share") == 2
    assert [await tier_of(store, key) for key in victim[:1]] == ["dram"]
    store.refresh_gauges()
    assert metric(store, "kvstore_promoted_unread_bytes") == 3 * record_bytes

    clock.advance(60)  # nobody reads the rest: they stop being held
    store.refresh_gauges()
    assert metric(store, "kvstore_promoted_unread_bytes") == 0
    assert metric(store, "kvstore_promotion_released_blocks_total", cause="age") == 3
    assert metric(store, "kvstore_promoted_wasted_blocks_total") == 5 and metric(
        store, "kvstore_promoted_used_blocks_total") == 1


# -- real daemons ----------------------------------------------------------------------------------------------

NS = Namespace("promotion-test", KVLayout(num_layers=4, kv_heads=1, head_dim=64, dtype="float16"), block_tokens=64)
# one 2 MiB block, read 40 times in one Get that is never taken: far past what sockets and HTTP/2 buffer
BIG = Namespace("promotion-big", KVLayout(num_layers=4, kv_heads=8, head_dim=128, dtype="float16"), block_tokens=128)
HELD_READS = 40


def chain(namespace: Namespace, n: int, seed: int):
    tokens = range(seed * 1_000_000, seed * 1_000_000 + n * namespace.block_tokens)
    return [(block, os.urandom(namespace.block_bytes)) for block in namespace.blocks(tokens)]


def record_bytes(items) -> int:
    return sum(len(header) + len(payload) for header, payload in
               (build_record(block, payload, NS.num_layers, "chat") for block, payload in items))


def stats(client: KVClient, daemon) -> Stats:
    found = client.server_stats()[daemon.address]
    assert found is not None
    return found


@pytest.mark.integration
def test_advice_and_lookup_promote_blocks_on_ssd_and_the_next_get_reads_them_from_dram(daemons):
    daemon, = daemons(1)
    advised, looked_up = chain(NS, 6, seed=1), chain(NS, 4, seed=2)
    with KVClient([daemon.address]) as writer:
        assert writer.put(advised + looked_up, NS.num_layers).stored == 10
    daemon.stop()
    daemon.start()  # a daemon starts with an empty DRAM tier: every block is on SSD alone

    with KVClient([daemon.address]) as client:
        assert client.advise([b for b, _ in advised], continues=True) == 6
        assert client.lookup([b for b, _ in looked_up], promote=True) == 4
        wait_for(lambda: stats(client, daemon).value("kvstore_promoted_blocks_total") == 10,
                 "the advised and looked-up blocks promoted")
        before = stats(client, daemon)
        assert before.by("kvstore_promoted_blocks_total", "reason") == {"advice": 6, "lookup": 4}
        assert before.value("kvstore_promoted_bytes_total") == record_bytes(advised + looked_up)
        assert before.value("kvstore_promoted_unread_bytes") == record_bytes(advised + looked_up)
        assert before.value("kvstore_hits_total") == 0

        for items in (advised, looked_up):
            assert [bytes(got.payload) for got in client.get([b for b, _ in items])] == [p for _, p in items]
        after = stats(client, daemon)
        assert after.by("kvstore_hits_total", "tier") == {"dram": 10}, "read from DRAM, none from SSD"
        assert after.value("kvstore_promoted_used_blocks_total") == 10
        assert after.value("kvstore_promoted_unread_bytes") == 0
        assert after.value("kvstore_promoted_wasted_blocks_total") == 0


class HeldGet:
    """A Get of one block read HELD_READS times whose answer is never taken, on gRPC or the data channel: the
    daemon serves it, blocked on flow control, until `release` ends it from this side."""

    def __init__(self, daemon, key: bytes, transport: str, tls: ssl.SSLContext | None = None) -> None:
        request = pb.GetRequest(keys=[key] * HELD_READS)
        self._stream = self._socket = self._channel = None
        if transport == "grpc":
            self._channel = grpc.insecure_channel(daemon.address, options=[("grpc.max_receive_message_length",
                                                                            2**30)])
            self._stream = self._channel.unary_stream(method("Get"), None, None)(request.SerializeToString(),
                                                                                timeout=HANG_GUARD_S)
        else:
            self._socket = socket.create_connection(("127.0.0.1", daemon.data_port), timeout=HANG_GUARD_S)
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: reset
            if tls is not None:
                self._socket = tls.wrap_socket(self._socket, server_hostname="127.0.0.1")
            self._socket.sendall(wire.frame(wire.GET, request.SerializeToString()))

    def release(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._channel.close()
        if self._socket is not None:
            self._socket.close()


@pytest.mark.integration
def test_a_get_whose_client_never_reads_does_not_hold_promotion_back_on_either_transport(daemons):
    daemon, = daemons(1, "--rpc-stream-timeout-s", "60", "--data-frame-timeout-s", "60")
    big, = chain(BIG, 1, seed=3)
    chains = {"grpc": chain(NS, 4, seed=4), "data": chain(NS, 4, seed=5)}
    with KVClient([daemon.address]) as writer:
        assert writer.put([big], BIG.num_layers).stored == 1
        assert writer.put(chains["grpc"] + chains["data"], NS.num_layers).stored == 8
    daemon.stop()
    daemon.start()

    promoted = 0
    with KVClient([daemon.address]) as client:
        for transport, items in chains.items():
            held = HeldGet(daemon, big[0].key, transport)
            try:
                wait_for(lambda: stats(client, daemon).value("kvstore_gets_in_flight") == 1,
                         f"the {transport} Get being served")
                assert client.advise([b for b, _ in items], continues=True) == 4
                promoted += 4
                wait_for(lambda: stats(client, daemon).value("kvstore_promoted_blocks_total") == promoted,
                         f"promotion while the {transport} Get waits for its client")
                now = stats(client, daemon)
                assert now.value("kvstore_gets_in_flight") == 1, "the Get is still open, its answer not taken"
                assert now.value("kvstore_gets_waiting_on_client") == 1
            finally:
                held.release()
            wait_for(lambda: stats(client, daemon).value("kvstore_gets_in_flight") == 0, f"the {transport} Get ended")
            assert stats(client, daemon).value("kvstore_gets_waiting_on_client") == 0
        before = stats(client, daemon).value("kvstore_hits_total", tier="dram")
        got = client.get([b for b, _ in chains["data"]])
        assert [bytes(g.payload) for g in got] == [p for _, p in chains["data"]]
        assert stats(client, daemon).value("kvstore_hits_total", tier="dram") == before + 4


@pytest.mark.integration
def test_one_tokens_lookup_promote_of_its_own_blocks_leaves_another_tenants_promotions_room(daemons):
    attacker, victim = (Namespace("promotion-test", NS.layout, block_tokens=64, salt=salt)
                        for salt in ("mallory", "victim"))
    mallory, theirs = chain(attacker, 6, seed=6), chain(victim, 2, seed=7)
    daemon, = daemons(1, "--promote-bytes", str(4 * record_bytes(mallory[:1])))
    with KVClient([daemon.address]) as writer:
        assert writer.put(mallory, NS.num_layers).stored == 6
        assert writer.put(theirs, NS.num_layers).stored == 2
    daemon.stop()
    daemon.start()  # every block on SSD alone

    with KVClient([daemon.address]) as client:
        def settled() -> float:
            now = stats(client, daemon)
            return now.value("kvstore_promoted_blocks_total") + now.value("kvstore_promotion_dropped_blocks_total")

        assert client.lookup([b for b, _ in mallory], promote=True) == 6  # and never read
        wait_for(lambda: settled() == 6, "the first tenant's promotions")
        assert client.lookup([b for b, _ in theirs], promote=True) == 2
        wait_for(lambda: settled() == 8, "the second tenant's promotions")
        assert stats(client, daemon).value("kvstore_promoted_blocks_total") == 6, "none of the second's dropped"
        assert [bytes(got.payload) for got in client.get([b for b, _ in theirs])] == [p for _, p in theirs]
        assert stats(client, daemon).by("kvstore_hits_total", "tier") == {"dram": 2}


def promoted_while_held(client: KVClient, daemon, held: list[HeldGet], items, gets: int) -> None:
    """Advise `items` while the `held` Gets are open (`gets` Gets in all), and see them promoted meanwhile."""
    before = stats(client, daemon).value("kvstore_promoted_blocks_total")
    try:
        wait_for(lambda: stats(client, daemon).value("kvstore_gets_in_flight") == gets, "the Gets being served")
        assert client.advise([b for b, _ in items], continues=True) == len(items)
        wait_for(lambda: stats(client, daemon).value("kvstore_promoted_blocks_total") == before + len(items),
                 "promotion while the Gets wait for their clients")
        assert stats(client, daemon).value("kvstore_gets_in_flight") == gets, "the Gets are still open"
    finally:
        for get in held:
            get.release()


@pytest.mark.integration
def test_grpc_gets_waiting_for_their_principals_send_budget_do_not_hold_promotion_back(daemons):
    # One 2 MiB payload takes a principal's whole 4 MiB (it is charged twice): the first Get's write waits
    # for its client, the second Get of the same peer waits for the budget that write holds.
    daemon, = daemons(1, "--rpc-stream-timeout-s", "60", "--max-grpc-send-bytes-per-principal", str(4 * 2**20))
    big, = chain(BIG, 1, seed=8)
    items = chain(NS, 4, seed=9)
    with KVClient([daemon.address]) as writer:
        assert writer.put([big], BIG.num_layers).stored == 1
        assert writer.put(items, NS.num_layers).stored == 4
    daemon.stop()
    daemon.start()
    with KVClient([daemon.address]) as client:
        held = [HeldGet(daemon, big[0].key, "grpc") for _ in range(2)]
        promoted_while_held(client, daemon, held, items, gets=2)


@pytest.mark.integration
def test_a_tls_data_channel_get_whose_client_never_reads_does_not_hold_promotion_back(daemons, tmp_path):
    pki = make_pki(tmp_path / "pki")
    daemon, = daemons(1, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                      "--data-frame-timeout-s", "60")
    config = ClientConfig((daemon.address,), tls_ca=str(pki.ca))
    big, = chain(BIG, 1, seed=10)
    items = chain(NS, 4, seed=11)
    with KVClient(config) as writer:
        assert writer.put([big], BIG.num_layers).stored == 1
        assert writer.put(items, NS.num_layers).stored == 4
    daemon.stop()
    daemon.start()
    with KVClient(config) as client:
        held = [HeldGet(daemon, big[0].key, "data", tls=ssl.create_default_context(cafile=str(pki.ca)))]
        promoted_while_held(client, daemon, held, items, gets=1)
