"""The block store in-process: real LMDB, real segment files, an injected clock."""

import asyncio
import os

import pytest

from kvstore.eviction import ReuseHint
from kvstore.record import CorruptRecord
from kvstore.server.access_times import POLICY_STATE
from kvstore.server.frames import FRAME_BYTES, KEY_FILE  # each record stands behind a frame
from kvstore.server.index import Index
from kvstore.server.outcomes import Miss, MissStatus, PutResult
from kvstore.server.store import DataDirInUse

from .conftest import NS, put_all, read_all, records

pytestmark = pytest.mark.unit
DAY = 86400.0


async def test_put_lookup_get_roundtrip(open_store):
    store = await open_store(hot_tier_bytes=0)  # every read from the segment files
    recs = records(5)
    assert await put_all(store, recs) == [PutResult.STORED] * 5
    assert await put_all(store, recs[:2]) == [PutResult.EXISTS] * 2
    keys = [r[0].key for r in recs]
    assert store.lookup(keys) == 5
    assert store.lookup(keys[:2] + [os.urandom(16)] + keys[2:]) == 2
    assert store.lookup([]) == 0
    for block, _, _, payload in recs:
        assert await read_all(store, block.key) == payload
        assert await read_all(store, block.key, 1, 3) == payload[NS.layer_bytes : 3 * NS.layer_bytes]
    missing = await read_all(store, os.urandom(16))
    assert isinstance(missing, Miss) and missing.status == MissStatus.MISSING


async def test_data_survives_reopen_and_dir_is_exclusive(open_store, tmp_path):
    store = await open_store()
    recs = records(3)
    await put_all(store, recs)
    with pytest.raises(DataDirInUse):
        await open_store()
    await store.close()
    reopened = await open_store()
    assert reopened.lookup([r[0].key for r in recs]) == 3
    assert await read_all(reopened, recs[2][0].key) == recs[2][3]
    assert reopened.accounting.live_bytes == sum(len(r[1]) + len(r[3]) for r in recs)


async def test_ttl_per_class_and_extension_on_access(open_store, clock):
    store = await open_store(expiry_bucket_s=3600)
    agent, chat = records(1, "agent", seed=1), records(1, "chat", seed=2)
    await put_all(store, agent + chat)
    agent_key, chat_key = agent[0][0].key, chat[0][0].key
    clock.advance(3 * DAY - 60)
    assert store.lookup([agent_key]) == 1
    clock.advance(120)
    assert store.lookup([agent_key]) == 0 and store.lookup([chat_key]) == 1
    expired = await store.open_block(agent_key)
    assert isinstance(expired, Miss) and expired.status == MissStatus.EXPIRED
    clock.advance(3 * DAY)  # day 6: reading the chat block extends it by its 7-day TTL
    found = await store.open_block(chat_key)
    store.record_hits([found], 0)
    store.close_block(found)
    clock.advance(6 * DAY)  # day 12: alive only thanks to the extension
    assert store.lookup([chat_key]) == 1
    clock.advance(2 * DAY)
    assert store.lookup([chat_key]) == 0


async def test_a_block_shared_by_two_classes_keeps_the_longer_ttl(open_store, clock):
    store = await open_store()
    block, header_bytes, header, payload = records(1, "agent")[0]
    await store.put(header, header_bytes, [payload])
    assert await store.touch([block.key], "chat") == 1  # now also used by chat traffic
    clock.advance(5 * DAY)
    assert store.lookup([block.key]) == 1
    assert await store.touch([block.key], "agent") == 1  # agent's shorter TTL must not shorten it
    clock.advance(3 * DAY + 60)
    assert store.lookup([block.key]) == 1


async def test_expired_segments_are_deleted_and_hot_blocks_copied_forward(open_store, clock):
    store = await open_store(expiry_bucket_s=3600, segment_bytes=1 << 20)
    recs = records(6, "agent")
    await put_all(store, recs)
    files_before = set(os.listdir(store.segments.directory)) - {KEY_FILE}
    clock.advance(3 * DAY - 600)
    assert await store.touch([recs[0][0].key]) == 1  # hot: extended to ~6 days
    clock.advance(2 * 3600)
    await store.retention.maintain()
    assert store.lookup([recs[0][0].key]) == 1
    assert await read_all(store, recs[0][0].key) == recs[0][3]
    assert [isinstance(await store.open_block(r[0].key), Miss) for r in recs[1:]] == [True] * 5
    assert files_before.isdisjoint(os.listdir(store.segments.directory)), "the old bucket's file is gone"
    assert store.metrics.expiries._value.get() == 5
    assert store.accounting.live_bytes == len(recs[0][1]) + len(recs[0][3])


