"""One check on the hot path, and the daemon's own copies checked again, in-process: reads into a client's
region are not checked by the daemon, Verify checks the DRAM tier's and the segment file's copies, and the
scrub walks every record the index points at (real LMDB and segment files)."""

import asyncio
import os
import time

import pytest

from kvstore.server.scrub import Scrubber
from tests.waiting import wait_for_async

from .conftest import NS, put_all, read_all, records

pytestmark = pytest.mark.unit


def flip_on_disk(store, key: bytes, offset_in_record: int) -> None:
    entry = store.index.get(key)
    segment = store.segments.segments[entry.segment]
    spot = entry.offset + offset_in_record
    os.pwrite(segment.fd, bytes([os.pread(segment.fd, 1, spot)[0] ^ 0xFF]), spot)


def payload_byte(layer: int, header_len: int) -> int:
    return header_len + layer * NS.layer_bytes + 5


async def test_a_read_into_a_region_is_left_to_the_client_and_verify_drops_the_block(open_store):
    store = await open_store(hot_tier_bytes=0)
    recs = records(2)
    await put_all(store, recs)
    key, header = recs[1][0].key, recs[1][2]
    flip_on_disk(store, key, payload_byte(2, header.header_len))

    block = await store.open_block(key)
    region = memoryview(bytearray(header.payload_len))
    try:
        served = await store.read_layers(block, 0, header.n_layers, into=region)
    finally:
        store.close_block(block)
    assert bytes(served) != recs[1][3], "the bytes are the file's: the client's check is the one that sees them"
    assert store.lookup([key]) == 1, "nothing is dropped on a check the daemon did not make"

    assert await store.verify([recs[0][0].key, key, os.urandom(16)]) == 1
    assert store.lookup([key]) == 0 and store.lookup([recs[0][0].key]) == 1
    assert store.metrics.verify_corrupt.labels(copy="ssd")._value.get() == 1
    assert store.metrics.verified_blocks._value.get() == 2  # the absent key is passed over
    assert await read_all(store, recs[0][0].key) == recs[0][3]


async def test_reads_into_the_daemons_memory_are_still_checked(open_store):
    store = await open_store(hot_tier_bytes=0)
    recs = records(1)
    await put_all(store, recs)
    flip_on_disk(store, recs[0][0].key, payload_byte(1, recs[0][2].header_len))
    with pytest.raises(Exception, match="checksum"):
        await read_all(store, recs[0][0].key)
    assert store.lookup([recs[0][0].key]) == 0


