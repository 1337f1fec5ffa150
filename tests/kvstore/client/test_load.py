"""Layer-pipelined loads from real daemons into poisoned engine buffers."""

import os
import threading
import time

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.client.loading import BufferDestination
from kvstore.server.segments import SegmentSet
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

NS = Namespace("load-test", KVLayout(num_layers=6, kv_heads=2, head_dim=32, dtype="float16"), block_tokens=16)
POISON = 0xAB


def conversation(n_blocks: int, seed: int = 0):
    return [(b, os.urandom(NS.block_bytes)) for b in NS.blocks(range(seed * 10**6, seed * 10**6 + n_blocks * 16))]


def poisoned(n: int) -> list[bytearray]:
    return [bytearray([POISON]) * NS.block_bytes for _ in range(n)]


def layer(payload, index: int) -> bytes:
    return bytes(payload[index * NS.layer_bytes : (index + 1) * NS.layer_bytes])


def config(daemons, **extra) -> ClientConfig:
    return ClientConfig(tuple(d.address for d in daemons), timeout_s=5, down_backoff_s=0.1,
                        max_down_backoff_s=0.2, **extra)


def test_every_layer_is_in_place_when_wait_layer_returns(daemons):
    cluster = daemons(2)
    items = conversation(8)
    with KVClient(config(cluster)) as client:
        client.put(items, NS.num_layers)
        buffers = poisoned(8)
        handle = client.load([b for b, _ in items], BufferDestination(buffers, NS.num_layers, NS.layer_bytes))
        assert handle.hit_tokens == 8 * 16
        for index in range(NS.num_layers):
            assert handle.wait_layer(index, timeout=10) == 8 * 16
            assert [bytes(layer(b, index)) for b in buffers] == [layer(p, index) for _, p in items]
        assert handle.wait(timeout=10) == 8 * 16
        assert [bytes(b) for b in buffers] == [p for _, p in items], "bytes loaded equal bytes saved"


def test_host_tier_serves_the_head_of_the_prefix_and_daemons_the_rest(daemons):
    cluster = daemons(1)
    items = conversation(6, seed=1)
    with KVClient(config(cluster, host_tier_bytes=3 * NS.block_bytes, host_block_bytes=NS.block_bytes)) as client:
        client.put(items, NS.num_layers)  # write-through keeps the prefix's first 3 blocks in host memory
        assert client.host.leading_hits([b.key for b, _ in items]) == 3
        buffers = poisoned(6)
        handle = client.load([b for b, _ in items], BufferDestination(buffers, NS.num_layers, NS.layer_bytes))
        assert handle.wait(timeout=10) == 6 * 16
        assert [bytes(b) for b in buffers] == [p for _, p in items]
        assert client.stats.tier_hits["host"] == 3 and client.stats.tier_hits["daemon"] == 3
        got = client.get([b for b, _ in items])  # plain gets consult the host tier too
        assert [bytes(g.payload) for g in got] == [p for _, p in items]


@pytest.mark.kills_daemons  # left dead on purpose: a dead daemon is what it tests
def test_a_daemon_killed_mid_load_shrinks_the_hit_without_a_hang(daemons):
    cluster = daemons(1, "--hot-tier-bytes", "0")
    items = conversation(8, seed=2)
    with KVClient(config(cluster, host_tier_bytes=3 * NS.block_bytes, host_block_bytes=NS.block_bytes)) as client:
        client.put(items, NS.num_layers)
    cluster[0].stop()
    cluster[0].start(extra_env={"KVSTORE_FAULTS": "segment.read=kill@8"})  # dies inside the layer stream
    with KVClient(config(cluster, host_tier_bytes=3 * NS.block_bytes, host_block_bytes=NS.block_bytes)) as client:
        client.put(items[:3], NS.num_layers)  # the head of the prefix is in host memory again
        buffers = poisoned(8)
        handle = client.load([b for b, _ in items], BufferDestination(buffers, NS.num_layers, NS.layer_bytes),
                             hit_blocks=8)
        # no hang: the load ends, its hit cut at the dead daemon (the timeout only guards against a hang)
        assert handle.wait(timeout=60) == 3 * 16, "the hit ends where the dead daemon's blocks begin"
        assert [bytes(b) for b in buffers[:3]] == [p for _, p in items[:3]]
        for index in range(NS.num_layers):
            handle.wait_layer(index, timeout=0)  # the load ended: every layer of its hit is in place already
        assert client.stats.shard_errors[cluster[0].address] >= 1