async def test_capacity_evicts_lru_down_to_the_low_watermark_at_the_put_that_crosses_the_high_one(open_store):
    record_bytes = sum(map(len, records(1)[0][1::2]))
    store = await open_store(capacity_bytes=20 * record_bytes, segment_bytes=4 * record_bytes,
                             high_watermark=0.9, low_watermark=0.5, hot_tier_bytes=0)
    recs = records(22)
    await put_all(store, recs[:18])  # exactly at the high watermark: nothing goes yet
    assert store.metrics.evictions._value.get() == 0
    await store.touch([recs[0][0].key])  # recently used: must survive
    for rec in recs[18:]:
        await put_all(store, [rec])
        assert store.accounting.live_bytes <= 0.9 * 20 * record_bytes, "the budget holds at every put"
    # The 19th put went over: the 9 least recently used went, down to the low watermark (10 records).
    assert store.metrics.evictions._value.get() == 9
    assert [store.lookup([r[0].key]) for r in recs[:11]] == [1] + [0] * 9 + [1]
    await store.retention.maintain()
    assert store.segments.disk_bytes <= 0.9 * 20 * record_bytes, "compaction reclaims the dead bytes"
    assert store.metrics.evictions._value.get() == 9, "live bytes were under budget: nothing more evicted"
    for block, _, _, payload in recs[-5:]:
        assert await read_all(store, block.key) == payload


async def test_compaction_reclaims_deleted_space(open_store):
    record_bytes = sum(map(len, records(1)[0][1::2]))
    store = await open_store(segment_bytes=4 * (FRAME_BYTES + record_bytes),
                             compaction_min_garbage=0.5, hot_tier_bytes=0)
    recs = records(12)
    await put_all(store, recs)
    disk_before = store.segments.disk_bytes
    assert await store.delete([r[0].key for r in recs[::2]]) == 6
    await store.retention.maintain()
    assert store.segments.disk_bytes <= disk_before - 5 * record_bytes
    assert store.metrics.copied_forward._value.get() > 0
    for block, _, _, payload in recs[1::2]:
        assert await read_all(store, block.key) == payload


async def test_flipped_payload_byte_on_disk_is_a_counted_miss(open_store):
    store = await open_store(hot_tier_bytes=0)
    recs = records(2)
    await put_all(store, recs)
    entry = store.index.get(recs[1][0].key)
    segment = store.segments.segments[entry.segment]
    spot = entry.offset + entry.header_len + 2 * NS.layer_bytes + 5  # layer 2
    byte = os.pread(segment.fd, 1, spot)
    os.pwrite(segment.fd, bytes([byte[0] ^ 0x01]), spot)
    assert await read_all(store, recs[1][0].key, 0, 2) == recs[1][3][: 2 * NS.layer_bytes]  # layers 0-1 are fine
    with pytest.raises(CorruptRecord, match="checksum"):
        await read_all(store, recs[1][0].key)
    assert store.lookup([recs[1][0].key]) == 0, "a corrupt block is dropped from the index"
    assert await read_all(store, recs[0][0].key) == recs[0][3]


async def test_flipped_header_byte_on_disk_is_a_counted_miss(open_store):
    store = await open_store(hot_tier_bytes=0)
    recs = records(1)
    await put_all(store, recs)
    entry = store.index.get(recs[0][0].key)
    segment = store.segments.segments[entry.segment]
    os.pwrite(segment.fd, b"\xff", entry.offset + 60)
    miss = await store.open_block(recs[0][0].key)
    assert isinstance(miss, Miss) and miss.status == MissStatus.CORRUPT and miss.cause == "checksum"
    assert store.metrics.misses.labels(cause="checksum")._value.get() == 1


async def test_eviction_and_compaction_landing_inside_a_read_leave_the_read_intact(open_store):
    # The read holds its segment; eviction and compaction run in the window between open and read.
    record_bytes = sum(map(len, records(1)[0][1::2]))
    store = await open_store(segment_bytes=2 * (FRAME_BYTES + record_bytes), hot_tier_bytes=0)
    recs = records(4)
    await put_all(store, recs)
    found = await store.open_block(recs[0][0].key)
    await store.delete([recs[0][0].key, recs[1][0].key])
    await store.retention.maintain()  # the segment holding block 0 is now all garbage and deleted
    assert found.segment.deleted
    assert await store.read_layers(found, 0, NS.num_layers) == recs[0][3]
    store.close_block(found)
    assert store.lookup([recs[0][0].key]) == 0