async def test_verify_discards_a_corrupt_dram_copy_and_keeps_a_good_block(open_store):
    store = await open_store()
    recs = records(2)
    await put_all(store, recs)
    key = recs[0][0].key
    cached = store.hot.pin(key)
    bad = bytearray(cached.payload)
    bad[len(bad) // 2] ^= 0xFF
    cached.payload = bad  # memory gone bad under the daemon
    store.hot.unpin(cached)

    assert await store.verify([key, recs[1][0].key]) == 1
    assert key not in store.hot and recs[1][0].key in store.hot
    assert store.lookup([key]) == 1, "the segment file's copy is good: the block stays"
    assert store.metrics.verify_corrupt.labels(copy="dram")._value.get() == 1
    assert store.metrics.verify_corrupt.labels(copy="ssd")._value.get() == 0
    assert await read_all(store, key) == recs[0][3]


async def test_verify_passes_over_blocks_outside_the_callers_tenants(open_store):
    store = await open_store(hot_tier_bytes=0)
    recs = records(1)
    await put_all(store, recs)
    key = recs[0][0].key
    flip_on_disk(store, key, payload_byte(0, recs[0][2].header_len))
    assert await store.verify([key], scope=frozenset({os.urandom(16)})) == 0
    assert store.lookup([key]) == 1
    assert await store.verify([key]) == 1


async def test_a_scrub_pass_drops_every_corrupt_record_and_counts_what_it_read(open_store):
    store = await open_store(hot_tier_bytes=0)
    recs = records(6)
    await put_all(store, recs)
    payload_victim, header_victim = recs[1], recs[4]
    flip_on_disk(store, payload_victim[0].key, payload_byte(3, payload_victim[2].header_len))
    flip_on_disk(store, header_victim[0].key, 60)  # the traffic class: the header's checksum fails
    record_bytes = sum(store.index.get(r[0].key).record_len for r in recs)

    scrubber = Scrubber(store, store.config, store.metrics)
    await scrubber.scrub_pass()
    keys = [r[0].key for r in recs]
    assert [store.lookup([k]) for k in keys] == [1, 0, 1, 1, 0, 1]
    assert store.metrics.scrub_corrupt._value.get() == 2
    assert store.metrics.scrub_bytes._value.get() == record_bytes
    assert store.metrics.scrub_passes._value.get() == 1
    assert all(segment.readers == 0 for segment in store.segments.segments.values()), "no segment held after"

    await scrubber.scrub_pass()  # what is dropped is not read again
    assert store.metrics.scrub_corrupt._value.get() == 2
    assert store.metrics.scrub_bytes._value.get() == record_bytes + 4 * record_bytes // 6


async def test_the_scrub_keeps_its_pace(open_store):
    recs = records(5)
    record_len = len(recs[0][1]) + len(recs[0][3])
    store = await open_store(hot_tier_bytes=0, scrub_bytes_per_s=10 * record_len)  # 0.1 s a record
    await put_all(store, recs)
    started = time.monotonic()
    await Scrubber(store, store.config, store.metrics).scrub_pass()
    assert time.monotonic() - started >= 0.4, "each record after the first waits for the one before it"


async def test_the_scrub_is_off_at_zero_and_stops_at_once_when_cancelled(open_store):
    store = await open_store(hot_tier_bytes=0, scrub_bytes_per_s=0)
    await asyncio.wait_for(Scrubber(store, store.config, store.metrics).run(), timeout=5)  # returns at once

    store.config.scrub_bytes_per_s = 1  # a byte a second: the pass would take days
    store.config.scrub_pause_s = 0.01
    await put_all(store, records(3))
    scrubber = Scrubber(store, store.config, store.metrics)
    task = asyncio.ensure_future(scrubber.run())
    # a record read: the scrub is inside a pass, waiting for its pace
    await wait_for_async(lambda: store.metrics.scrub_bytes._value.get() > 0, "the scrub reading a record", timeout_s=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert all(segment.readers == 0 for segment in store.segments.segments.values())


# -- what a Verify may cost (verify_meter.py) ---------------------------------------------------------------


def verified(store) -> float:
    return store.metrics.verified_blocks._value.get()


def skipped(store, reason: str) -> float:
    return store.metrics.verify_skipped.labels(reason=reason)._value.get()


async def test_verify_reads_a_block_at_most_once_per_recheck_interval(open_store, clock):
    store = await open_store(verify_recheck_s=60)
    recs = records(3)
    await put_all(store, recs)
    keys = [block.key for block, *_ in recs]
    for _ in range(4):  # a client naming its own good blocks in a loop
        assert await store.verify(keys, who="mallory") == 0
    assert verified(store) == 3 and skipped(store, "recent") == 9, "read once, then answered from memory"
    assert await store.verify(keys[:1], who="bob") == 0
    assert verified(store) == 3, "the memory is the block's, whoever asks"

    flip_on_disk(store, keys[0], payload_byte(1, recs[0][2].header_len))  # damage after the check
    clock.advance(59)
    assert await store.verify(keys[:1], who="bob") == 0, "within the interval the last check answers"
    clock.advance(1)
    assert await store.verify(keys[:1], who="bob") == 1, "once it has passed, the block is read again"
    assert store.lookup(keys[:1]) == 0 and verified(store) == 4


async def test_verify_holds_each_principal_to_its_own_rate_and_a_key_passed_over_is_checked_later(
        open_store, clock):
    recs = records(6)
    record_bytes = recs[0][2].header_len + len(recs[0][3])
    store = await open_store(verify_bytes_per_s=2 * record_bytes, verify_recheck_s=0)
    await put_all(store, recs)
    keys = [block.key for block, *_ in recs]
    assert await store.verify(keys, who="mallory") == 0
    assert verified(store) == 2 and skipped(store, "rate") == 4, "one second of the rate, saved up"

    flip_on_disk(store, keys[5], payload_byte(2, recs[5][2].header_len))
    assert await store.verify(keys[5:], who="mallory") == 0 and skipped(store, "rate") == 5
    assert await store.verify(keys[5:], who="bob") == 1, "another principal's budget is its own"
    assert store.lookup(keys[5:]) == 0

    flip_on_disk(store, keys[4], payload_byte(0, recs[4][2].header_len))
    clock.advance(0.5)  # half a second: one record's worth back, spent at once
    assert await store.verify(keys[4:5], who="mallory") == 1, "a key passed over was not taken as checked"
    assert await store.verify(keys[:1], who="mallory") == 0 and skipped(store, "rate") == 6
    assert verified(store) == 4


async def test_verify_reads_a_block_again_once_its_record_moved(open_store, clock):
    store = await open_store(verify_recheck_s=60)
    recs = records(1)
    await put_all(store, recs)
    key = recs[0][0].key
    assert await store.verify([key]) == 0
    before = store.index.get(key)
    await store.copy_forward(key, before, store.segments.segments[before.segment])  # as compaction moves it
    assert (store.index.get(key).segment, store.index.get(key).offset) != (before.segment, before.offset)
    assert await store.verify([key]) == 0
    assert verified(store) == 2, "the last check was of another record"


async def test_a_check_that_could_not_read_the_block_is_not_remembered(open_store, monkeypatch):
    store = await open_store(verify_recheck_s=60)
    recs = records(1)
    await put_all(store, recs)
    key = recs[0][0].key
    checks = store._reader.check_segment_copy

    async def unreadable(*args):
        return "unreadable"

    monkeypatch.setattr(store._reader, "check_segment_copy", unreadable)  # an I/O error says nothing of the bytes
    assert await store.verify([key]) == 0
    monkeypatch.setattr(store._reader, "check_segment_copy", checks)
    assert await store.verify([key]) == 0 and verified(store) == 2


async def test_past_the_principals_remembered_only_idle_buckets_are_forgotten(open_store, clock, monkeypatch):
    monkeypatch.setattr("kvstore.server.verify_meter.MAX_PRINCIPALS", 2)
    recs = records(3)
    record_bytes = recs[0][2].header_len + len(recs[0][3])
    store = await open_store(verify_bytes_per_s=record_bytes // 2, verify_recheck_s=0)  # one check, then a debt
    await put_all(store, recs)
    keys = [block.key for block, *_ in recs]
    assert await store.verify(keys[:1], who="bob") == 0 and verified(store) == 1
    clock.advance(2)  # bob's bucket is full again
    assert await store.verify(keys, who="mallory") == 0 and verified(store) == 2
    assert await store.verify(keys[:1], who="carol") == 0 and verified(store) == 3
    assert await store.verify(keys, who="mallory") == 0 and verified(store) == 3, "a bucket in debt is kept"
