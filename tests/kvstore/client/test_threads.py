"""The client's thread model: one event loop thread and one bounded pool, whatever the number of calls."""

import os
import threading

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.client.loader import LoadWork
from kvstore.client.loading import BufferDestination, LoadProgress
from kvstore.client.write_behind import WriteBehind
from tests.waiting import parked_in, wait_for

NS = Namespace("threads", KVLayout(num_layers=4, kv_heads=2, head_dim=32, dtype="float16"), block_tokens=16)


def conversation(n_blocks: int, seed: int = 0):
    return [(b, os.urandom(NS.block_bytes)) for b in NS.blocks(range(seed * 10**6, seed * 10**6 + n_blocks * 16))]


def destination(n: int) -> BufferDestination:
    return BufferDestination([bytearray(NS.block_bytes) for _ in range(n)], NS.num_layers, NS.layer_bytes)


def config(daemons, **extra) -> ClientConfig:
    return ClientConfig(tuple(d.address for d in daemons), host_tier_bytes=3 * NS.block_bytes,
                        host_block_bytes=NS.block_bytes, down_backoff_s=0.1, max_down_backoff_s=0.2, **extra)


@pytest.fixture
def thread_starts(monkeypatch):
    """The names of the threads started from now on."""
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread):
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    return started


def kvstore_threads(besides: frozenset = frozenset()) -> list[threading.Thread]:
    """The client threads alive now but for `besides` (another test's client may not be collected yet)."""
    return [t for t in threading.enumerate() if t.name.startswith("kvstore") and t not in besides]


@pytest.mark.integration
def test_loads_gets_and_saves_start_no_thread_per_call(daemons, thread_starts):
    cluster = daemons(2)
    items = conversation(16)
    blocks = [b for b, _ in items]
    cfg = config(cluster)
    before = frozenset(kvstore_threads())
    with KVClient(cfg) as client:
        client.put(items, NS.num_layers)  # the gRPC channels and data channels are up from here on
        owners = set(client.block_sources(blocks))
        assert owners == {"host", *(d.address for d in cluster)}, "every load has a host piece and one per daemon"
        for round in range(20):
            handle = client.load(blocks, destination(len(blocks)))
            assert handle.wait(timeout=10) == 16 * 16
            assert len(client.get(blocks)) == 16
            assert client.save(conversation(1, seed=round + 1), NS.num_layers)
            assert client.write_behind.flush(timeout=10)
        assert client.write_behind.counters["stored"] == 20
        # Before: 2 + (daemons) new threads per load (the host, one per daemon, a finisher), ~80 here.
        assert len(thread_starts) <= 2 + cfg.pool_threads, thread_starts  # the loop, gRPC's poller, the pool
        live = kvstore_threads(besides=before)
        assert len(live) <= 1 + cfg.pool_threads, [t.name for t in live]


@pytest.mark.integration
def test_the_smallest_pool_serves_loads_gets_and_saves_from_many_threads_at_once(daemons):
    cluster = daemons(2)
    items = conversation(12, seed=30)
    blocks = [b for b, _ in items]
    before = frozenset(kvstore_threads())
    with KVClient(config(cluster, worker_threads=2)) as client:
        client.put(items, NS.num_layers)
        errors: list[BaseException] = []

        def engine(seed: int) -> None:
            try:
                for round in range(8):
                    handle = client.load(blocks, destination(len(blocks)))
                    assert handle.wait(timeout=20) == 12 * 16
                    assert len(client.get(blocks)) == 12
                    client.save(conversation(1, seed=100 * seed + round + 40), NS.num_layers)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        engines = [threading.Thread(target=engine, args=(seed,)) for seed in range(3)]
        for thread in engines:
            thread.start()
        for thread in engines:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in engines), "a bounded pool queues, never deadlocks"
        assert not errors, errors
        assert client.write_behind.flush(timeout=20)
        live = kvstore_threads(besides=before)
        assert len(live) <= 1 + 2, [t.name for t in live]


class HeldBackDestination(BufferDestination):
    """Holds the last layer back until the caller has consumed layer 0: however long that takes, the load
    cannot be done before."""

    def __init__(self, n: int) -> None:
        self.buffers = [bytearray(NS.block_bytes) for _ in range(n)]
        super().__init__(self.buffers, NS.num_layers, NS.layer_bytes)
        self.layer0_consumed = threading.Event()

    def layer_view(self, layer: int, block: int) -> memoryview:
        if layer == NS.num_layers - 1:
            self.layer0_consumed.wait()
        return super().layer_view(layer, block)


@pytest.mark.integration
def test_loads_stay_layer_pipelined_on_the_pool(daemons):
    cluster = daemons(2)
    items = conversation(16, seed=60)
    blocks = [b for b, _ in items]
    with KVClient(config(cluster)) as client:
        client.put(items, NS.num_layers)
        held = HeldBackDestination(len(blocks))
        handle = client.load(blocks, held)
        try:  # unpipelined, layer 0 would wait for the last layer, which waits for layer 0: the hang guard ends it
            assert handle.wait_layer(0, timeout=60) == 16 * 16, "layer 0 of every piece lands before the last layer"
            assert not handle.done, "the last layer is still held back"
        finally:
            held.layer0_consumed.set()
        assert handle.wait(timeout=10) == 16 * 16
        assert [bytes(b) for b in held.buffers] == [p for _, p in items]


@pytest.mark.unit
def test_load_work_finishes_once_after_its_last_piece_and_join_skips_the_calling_piece():
    progress = LoadProgress(num_layers=1, hit_blocks=2)
    work = LoadWork(progress, pieces=2)
    joined = threading.Event()

    def piece(block: int, gate: threading.Event | None) -> None:
        progress.mark(0, block)
        if gate is not None:
            work.join()  # a piece that cancels its own load waits for the others only
            joined.set()

    first = threading.Thread(target=work.run, args=(0, piece, 0, threading.Event()))
    first.start()
    wait_for(lambda: joined.is_set() or parked_in(first, LoadWork.join), "the first piece waiting in join")
    assert not joined.is_set() and not progress.finished, "the other piece has not run yet"
    work.run(1, piece, 1, None)
    first.join(timeout=5)
    assert joined.is_set() and progress.finished and progress.wait(timeout=0) == 2
    work.join()  # every piece has ended


@pytest.mark.unit
def test_load_work_without_pieces_is_finished_at_once():
    progress = LoadProgress(num_layers=2, hit_blocks=0)
    LoadWork(progress, pieces=0).join()
    assert progress.finished and progress.wait(timeout=0) == 0


@pytest.mark.unit
def test_write_behind_needs_only_a_put_callable():
    stored: list[int] = []

    class Summary:
        stored, existed, failed = 1, 0, 0

    def put(items, num_layers, traffic_class, hint):
        stored.append(len(items))
        return Summary()

    queue = WriteBehind(put, max_bytes=10 * NS.block_bytes)
    assert queue.save(conversation(1), NS.num_layers) and queue.save(conversation(1, seed=1), NS.num_layers)
    assert queue.flush(timeout=5)
    queue.close(timeout=5)
    assert stored == [1, 1] and queue.counters["stored"] == 2
    assert not queue.save(conversation(1, seed=2), NS.num_layers), "closed: dropped"