async def test_a_full_index_map_grows(open_store):
    store = await open_store(lmdb_map_bytes=64 * 1024, lmdb_max_map_bytes=64 * 2**20)
    recs = records(400)
    await put_all(store, recs)
    assert store.lookup([r[0].key for r in recs]) == 400
    assert store.index.stat()["map_bytes"] > 64 * 1024


async def test_a_map_that_cannot_grow_evicts_instead_of_crashing(open_store):
    store = await open_store(lmdb_map_bytes=2**20, lmdb_max_map_bytes=2**20, hot_tier_bytes=0)
    recs = records(10000)
    results = await put_all(store, recs)
    assert results.count(PutResult.STORED) == 10000
    assert store.metrics.evictions._value.get() > 0
    assert store.lookup([recs[-1][0].key]) == 1
    assert await read_all(store, recs[-1][0].key) == recs[-1][3]


async def test_restart_drops_index_entries_without_whole_records(open_store, clock):
    store = await open_store()
    recs = records(4)
    await put_all(store, recs)
    last = store.index.get(recs[-1][0].key)
    await store.close()
    segment_path = next(store.segments.directory.glob("*.sealed"))
    with open(segment_path, "r+b") as f:  # lose the tail of the last record, as a crash might
        f.truncate(last.offset + last.header_len + 10)
    os.rename(segment_path, segment_path.with_suffix(".open"))
    reopened = await open_store()
    assert reopened.lookup([r[0].key for r in recs]) == 3
    assert isinstance(await reopened.open_block(recs[-1][0].key), Miss)
    assert os.path.getsize(next(reopened.segments.directory.glob("*.sealed"))) == last.offset - FRAME_BYTES


async def test_dram_eviction_during_a_read_never_rewrites_what_the_reader_sends(open_store):
    # One record fits the DRAM tier: every put evicts the previous one and recycles its buffer.
    record_bytes = sum(map(len, records(1)[0][1::2]))
    store = await open_store(hot_tier_bytes=record_bytes)
    recs = records(4)

    async def put_in_recyclable_buffer(header_bytes, header, payload):
        buffer = store.hot.buffer(len(payload))  # block 0's buffer, were it not pinned
        buffer[:] = payload
        await store.put(header, header_bytes, [buffer])

    await put_in_recyclable_buffer(*recs[0][1:])
    found = await store.open_block(recs[0][0].key)
    assert found.tier == "dram"
    for _, header_bytes, header, payload in recs[1:]:
        await put_in_recyclable_buffer(header_bytes, header, payload)
    assert bytes(await store.read_layers(found, 0, NS.num_layers)) == recs[0][3]
    store.close_block(found)


async def test_ssd_reads_fill_the_dram_tier_and_count_their_tier(open_store):
    store = await open_store()
    recs = records(2)
    await put_all(store, recs)
    for block, *_ in recs:  # an empty DRAM tier, as after a restart
        store.hot.discard(block.key)
    found = await store.open_block(recs[0][0].key)
    assert found.tier == "ssd"
    assert bytes(await store.read_layers(found, 0, NS.num_layers)) == recs[0][3]
    store.record_hits([found], NS.block_bytes)
    store.close_block(found)
    again = await store.open_block(recs[0][0].key)
    assert again.tier == "dram"
    store.close_block(again)
    assert store.metrics.hits.labels(tier="ssd")._value.get() == 1


async def test_a_segment_truncated_under_a_running_daemon_is_a_counted_miss(open_store):
    store = await open_store(hot_tier_bytes=0)
    recs = records(3)
    await put_all(store, recs)
    last = store.index.get(recs[2][0].key)
    os.ftruncate(store.segments.segments[last.segment].fd, last.offset + last.header_len + NS.layer_bytes)
    found = await store.open_block(recs[2][0].key)
    assert bytes(await store.read_layers(found, 0, 1)) == recs[2][3][: NS.layer_bytes]  # what is left is fine
    with pytest.raises(CorruptRecord, match="truncated"):
        await store.read_layers(found, 0, NS.num_layers)
    store.close_block(found)
    assert store.lookup([recs[2][0].key]) == 0, "the truncated block is dropped"
    assert await read_all(store, recs[1][0].key) == recs[1][3]


