"""Places given up: a client that announces large records and goes away, again and again, costs no disk bytes,
no segment files and no compaction of the records around its places (segments.py `finish`, `place`)."""

from __future__ import annotations

import mmap

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.record import decode_header, encode_header
from kvstore.server.store import BlockStore
from tests.waiting import wait_for_async

from .conftest import put_all, read_all, records

pytestmark = pytest.mark.unit

BIG = Namespace("places", KVLayout(num_layers=4, kv_heads=8, head_dim=128, dtype="float16"), block_tokens=128)
DIRECT = {"direct_io_min_bytes": 64 * 1024, "hot_tier_bytes": 0, "segment_bytes": 256 * 2**20}


def announced(seed: int, payload_bytes: int = 64 * 2**20):
    """The header of a record of `payload_bytes` whose payload never comes."""
    block = BIG.blocks(range(seed * 128, seed * 128 + 128))[0]
    return decode_header(encode_header(block, "chat", 4, payload_bytes // 4, [0] * 4))


async def given_up(store: BlockStore, *placed) -> None:
    """Give places up (all in one segment), and wait until the store has let them go (an I/O thread erases
    them)."""
    segment = placed[0].placement.segment
    left = segment.writers - len(placed)
    for place in placed:
        store.give_up(place, written=0, failed=False)
    await wait_for_async(lambda: segment.writers == left, "the places let go")


async def test_places_given_up_one_after_another_cost_no_disk_bytes_and_no_compaction(open_store):
    store = await open_store(**DIRECT, compaction_min_garbage=0.5)
    others = records(8, seed=1)  # another tenant's small records, around the places
    await put_all(store, others[:4])
    before = store.segments.disk_bytes
    for seed in range(200):  # 12.5 GiB announced, on a store that holds 256 MiB segments
        placed = await store.place(announced(seed))
        assert placed is not None
        await given_up(store, placed)
    assert store.segments.disk_bytes == before and len(store.segments.segments) == 1
    await put_all(store, others[4:])
    await store.retention.maintain()
    assert store.metrics.copied_forward._value.get() == 0, "no record was rewritten because of the holes"
    for block, _, _, payload in others:
        assert await read_all(store, block.key) == payload


async def test_a_place_given_up_between_others_is_taken_again_by_the_next_record_that_fits(open_store):
    store = await open_store(**DIRECT)
    first, second = await store.place(announced(1)), await store.place(announced(2))
    segment = first.placement.segment
    size = segment.size
    await given_up(store, first)
    assert segment.size == size, "a hole in the middle stays, as a hole"
    assert store.segments.disk_bytes == size - (first.placement.end - first.placement.header_pages)
    assert segment.used_bytes == second.placement.end - second.placement.start, \
        "a hole counts as nothing, garbage for compaction included"
    smaller = await store.place(announced(3, 16 * 2**20))
    assert smaller.placement.header_pages == first.placement.header_pages and segment.size == size
    again = await store.place(announced(4, 48 * 2**20 - 2 * 4096))  # the rest of the hole, less its header pages
    assert again.placement.header_pages == smaller.placement.end and segment.size == size
    await given_up(store, second, smaller, again)
    assert segment.size == first.placement.start == 0 and segment.given_up == []
    assert store.segments.disk_bytes == segment.size, "holes that end the segment are cut off"


async def test_a_record_written_into_a_place_given_up_reads_back_after_a_restart(open_store):
    store = await open_store(**DIRECT)
    await given_up(store, await store.place(announced(1, 8 * 2**20)))
    recs = records(1, seed=2, namespace=BIG)  # 2 MiB: written as it arrives would take that place
    block, header_bytes, header, payload = recs[0]
    placed = await store.place(header)
    assert placed is not None and placed.placement.header_pages == 0, "the hole at the segment's start is reused"
    aligned = mmap.mmap(-1, len(payload))  # as the data channel receives it: page-aligned
    aligned[:] = payload
    await store.write_placed(placed, 0, memoryview(aligned), last=True)
    await store.write_placed_header(placed, header_bytes)
    await store.put(header, header_bytes, [payload], placed=placed)
    await store.close()
    reopened = await open_store(**DIRECT)
    assert await read_all(reopened, block.key) == payload
