"""Encoded blocks through real daemons: smaller on the wire and the disk, decoded layer by layer into the
engine's buffers, and every bad record a counted miss."""

import dataclasses

import numpy as np
import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import KVClient
from kvstore.client.loading import BufferDestination
from kvstore.codec import BlockCodec, LayerGeometry, codec_named
from tests.kvstore.client.test_load import POISON, config, corrupt_on_disk
from tests.kvstore.test_codec import as_float32, kv_like

pytestmark = pytest.mark.integration

LAYERS = 4


def namespace(codec: str) -> Namespace:
    return Namespace("codec-test", KVLayout(LAYERS, kv_heads=2, head_dim=32, dtype="bfloat16", codec=codec),
                     block_tokens=16)


def conversation(space: Namespace, n_blocks: int, seed: int = 0):
    geometry = LayerGeometry(2, 16, 64, "bfloat16")
    return [(block, b"".join(kv_like(geometry, seed * 1000 + i * LAYERS + layer) for layer in range(LAYERS)))
            for i, block in enumerate(space.blocks(range(seed * 10**6, seed * 10**6 + n_blocks * 16)))]


def load(client: KVClient, space: Namespace, items) -> tuple[int, list[bytearray]]:
    buffers = [bytearray([POISON]) * space.block_bytes for _ in items]
    handle = client.load([b for b, _ in items], BufferDestination(buffers, LAYERS, space.layer_bytes))
    return handle.wait(timeout=10), buffers


@pytest.mark.parametrize("codec", ["zstd", "int8", "int4"])
def test_encoded_blocks_load_decoded_into_the_engines_buffers(daemons, codec):
    cluster = daemons(2)
    space = namespace(codec)
    items = conversation(space, 6)
    with KVClient(config(cluster)) as client:
        assert client.put(items, LAYERS).stored == 6
        hit, buffers = load(client, space, items)
        assert hit == 6 * 16
        for got, (_, want) in zip(buffers, items):
            if codec == "zstd":
                assert bytes(got) == want
            else:
                error = np.linalg.norm(as_float32(bytes(got), "bfloat16") - as_float32(want, "bfloat16"))
                assert error / np.linalg.norm(as_float32(want, "bfloat16")) < (0.01 if codec == "int8" else 0.12)
        read = client.get([b for b, _ in items])
        assert all(d.header.payload_len < space.block_bytes for d in read), "the store keeps the encoded bytes"
        if codec == "zstd":
            assert [bytes(d.kv()) for d in read] == [p for _, p in items]


def test_the_host_tier_keeps_encoded_blocks_and_decodes_them_on_load(daemons):
    cluster = daemons(1)
    space = namespace("zstd")
    items = conversation(space, 4, seed=1)
    slot = space.codec.max_slot_bytes * LAYERS
    with KVClient(config(cluster, host_tier_bytes=4 * slot, host_block_bytes=slot)) as client:
        client.put(items, LAYERS)  # write-through
        assert client.host.leading_hits([b.key for b, _ in items]) == 4
        hit, buffers = load(client, space, items)
        assert hit == 4 * 16 and [bytes(b) for b in buffers] == [p for _, p in items]
        assert client.stats.tier_hits["host"] >= 4


def test_an_encoded_block_corrupted_on_disk_is_a_counted_miss(daemons):
    daemon, = daemons(1, "--hot-tier-bytes", "0")
    space = namespace("int8")
    items = conversation(space, 5, seed=2)
    with KVClient(config([daemon])) as client:
        client.put(items, LAYERS)
    daemon.stop()
    corrupt_on_disk(daemon.data_dir, items[3][0].key, layer_index=2)
    daemon.start()
    with KVClient(config([daemon])) as client:
        hit, _ = load(client, space, items)
        assert hit == 3 * 16
        assert client.stats.miss_causes["checksum"] >= 1