async def test_a_put_cancelled_during_its_commit_keeps_index_and_accounting_in_step(open_store):
    # Regression: a cancelled caller used to cancel the index op queued for the writer thread, which
    # then died on set_result, and every later commit hung. A barrier holds the writer so the put's
    # commit is queued when the cancellation lands.
    import asyncio
    import threading
    store = await open_store()
    recs = records(3)
    block, header_bytes, header, payload = recs[0]
    gate, holding = threading.Event(), threading.Event()
    store.index.submit(lambda txn, db: (holding.set(), gate.wait(10)))
    while not holding.is_set():
        await asyncio.sleep(0.001)
    task = asyncio.ensure_future(store.put(header, header_bytes, [payload]))
    while store.index._queue.qsize() < 1:
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    gate.set()
    assert await asyncio.wait_for(put_all(store, recs[1:]), 10) == [PutResult.STORED] * 2, "the writer is alive"
    indexed = store.index.get(block.key) is not None
    assert (block.key in store.policy) == indexed
    assert store.accounting.live_bytes == sum(len(r[1]) + len(r[3]) for r in recs[1:]) + (
        len(header_bytes) + len(payload) if indexed else 0)


async def test_restart_rebuilds_the_prefix_tree_for_a_prefix_aware_policy(open_store):
    store = await open_store(eviction_policy="prefix-lfu")
    chains = [records(5, seed=s) for s in (1, 2)]
    for chain in chains:
        await put_all(store, chain)
    await store.close()
    reopened = await open_store(eviction_policy="prefix-lfu")
    order = [reopened.policy.pop_victim() for _ in range(10)]
    for chain in chains:  # every chain goes leaf first: no block is ever chosen before its children
        keys = [block.key for block, *_ in chain]
        assert [k for k in order if k in keys] == keys[::-1]


async def test_restart_keeps_prefix_reuse_classes_and_what_it_learned(open_store):
    store = await open_store(eviction_policy="prefix-reuse")
    chains = [records(4, seed=s) for s in (1, 2, 3)]
    for chain, hint in zip(chains, (ReuseHint(0, 4), ReuseHint(4, 4, 2), ReuseHint(2, 4, 5))):
        for _, header_bytes, header, payload in chain:
            await store.put(header, header_bytes, [payload], hint)
    first = [block.key for block, *_ in chains[0]]
    await store.touch(first)  # reads teach it something: these blocks were used again
    store.advise([block.key for block, *_ in chains[1]], continues=False)
    classes = {block.key: store.policy.class_of(block.key) for chain in chains for block, *_ in chain}
    assert len(set(classes.values())) == 3, "three kinds of request, one of them advised"
    learned = store.policy.snapshot()
    await store.close()

    reopened = await open_store(eviction_policy="prefix-reuse")
    assert {key: reopened.policy.class_of(key) for key in classes} == classes
    again = reopened.policy.snapshot()
    assert {k: v for k, v in again.items() if k != "now"} == {k: v for k, v in learned.items() if k != "now"}
    assert again["uses"] and again["reuses"], "the reuse it had seen came back, not relearned"


async def test_a_damaged_learned_state_is_dropped_and_the_blocks_still_come_back(open_store, tmp_path):
    store = await open_store(eviction_policy="prefix-reuse")
    chain = records(3, seed=4)
    for _, header_bytes, header, payload in chain:
        await store.put(header, header_bytes, [payload], ReuseHint(3, 3, 1))
    klass = store.policy.class_of(chain[0][0].key)
    await store.close()
    index = Index(tmp_path / "data" / "index", 2**24, 2**26, fsync=False)
    index.submit(index.set_meta_op(POLICY_STATE, b'{"policy": "prefix-reuse", "uses": [1, 2')).result()
    index.close()

    reopened = await open_store(eviction_policy="prefix-reuse")
    assert reopened.lookup([block.key for block, *_ in chain]) == 3
    assert reopened.policy.class_of(chain[0][0].key) == klass != 0
    assert reopened.policy.snapshot()["uses"] == {}, "learning starts afresh"


async def test_a_removal_cut_short_by_a_full_disk_accounts_for_the_commits_that_went_through(open_store, monkeypatch):
    # Regression: the blocks of the commits before the failing one had left the index but not the
    # accounting, so their segment never looked empty enough to delete.
    from kvstore.server.index import IndexNoSpace
    store = await open_store(hot_tier_bytes=0)
    recs = records(20)
    await put_all(store, recs)
    monkeypatch.setattr(store.index, "fill_ratio", lambda: 0.7)  # nearly full: removals go 8 keys a commit
    commit, commits = store.commit, []

    async def failing_third(op, sync=()):
        commits.append(op)
        if len(commits) == 3:
            raise IndexNoSpace("test")
        return await commit(op, sync)
    monkeypatch.setattr(store, "commit", failing_third)
    with pytest.raises(IndexNoSpace):
        await store.remove([r[0].key for r in recs])
    left = [entry for entry in store.index.get_many([r[0].key for r in recs]) if entry is not None]
    assert len(left) == 4
    assert store.accounting.live_bytes == sum(entry.record_len for entry in left)
    assert sum(s.live_bytes for s in store.segments.segments.values()) == store.accounting.live_bytes
    assert store.accounting.class_blocks[left[0].class_id] == 4
    assert [r[0].key in store.policy for r in recs] == [False] * 16 + [True] * 4


