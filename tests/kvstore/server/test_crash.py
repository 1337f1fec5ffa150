"""kill -9 at any point loses at most unacknowledged writes; after restart index and segments agree."""

import os
import random
import threading

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.server.fsck import check

pytestmark = pytest.mark.crash

NS = Namespace("crash-test", KVLayout(num_layers=4, kv_heads=2, head_dim=64, dtype="float16"), block_tokens=32)


def blocks_of(seed: int, n: int):
    return [(b, os.urandom(NS.block_bytes)) for b in NS.blocks(range(seed * 10**6, seed * 10**6 + n * NS.block_tokens))]


def client_for(daemon):
    return KVClient(ClientConfig((daemon.address,), timeout_s=2, lookup_timeout_s=1, down_backoff_s=0.05,
                                 max_down_backoff_s=0.1))


def assert_consistent(daemon, acked):
    """Stop the daemon cleanly, fsck its data, restart it, and read back every acknowledged block."""
    daemon.stop()
    report = check(daemon.data_dir)
    assert report.ok, report.problems[:5]
    assert report.open_segments == 0
    daemon.start()
    with client_for(daemon) as client:
        for block, payload in acked:
            got = client.get([block])
            assert got and got[0].payload == payload, "an acknowledged block was lost or changed"
    return report


@pytest.mark.parametrize("durability", ["os", "fsync"])
def test_repeated_kill_during_a_stream_of_puts(daemons, durability):
    daemon, = daemons(1, "--durability", durability, "--segment-bytes", "1MiB")
    acked: list = []
    rng = random.Random(7)
    for cycle in range(4):
        stop = threading.Event()

        def writer(seed_base=cycle * 1000):
            with client_for(daemon) as client:
                seed = seed_base
                while not stop.is_set():
                    items = blocks_of(seed, 3)
                    seed += 1
                    for item in items:
                        summary = client.put([item], NS.num_layers)
                        if summary.stored or summary.existed:
                            acked.append(item)

        thread = threading.Thread(target=writer)
        thread.start()
        # a random number of acknowledged puts, not a random time: each cycle kills amid the stream however
        # fast the machine is
        target = len(acked) + rng.randint(6, 30)
        while len(acked) < target and thread.is_alive():
            stop.wait(0.005)
        daemon.kill()  # SIGKILL mid-stream
        stop.set()
        thread.join()
        daemon.start()
        with client_for(daemon) as client:
            assert client.server_stats()[daemon.address] is not None
    assert len(acked) > 20, "the writer must have made progress between kills"
    report = assert_consistent(daemon, acked)
    assert report.entries >= len({b.key for b, _ in acked})


@pytest.mark.parametrize("point, survives", [
    ("segment.after_write", False),  # bytes written, index not committed: the block is absent
    ("index.before_commit", False),  # inside the index transaction: nothing committed
    ("index.after_commit", True),  # committed but not acknowledged: present and whole
])
def test_kill_at_each_point_of_a_put(daemons, point, survives):
    daemon, = daemons(1)
    with client_for(daemon) as client:
        first = blocks_of(1, 2)
        assert client.put(first, NS.num_layers).stored == 2
    daemon.stop()
    daemon.start(extra_env={"KVSTORE_FAULTS": f"{point}=kill"})
    victim = blocks_of(2, 1)
    with client_for(daemon) as client:
        assert client.put(victim, NS.num_layers).failed == 1
    daemon.proc.wait(timeout=10)
    daemon.start()
    with client_for(daemon) as client:
        assert client.lookup([victim[0][0]]) == int(survives)
    assert_consistent(daemon, first + (victim if survives else []))
