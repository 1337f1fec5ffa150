import os
import threading

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import KVClient
from kvstore.client.write_behind import WriteBehind

pytestmark = pytest.mark.integration
NS = Namespace("wb", KVLayout(2, 1, 32, "float16"), 16)


def items(n, seed=0):
    return [(b, os.urandom(NS.block_bytes)) for b in NS.blocks(range(seed * 10**5, seed * 10**5 + 16 * n))]


def test_saves_are_stored_in_the_background_and_flushed_on_close(daemons):
    daemon, = daemons(1)
    saved = items(6)
    with KVClient([daemon.address]) as client:
        assert client.save(saved[:3], NS.num_layers) and client.save(saved[3:], NS.num_layers, "agent")
    with KVClient([daemon.address]) as client:  # close() flushed the queue
        assert client.lookup([b for b, _ in saved]) == 6


class GatedClient:
    """Holds every put until released, so the queue fills up deterministically."""

    def __init__(self, client):
        self.client, self.gate = client, threading.Event()

    def put(self, *args, **kwargs):
        self.gate.wait(10)
        return self.client.put(*args, **kwargs)


def test_a_full_queue_drops_and_counts_and_never_blocks(daemons):
    daemon, = daemons(1)
    with KVClient([daemon.address]) as client:
        gated = GatedClient(client)
        queue = WriteBehind(gated.put, max_bytes=3 * NS.block_bytes)
        batches = [items(1, seed=s) for s in range(6)]
        accepted = [queue.save(batch, NS.num_layers) for batch in batches]  # returns at once
        assert accepted.count(True) in (3, 4) and queue.counters["dropped"] == accepted.count(False)
        gated.gate.set()
        assert queue.flush(timeout=10)
        queue.close()
        assert queue.counters["stored"] == accepted.count(True)
        assert client.lookup([batches[0][0][0]]) == 1


def test_then_follows_its_own_save_in_order_with_the_daemons_answer(daemons):
    daemon, = daemons(1)
    saved, answers = items(2, seed=7), []
    with KVClient([daemon.address]) as client:
        note = lambda name: lambda summary: answers.append((name, summary and (summary.stored, summary.existed)))
        assert client.save(saved, NS.num_layers, then=note("first"))
        assert client.save(saved[:1], NS.num_layers, then=note("again"))
        assert client.save(saved[1:], NS.num_layers, then=lambda summary: 1 / 0)  # a failing follower
        assert client.write_behind.flush(timeout=30)
        assert answers == [("first", (2, 0)), ("again", (0, 1))]
        assert client.write_behind.counters["then_failed"] == 1 and client.lookup([b for b, _ in saved]) == 2


def test_a_mark_waits_for_the_saves_queued_before_it_not_after(daemons):
    daemon, = daemons(1)
    with KVClient([daemon.address]) as client:
        turns = threading.Semaphore(0)  # one put goes through per release

        def put(*args, **kwargs):
            assert turns.acquire(timeout=30)
            return client.put(*args, **kwargs)

        queue = WriteBehind(put, max_bytes=8 * NS.block_bytes)
        assert queue.wait_for(queue.mark(), timeout=0)  # nothing queued: nothing to wait for
        first, later = items(1, seed=1), items(1, seed=2)
        assert queue.save(first, NS.num_layers)
        mark = queue.mark()
        assert queue.save(later, NS.num_layers)
        assert not queue.wait_for(mark, timeout=0)  # the first save is held
        turns.release()
        assert queue.wait_for(mark, timeout=30)  # while the later one is still held
        assert client.lookup([first[0][0]]) == 1 and client.lookup([later[0][0]]) == 0
        turns.release()
        queue.close()
        assert client.lookup([later[0][0]]) == 1