async def test_victims_whose_removal_did_not_commit_stay_first_in_line(open_store):
    # A full disk refused the commits: given back to the policy as new blocks, the oldest would outlive
    # the newest, and pass after pass of refusals evicted what was just written (the full-disk fault test).
    store = await open_store(hot_tier_bytes=0)
    recs = records(4)
    await put_all(store, recs)
    keys = [r[0].key for r in recs]
    first, second = store.next_victim()[0], store.next_victim()[0]
    assert (first, second) == (keys[0], keys[1])  # least recently used first
    store.track_again([first, second])
    assert [store.next_victim()[0] for _ in range(3)] == keys[:3], "the refused victims come first, in order"
    store.track_again(keys[:3])
    assert await store.delete([keys[0]]) == 1
    assert store.next_victim()[0] == keys[1], "a victim removed meanwhile is skipped"


async def test_a_full_disk_lets_the_policy_choose_what_compaction_evicts(open_store):
    """On a full disk compaction cannot copy, so emptying a segment evicts its live records. The eviction
    policy's victims go first, and leave their segments dead: a little garbage (a copy the full disk cut
    short) in the segment of the newest blocks must not cost them all."""
    record_bytes = sum(map(len, records(1)[0][1::2]))
    store = await open_store(segment_bytes=4 * (FRAME_BYTES + record_bytes),
                             compaction_min_garbage=0.5, hot_tier_bytes=0,
                             eviction_policy="lru")
    recs = records(13)  # segments of four: three sealed, the newest open
    await put_all(store, recs)
    assert await store.delete([recs[8][0].key]) == 1  # the newest sealed segment, a quarter dead
    store.retention.disk_full = True
    await store.retention._compact(store.accounting.disk_bytes - 4 * record_bytes)  # one segment to free
    assert store.lookup([recs[0][0].key]) == 0, "the least recently used blocks went"
    for block, _, _, payload in recs[4:8] + recs[9:]:
        assert await read_all(store, block.key) == payload


async def test_a_full_disk_never_empties_a_mostly_dead_segment_of_the_newest_blocks_first(open_store):
    """Compaction copies old blocks forward beside the newest puts; the policy evicts those old copies first,
    so the newest segment can be mostly dead while its live records are the newest blocks. On a full disk,
    emptying it would evict them: the policy's victims go first, however dead that segment is."""
    record_bytes = sum(map(len, records(1)[0][1::2]))
    store = await open_store(segment_bytes=4 * (FRAME_BYTES + record_bytes),
                             compaction_min_garbage=0.5, hot_tier_bytes=0,
                             eviction_policy="lru")
    recs = records(13)  # segments of four: three sealed, the newest open
    await put_all(store, recs)
    assert await store.delete([r[0].key for r in recs[8:11]]) == 3  # the newest sealed segment, three quarters dead
    store.retention.disk_full = True
    await store.retention._compact(store.accounting.disk_bytes - 4 * record_bytes)  # one segment to free
    assert store.lookup([recs[0][0].key]) == 0, "the least recently used blocks went"
    for block, _, _, payload in recs[4:8] + recs[11:]:
        assert await read_all(store, block.key) == payload


async def test_the_background_loop_ends_when_cancelled_as_it_is_woken(open_store):
    # Shutdown cancels the loop while a put may be waking it. Python 3.11's asyncio.wait_for returns the
    # woken wait's result instead of raising when both happen at once (a cancellation swallowed): the loop
    # went round again, and the daemon's graceful stop waited for it forever.
    store = await open_store()
    loop = asyncio.create_task(store.retention.run())
    store.retention.wake.set()
    while not store.retention.passes:  # a pass done: the loop is back in its wait, for nothing awaits in between
        await asyncio.sleep(0)
    store.retention.wake.set()
    loop.cancel()  # before the woken wait has run: both land in the same turn of the event loop
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(loop, timeout=30)  # a hang guard: the loop ends at once, or never