def test_a_record_whose_checksums_hold_but_no_reader_can_decode_is_a_counted_miss(daemons):
    """A writer that encoded with the same codec but another geometry (its heads split otherwise): the
    checksums hold, the layers do not decode, and the block ends the hit instead of loading garbage."""
    cluster = daemons(1)
    space = namespace("int8")
    items = conversation(space, 3, seed=3)
    other = BlockCodec(codec_named("int8"), LayerGeometry(2, 16, 32, "bfloat16"))
    forged = [(dataclasses.replace(block, codec=other), payload[: len(payload) // 2]) for block, payload in items]
    with KVClient(config(cluster)) as client:
        client.put(items[:1] + forged[1:], LAYERS)
        hit, _ = load(client, space, items)
        assert hit == 16
        assert client.stats.miss_causes["codec"] == 2  # each forged block that arrived


def test_blocks_of_another_codec_are_never_read_as_this_ones(daemons):
    cluster = daemons(1)
    items = conversation(namespace("zstd"), 2, seed=4)
    with KVClient(config(cluster)) as client:
        client.put(items, LAYERS)
        as_int8 = conversation(namespace("int8"), 2, seed=4)
        assert load(client, namespace("int8"), as_int8)[0] == 0
        # the same keys under a reader expecting raw layers: a codec mismatch, counted
        raw_reader = [dataclasses.replace(b, codec=None) for b, _ in items]
        assert client.get(raw_reader) == []
        assert client.stats.miss_causes["codec_mismatch"] == 2


def test_a_get_into_caller_buffers_refuses_encoded_blocks_wherever_they_are(daemons):
    cluster = daemons(1)
    space = namespace("zstd")
    items = conversation(space, 1)
    slot = space.codec.max_slot_bytes * LAYERS
    with KVClient(config(cluster)) as client, pytest.raises(ValueError, match="decode them with BlockData.kv"):
        client.get([b for b, _ in items], into=[bytearray(space.block_bytes)])
    with KVClient(config(cluster, host_tier_bytes=slot, host_block_bytes=slot)) as client:
        client.put(items, LAYERS)  # now in the host tier too
        with pytest.raises(ValueError, match="decode them with BlockData.kv"):
            client.get([b for b, _ in items], into=[bytearray(space.block_bytes)])


def test_a_host_tier_block_that_does_not_decode_ends_the_hit_and_those_before_it_load(daemons):
    cluster = daemons(1)
    space = namespace("int8")
    items = conversation(space, 4, seed=5)
    other = BlockCodec(codec_named("int8"), LayerGeometry(2, 16, 32, "bfloat16"))
    forged = (dataclasses.replace(items[2][0], codec=other), items[2][1][: len(items[2][1]) // 2])
    slot = space.codec.max_slot_bytes * LAYERS
    with KVClient(config(cluster, host_tier_bytes=4 * slot, host_block_bytes=slot)) as client:
        client.put(items[:2] + [forged] + items[3:], LAYERS)  # write-through: all four in the host tier
        assert client.host.leading_hits([b.key for b, _ in items]) == 4
        hit, buffers = load(client, space, items)
        assert hit == 2 * 16 and client.stats.miss_causes["codec"] == 1
        for got, (_, want) in zip(buffers[:2], items[:2]):
            error = np.linalg.norm(as_float32(bytes(got), "bfloat16") - as_float32(want, "bfloat16"))
            assert error / np.linalg.norm(as_float32(want, "bfloat16")) < 0.01


@pytest.mark.parametrize("codec", ["int8", "zstd"])
def test_an_encoded_blocks_corrupt_dram_tier_copy_is_a_counted_miss_never_a_hit(daemons, codec):
    # The daemon's DRAM tier takes the put's own copy with a byte flipped (memory gone bad after the daemon
    # checked it): only the client's layer checksums stand between those bytes and the decoder.
    daemon, = daemons(1, env={"KVSTORE_FAULTS": "hot_tier.put=flip@1"})
    space = namespace(codec)
    items = conversation(space, 1, seed=6)
    with KVClient(config([daemon])) as client:
        assert client.put(items, LAYERS).stored == 1
        assert client.get([b for b, _ in items]) == []
        assert client.stats.miss_causes["checksum"] == 1
    with KVClient(config([daemon])) as client:  # the report (waited for at close) dropped the bad copy
        (read,) = client.get([b for b, _ in items])
        assert len(read.kv()) == space.block_bytes and client.stats.miss_causes["checksum"] == 0


def test_an_encoded_get_of_a_layer_range_returns_exactly_those_layers(daemons):
    cluster = daemons(1)
    space = namespace("zstd")  # lossless: the layers read back are the bytes put
    items = conversation(space, 2, seed=7)
    with KVClient(config(cluster)) as client:
        assert client.put(items, LAYERS).stored == 2
        read = client.get([b for b, _ in items], 1, 3)
        assert [bytes(d.kv()) for d in read] == [p[space.layer_bytes : 3 * space.layer_bytes] for _, p in items]
        assert [bytes(d.layer(2)) for d in read] == [p[2 * space.layer_bytes : 3 * space.layer_bytes] for _, p in items]