def corrupt_on_disk(data_dir, key: bytes, layer_index: int) -> None:
    segments = SegmentSet(data_dir / "segments", 1 << 30, fsync=False)
    segments.open_existing()
    try:
        for segment in segments.segments.values():
            for offset, header in segments.scan(segment):
                if header.key == key:
                    spot = offset + header.layer_offset(layer_index) + 3
                    byte = os.pread(segment.fd, 1, spot)
                    os.pwrite(segment.fd, bytes([byte[0] ^ 0xFF]), spot)
                    return
        raise AssertionError("block not found on disk")
    finally:
        for segment in segments.segments.values():
            os.close(segment.fd)


def test_a_block_corrupted_on_disk_ends_the_hit_before_it(daemons):
    daemon, = daemons(1, "--hot-tier-bytes", "0")
    items = conversation(6, seed=3)
    with KVClient(config([daemon])) as client:
        client.put(items, NS.num_layers)
    daemon.stop()
    corrupt_on_disk(daemon.data_dir, items[4][0].key, layer_index=3)
    daemon.start()
    with KVClient(config([daemon])) as client:
        buffers = poisoned(6)
        handle = client.load([b for b, _ in items], BufferDestination(buffers, NS.num_layers, NS.layer_bytes))
        assert handle.hit_tokens == 6 * 16  # the index still lists it: the damage shows only when read
        assert handle.wait(timeout=10) == 4 * 16
        assert [bytes(b) for b in buffers[:4]] == [p for _, p in items[:4]]
        assert client.stats.miss_causes["checksum"] >= 1


class SlowDestination(BufferDestination):
    """Pauses after some writes, so that a cancellation lands in the middle of a load."""

    def __init__(self, *args, pause_after: int):
        super().__init__(*args)
        self.writes = 0
        self.pause_after = pause_after
        self.reached = threading.Event()

    def layer_written(self, layer_index: int, block: int) -> None:
        self.writes += 1
        if self.writes == self.pause_after:
            self.reached.set()
            time.sleep(0.2)


def test_cancel_at_any_point_leaves_no_stray_writes(daemons):
    cluster = daemons(2)
    items = conversation(8, seed=4)
    with KVClient(config(cluster)) as client:
        client.put(items, NS.num_layers)
        for pause_after in (1, 9, 30):
            buffers = poisoned(8)
            destination = SlowDestination(buffers, NS.num_layers, NS.layer_bytes, pause_after=pause_after)
            handle = client.load([b for b, _ in items], destination)
            assert destination.reached.wait(timeout=10)
            handle.cancel()
            writes, snapshot = destination.writes, [bytes(b) for b in buffers]
            # the load's last piece has ended (it finishes the load): no piece is left to write a stray byte
            wait_for(lambda: handle.done, "the cancelled load's pieces ending")
            assert destination.writes == writes and [bytes(b) for b in buffers] == snapshot
        cancelled_before_start = client.load([b for b, _ in items], BufferDestination(poisoned(8), NS.num_layers,
                                                                                     NS.layer_bytes))
        cancelled_before_start.cancel()
        assert client.get([b for b, _ in items[:1]]), "the client still works"


def test_loads_fill_the_host_tier_and_the_daemons_dram_tier(daemons):
    daemon, = daemons(1)
    items = conversation(4, seed=5)
    with KVClient(config([daemon])) as client:
        client.put(items, NS.num_layers)
    daemon.stop()
    daemon.start()  # the daemon's DRAM tier is empty: the blocks are on SSD only
    with KVClient(config([daemon], host_tier_bytes=8 * NS.block_bytes, host_block_bytes=NS.block_bytes)) as client:
        assert client.host.leading_hits([b.key for b, _ in items]) == 0
        handle = client.load([b for b, _ in items], BufferDestination(poisoned(4), NS.num_layers, NS.layer_bytes))
        assert handle.wait(timeout=10) == 4 * 16
        assert client.host.leading_hits([b.key for b, _ in items]) == 4, "loaded blocks are kept in host memory"
        stats = client.server_stats()[daemon.address]
        assert stats.value("kvstore_hits_total", tier="ssd") == 4
    with KVClient(config([daemon])) as client:  # no host tier: the daemon now serves them from DRAM
        handle = client.load([b for b, _ in items], BufferDestination(poisoned(4), NS.num_layers, NS.layer_bytes))
        assert handle.wait(timeout=10) == 4 * 16
        assert client.server_stats()[daemon.address].value("kvstore_hits_total", tier="dram") == 4
