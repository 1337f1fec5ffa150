"""The block store of one daemon: index + segments + DRAM tier, with retention and capacity.

Runs on the daemon's event loop; file I/O goes to a thread pool, index writes to the index's writer
thread. Guarantees (docs/design.md section 10):
* a record becomes visible only after its bytes are written (and synced, with durability "fsync");
* every byte read from the segment files into the daemon's memory is verified against its header's
  checksums first; bytes read straight into a client's shared region are verified by the client, which
  names a block that fails (Verify) for the daemon to check in its own memory (block_reader.py); the scrub
  checks every record in turn (scrub.py);
* start-up cuts torn tails, drops index entries whose place holds no record of their key (and re-indexes
  the key's own record if one is found), and rebuilds a missing or damaged index from the segments
  (recovery.py).

Beside it: what it holds, in numbers (accounting.py); the access times and extended expiries not yet in
the index (access_times.py); expiry, eviction and compaction (retention.py, which acts through the
methods under "for retention"); promotion of blocks into the DRAM tier before they are read (promotion.py,
which reads through the methods under "for promotion"). Its answers are its own (outcomes.py), not the
protocol's.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvstore import faults
from kvstore.eviction import EvictionPolicy, ReuseHint, make_policy
from kvstore.record import CorruptRecord, RecordBytes, RecordHeader
from kvstore.server.access_log import KEYS_PER_CALL, AccessLog
from kvstore.server.access_times import AccessTimes
from kvstore.server.accounting import Accounting
from kvstore.server.block_reader import BlockReader, CopyCheck, OpenBlock
from kvstore.server.config import ServerConfig
from kvstore.server.frames import FrameKeyDamaged, FrameKeyMissing
from kvstore.server.header_cache import HeaderCache
from kvstore.server.hot_keys import HotKeys
from kvstore.server.hot_tier import HotTier
from kvstore.server.index import Entry, Index, IndexDamaged, IndexNoSpace
from kvstore.server.key_digest import KeyDigest
from kvstore.server.metrics import Metrics
from kvstore.server.names import Names, Scope
from kvstore.server.outcomes import Miss, MissStatus, PutResult
from kvstore.server.promotion import GetsInFlight, Promoter
from kvstore.server.recovery import open_index, reconcile, replace_damaged, set_aside
from kvstore.server.retention import Places, Retention, SegmentRecord
from kvstore.server.segments import Placement, Segment, SegmentSet
from kvstore.server.verify_meter import VerifyMeter

log = logging.getLogger(__name__)
# Evict once the LMDB map is this full at its maximum size: deleting needs free pages as well.
INDEX_HIGH_FILL = 0.75
PRIVATE_DIR = 0o700  # every tenant's KV bytes and keys are in here: the daemon's user's alone


class DiskFull(Exception):
    """The segment directory's file system has no room; the put was not stored."""


class DataDirInUse(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class PlacedPut:
    """A put whose record is written to its place while its payload still arrives (`BlockStore.place`)."""

    placement: Placement
    expires_ms: int  # chosen with the place: the segment's expiry bucket holds it


class BlockStore:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.time, policy: EvictionPolicy | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.policy = policy or make_policy(config.eviction_policy, config.capacity_bytes)
        self.hot = HotTier(config.hot_tier_bytes, prefetch_bytes=config.promote_budget_bytes,
                           on_prefetch_end=self.metrics.prefetch_ended,
                           prefetch_max_age_s=config.promote_max_age_s, clock=clock)
        self.gets_in_flight = GetsInFlight(self.metrics.gets_in_flight,  # the transports count each Get they serve
                                           self.metrics.gets_waiting_on_client)
        self.promoter = Promoter(self, self.hot, self.gets_in_flight, self.metrics, config.promote_queue_keys)
        self.verify_meter = VerifyMeter(config.verify_bytes_per_s, config.verify_recheck_s, clock)
        self.hot_keys = HotKeys(config.hot_reads, config.hot_window_s) if config.hot_replicas > 1 else None
        self.names = Names(config)
        self.access = AccessTimes(self.policy, self.names.ttl_ms)
        self._pending: dict[bytes, asyncio.Future] = {}  # key -> done when the put writing it ends
        self._background: set[asyncio.Task] = set()  # work a caller started and does not wait for (`background`)
        # victims whose removal did not commit (a full disk), with their bytes: first in line at the next
        # eviction, as the policy chose them. Given back to the policy they would count as new blocks, and a
        # full disk that refuses commit after commit would turn its order round: the newest blocks evicted.
        self._victims_again: deque[tuple[bytes, int]] = deque()
        self.retention = Retention(self, config, self.metrics, clock)
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-io")
        self._lock_fd: int | None = None
        self.closed = False
        self.key_digest = KeyDigest(config.data_dir / "log-digest.key")  # stands for keys in every log line
        self.access_log = (AccessLog(config.access_log, config.access_log_max_bytes, self.key_digest)
                           if config.access_log else None)
        self.index: Index
        self.segments: SegmentSet
        self.accounting: Accounting
        self._reader: BlockReader

    # -- life cycle -----------------------------------------------------------------------------

    async def open(self) -> None:
        data_dir = self.config.data_dir
        data_dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        self._lock_fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataDirInUse(f"another kvstore-server is using {data_dir}; "
                               "give each daemon its own data_dir") from None
        fsync = self.config.durability == "fsync"
        self.segments = self._open_segments(fsync)
        # A damaged index is moved aside and rebuilt (kvstore/server/recovery.py, docs/operations.md).
        self.index, rebuild_reason = open_index(data_dir / "index", self.config.lmdb_map_bytes,
                                                self.config.lmdb_max_map_bytes, fsync)
        self.accounting = Accounting(self.segments, self.config.tenant_max_share)
        self._reader = BlockReader(self.segments, self.hot, self.run_io, self.drop_corrupt,
                                   HeaderCache(self.config.header_cache_bytes))
        self.names.load(self.index)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._recover, rebuild_reason)
        self.refresh_gauges()

    def _open_segments(self, fsync: bool) -> SegmentSet:
        """The segments, or none: segments whose frame key is gone (a data directory from before frames, or a
        key lost) cannot tell their records from bytes a tenant sent, so they are moved aside, never deleted,
        and the daemon starts without them (the index's entries into them are then dropped as stale)."""
        path = self.config.data_dir / "segments"
        args = (self.config.segment_bytes, fsync, self.config.direct_io_min_bytes)
        try:
            return SegmentSet(path, *args)
        except (FrameKeyMissing, FrameKeyDamaged) as exc:
            aside = set_aside(path, "unframed", exc)
            log.error("%s; moved the segments aside to %s (kept, never deleted) and starting without them", exc, aside)
            return SegmentSet(path, *args)

    def _recover(self, rebuild_reason: str = "") -> None:
        """Make the index agree with the segments (recovery.py), then account for what it holds."""
        started = time.perf_counter()
        self.index, live, stale = reconcile(self.index, self.segments, rebuild_reason, self._replace_damaged,
                                            self.now_ms())
        self.names.load(self.index)  # a rebuild names the classes and tenants its records carry
        live.sort(key=lambda item: (item[1].access_ms, item[0]))  # the prefix tree and the tenants' recency too
        self.access.restore_learned(self.index)
        for key, entry in live:
            self.accounting.added(key, entry)
            self.policy.restore(key, entry.record_len, entry.parent or None, entry.policy_class)
        log.info("recovered %d blocks in %d segments (%d stale index entries dropped) in %.1f s",
                 len(live), len(self.segments.segments), stale, time.perf_counter() - started)

    def _replace_damaged(self, damage: IndexDamaged) -> tuple[Index, Path]:
        config = self.config
        self.index, aside = replace_damaged(self.index, config.data_dir / "index", config.lmdb_map_bytes,
                                            config.lmdb_max_map_bytes, config.durability == "fsync", damage)
        self.names.load(self.index)
        return self.index, aside

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*self._background, return_exceptions=True)
            await self.access.flush(self.index, self.commit)
            if unsaved := self.access.unsaved():
                log.warning("no room to save the access times of %d blocks since the last flush: they are lost, "
                            "as in a crash", unsaved)
        finally:
            try:
                if self.access_log is not None:
                    self.access_log.close()
                await loop.run_in_executor(self._executor, self.segments.close)
            finally:
                await loop.run_in_executor(None, self.index.close)
                self._executor.shutdown(wait=True)
                if self._lock_fd is not None:
                    os.close(self._lock_fd)

    # -- helpers ----------------------------------------------------------------------------------

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def bucket_end(self, expires_ms: int) -> int:
        bucket = self.config.expiry_bucket_s
        return int(math.ceil(expires_ms / 1000 / bucket) * bucket)

    def class_known(self, name: str) -> bool:
        return self.names.class_known(name)

    def class_name(self, entry: Entry | None) -> str:
        return self.names.class_name(entry.class_id) if entry is not None else ""

    def background(self, task: asyncio.Task) -> None:
        """Keep `task` until it ends (the loop holds only weak references), and let `close` wait for it."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def run_io(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def commit(self, op, sync: Sequence[Segment] = ()):
        return await asyncio.wrap_future(self.index.submit(op, sync))

    # -- reads ------------------------------------------------------------------------------------

    def present(self, keys: Sequence[bytes], scope: Scope = None) -> bytes:
        """For each key on its own, 1 if it exists, has not expired and belongs to a tenant in `scope`."""
        return self.index.live_each(keys, self.now_ms(), self.access.extended, self.names.tenant_ids(scope))

    def lookup(self, keys: Sequence[bytes], scope: Scope = None, promote: bool = False) -> int:
        """How many leading keys exist, have not expired, and belong to a tenant in `scope`; with `promote`,
        those are queued for promotion into the DRAM tier (the caller is about to read them)."""
        now_ms = self.now_ms()
        hits = self.index.live_prefix(keys, now_ms, self.access.extended, self.names.tenant_ids(scope))
        if self.access_log is not None:
            logged = keys[:KEYS_PER_CALL]
            for position, key in enumerate(logged):
                self.access_log.write(now_ms, "lookup", key, "", "hit" if position < hits else "missing", "", 0)
            self.access_log.skipped(len(keys) - len(logged))
        self.metrics.lookup_keys.inc(len(keys))
        self.metrics.lookup_hits.inc(hits)
        if promote:
            self.promoter.enqueue(keys[:hits], "lookup")
        return hits

    async def open_block(self, key: bytes, scope: Scope = None) -> OpenBlock | Miss:
        """Find a block of a tenant in `scope` and verify its header; the caller must `close_block` an OpenBlock."""
        entry = self.index.get(key)
        if not self.names.visible(entry, scope):
            return self.miss(MissStatus.MISSING, "missing", key)
        if self.access.expiry(key, entry) <= self.now_ms():
            return self.miss(MissStatus.EXPIRED, "expired", key, entry)
        found = await self._reader.open(key, entry)
        if isinstance(found, Miss):
            return self.miss(found.status, found.cause, key, entry)
        return found

    async def read_layers(self, block: OpenBlock, begin: int, end: int,
                          into: memoryview | None = None) -> RecordBytes:
        """Payload bytes of layers [begin, end), verified (BlockReader.read_layers)."""
        return await self._reader.read_layers(block, begin, end, into)

    async def warm(self, block: OpenBlock) -> None:
        """Bring a block read from SSD into the DRAM tier (whole), so its layers are served from memory."""
        await self._reader.warm(block)

    def close_block(self, block: OpenBlock) -> None:
        self._reader.close(block)

    def replicas_wanted(self, key: bytes) -> int:
        """Count a read of `key`; the copies clients should keep of it (hot_replicas) if it is hot, else 0."""
        if self.hot_keys is None or not self.hot_keys.read(key):
            return 0
        self.metrics.hot_reads.inc()
        return self.config.hot_replicas

    def record_hits(self, blocks: Sequence[OpenBlock], served_bytes: int) -> None:
        """Count and retain what was served; leaf first, so parents stay at least as recent as children."""
        now_ms = self.now_ms()
        for block in reversed(blocks):
            self.metrics.hits.labels(tier=block.tier).inc()
            self.metrics.class_hits.labels(traffic_class=self.class_name(block.entry) or "unknown").inc()
            self.policy.access(block.key)
            self.accounting.accessed(block.entry.tenant_id, block.key)
            self.access.extend(block.key, block.entry, now_ms, block.entry.class_id)
        if self.access_log is not None:
            for block in blocks:
                self.access_log.write(now_ms, "get", block.key, self.class_name(block.entry), "hit", block.tier,
                                      block.entry.payload_len)
        self.metrics.bytes_read.inc(served_bytes)

    def miss(self, status: MissStatus, cause: str, key: bytes, entry: Entry | None = None) -> Miss:
        """Count (and log) a block not served, and say why."""
        self.metrics.misses.labels(cause=cause).inc()
        if self.access_log is not None:
            self.access_log.write(self.now_ms(), "get", key, self.class_name(entry), cause, "", 0)
        return Miss(status, cause)

    async def drop_corrupt(self, key: bytes, entry: Entry) -> None:
        log.warning("dropping corrupt block %s in segment %d at %d", self.key_digest(key), entry.segment, entry.offset)
        await self.remove([key], only_at={key: (entry.segment, entry.offset)}, reason="corrupt")

    # -- writes -----------------------------------------------------------------------------------

    async def place(self, header: RecordHeader) -> PlacedPut | None:
        """A place to write `header`'s record to while its payload still arrives (`write_placed`, then
        `put(..., placed=)`, or `give_up`); None where the record is appended whole once it has arrived: a
        record under `direct_io_min_bytes`, a full disk, or a key with a live copy or a put writing one."""
        key = header.key
        if self.retention.disk_full or key in self._pending:
            return None
        now_ms = self.now_ms()
        entry = self.index.get(key)
        if entry is not None and self.access.expiry(key, entry) > now_ms:
            return None
        expires_ms = now_ms + self.names.ttl_ms(self.names.class_id(header.traffic_class))
        placing = asyncio.ensure_future(self.run_io(self.segments.place, self.bucket_end(expires_ms),
                                                    header.header_len, header.payload_len))
        try:
            with self.retention.appending():
                placement = await asyncio.shield(placing)
        except OSError:  # no room for a new segment file: the append says so, once the record is in
            return None
        except asyncio.CancelledError:  # the record timed out, or the daemon stops: the place is let go
            placing.add_done_callback(self._let_go_unused)
            raise
        return None if placement is None else PlacedPut(placement, expires_ms)

    def _let_go_unused(self, placing: asyncio.Future) -> None:
        if not placing.cancelled() and placing.exception() is None and placing.result() is not None:
            self._let_go(placing.result(), written=0, failed=False, erase=True)

    def _let_go(self, placement: Placement, written: int, failed: bool, erase: bool) -> None:
        """Let a placed record's place go, on an I/O thread (the segment's lock may be held by an append): the
        record is indexed, or it is erased first (`erase`: its header pages and `written` payload bytes)."""
        def let_go() -> None:
            erased = False
            try:
                erased = erase and self.segments.erase(placement, written)
            finally:
                self.segments.finish(placement, failed, given_up=erased)
        try:
            self._executor.submit(let_go)
        except RuntimeError:  # the store has closed its I/O threads: finish here
            let_go()

    async def write_placed(self, placed: PlacedPut, start: int, payload: memoryview, last: bool) -> None:
        """Write verified payload bytes from `start` (SegmentSet.write_payload)."""
        with self.retention.appending():
            await self.run_io(self.segments.write_payload, placed.placement, start, payload, last)

    async def write_placed_header(self, placed: PlacedPut, header_bytes: bytes) -> None:
        with self.retention.appending():
            await self.run_io(self.segments.write_header, placed.placement, header_bytes)

    def give_up(self, placed: PlacedPut, written: int, failed: bool) -> None:
        """A placed record will not be put there (its client went away, or a write failed: `failed`, and
        the segment takes no more records): erase it (`written` payload bytes), and let the place go."""
        self._let_go(placed.placement, written, failed, erase=True)

    async def put(self, header: RecordHeader, header_bytes: bytes, chunks: Sequence[RecordBytes],
                  hint: ReuseHint | None = None, placed: PlacedPut | None = None) -> PutResult:
        """Store one verified record: STORED, or EXISTS if a live copy is held already. Raises DiskFull.

        `hint` (from the engine, about the request that computed the block) goes to the eviction policy.
        `placed`: the record is written already, header last, at that place (`place`)."""
        try:
            return await self._put(header, header_bytes, chunks, hint, placed)
        finally:
            if placed is not None:  # a whole record that is not indexed there (EXISTS, a failure) is erased
                entry = self.index.get(header.key)
                indexed = entry is not None and (entry.segment, entry.offset) == (placed.placement.segment.id,
                                                                                   placed.placement.offset)
                self._let_go(placed.placement, header.payload_len, failed=False, erase=not indexed)

    async def _put(self, header: RecordHeader, header_bytes: bytes, chunks: Sequence[RecordBytes],
                   hint: ReuseHint | None, placed: PlacedPut | None) -> PutResult:
        key = header.key
        class_id = self.names.class_id(header.traffic_class)
        tenant_id = await self.names.tenant_id(header.tenant, lambda t: self.commit(self.index.tenant_id_op(t)))
        while (writing := self._pending.get(key)) is not None:
            # Another put of this key is writing it: its outcome is ours (an EXISTS answered before its
            # record is durable would acknowledge a block a crash then loses). If it failed, we try.
            await asyncio.wait([writing])
        now_ms = self.now_ms()
        entry = self.index.get(key)
        if entry is not None and entry.tenant_id != tenant_id:
            # The tenant is part of every key (chain_hash), so only a crafted hash collision gets here. The
            # block stays as it is, and the answer is a new block's: the writer learns nothing from it.
            self.metrics.puts.labels(result="foreign").inc()
            return PutResult.STORED
        if entry is not None and self.access.expiry(key, entry) > now_ms:
            self.access.extend(key, entry, now_ms, class_id)
            self.metrics.puts.labels(result="exists").inc()
            if self.access_log is not None:
                self.access_log.write(now_ms, "put", key, header.traffic_class, "exists", "", 0)
            return PutResult.EXISTS
        self._pending[key] = asyncio.get_running_loop().create_future()
        try:
            expires_ms = now_ms + self.names.ttl_ms(class_id)
            if placed is not None:
                segment, offset, expires_ms = placed.placement.segment, placed.placement.offset, placed.expires_ms
            elif self.retention.disk_full:  # what room eviction makes goes to the index's reserve first
                raise DiskFull("the disk is full and eviction is making room; retry shortly")
            else:
                segment, offset = await self._append(header, header_bytes, chunks, expires_ms)
            new = Entry(segment.id, offset, len(header_bytes), header.payload_len, expires_ms, now_ms, class_id,
                        header.parent, self.policy.classify(hint), tenant_id)
            if self.index.fill_ratio() > INDEX_HIGH_FILL:
                await self.retention.evict_bytes(self.policy.tracked_bytes * 0.05)
            payload = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            try:
                # Shielded: a caller that goes away must not leave the index committed and the accounting not.
                await asyncio.shield(self._commit_put(key, new, segment, header_bytes, payload, hint))
            except IndexNoSpace as exc:  # the record's bytes are left dead, for compaction
                self.retention.disk_filled()
                raise DiskFull(f"no space left to index a {header.record_len}-byte record") from exc
            await self.retention.after_put(tenant_id)
            return PutResult.STORED
        finally:
            self._pending.pop(key).set_result(None)

    async def _append(self, header: RecordHeader, header_bytes: bytes, chunks: Sequence[RecordBytes],
                      expires_ms: int) -> tuple[Segment, int]:
        try:
            with self.retention.appending():
                return await self.run_io(self.segments.append, self.bucket_end(expires_ms), header_bytes, chunks)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                self.retention.disk_filled()
                raise DiskFull(f"no space left for a {header.record_len}-byte record") from exc
            raise

    async def _commit_put(self, key: bytes, new: Entry, segment: Segment, header_bytes: bytes,
                          payload: RecordBytes, hint: ReuseHint | None) -> None:
        sync = [segment] if self.config.durability == "fsync" else []
        old = await self.commit(self.index.put_op(key, new), sync)
        if old is not None:
            self.accounting.removed(key, old)
        self.accounting.added(key, new)
        self.policy.insert(key, new.record_len, new.parent or None, hint)
        self.hot.put(key, header_bytes, payload, done_with=True)
        self._reader.headers.put(key, (segment.id, new.offset), header_bytes)
        self.metrics.puts.labels(result="stored").inc()
        if self.access_log is not None:
            self.access_log.write(new.access_ms, "put", key, self.names.class_name(new.class_id), "stored", "",
                                  new.record_len)
        self.metrics.bytes_written.inc(new.record_len)

    async def remove(self, keys: Sequence[bytes], only_at: Places | None = None,
                     reason: str = "deleted") -> list[tuple[bytes, Entry]]:
        """Remove the blocks of `keys` (a key in `only_at` only while it is still at that place); returns
        those removed. `reason` (deleted, evicted, expired, corrupt) goes to the access log. Raises
        IndexNoSpace: what earlier commits removed is accounted for all the same."""
        # Hashed keys are spread over every leaf page and a delete copies each page it touches, so in a
        # nearly full map one big delete would need a free copy of the tree: use small transactions.
        batch = 8 if len(keys) > 8 and self.index.fill_ratio() > INDEX_HIGH_FILL * 0.8 else 256
        removed = []
        for start in range(0, len(keys), batch):
            if self.access_log is not None:  # before the commit, so that a crash never loses the line of a removal
                chunk = keys[start : start + batch]
                held = [(key, self.class_name(entry)) for key, entry in zip(chunk, self.index.get_many(chunk))
                        if entry is not None]
                self.access_log.write_through(self.now_ms(), "remove", held, reason)
            done = await self.commit(self.index.remove_op(keys[start : start + batch], only_at))
            for key, entry in done:
                self.accounting.removed(key, entry)
                self.policy.remove(key)
                self.hot.discard(key)
                self.access.forget(key)
            removed += done
        return removed

    async def touch(self, keys: Sequence[bytes], class_name: str = "", scope: Scope = None) -> int:
        now_ms = self.now_ms()
        keys = distinct(keys)
        touched = 0
        for key, entry in zip(keys, self.index.get_many(keys)):
            if not self.names.visible(entry, scope) or self.access.expiry(key, entry) <= now_ms:
                continue
            class_id = self.names.class_id(class_name) if class_name else entry.class_id
            self.access.extend(key, entry, now_ms, class_id)
            self.policy.access(key)
            self.accounting.accessed(entry.tenant_id, key)
            touched += 1
        return touched

    async def delete(self, keys: Sequence[bytes], scope: Scope = None) -> int:
        keys = self.in_scope(keys, scope)
        self.promoter.cancel(keys)
        return len(await self.remove(keys))

    def in_scope(self, keys: Sequence[bytes], scope: Scope) -> Sequence[bytes]:
        """The distinct keys whose blocks a caller limited to `scope` may act on."""
        keys = distinct(keys)
        if scope is None:
            return keys
        return [key for key, entry in zip(keys, self.index.get_many(keys)) if self.names.visible(entry, scope)]

    def advise(self, keys: Sequence[bytes], continues: bool, scope: Scope = None) -> int:
        """Tell the eviction policy whether the conversation that put `keys` goes on; how many it holds.

        A conversation that goes on will send `keys` (its prompt, in prefix order) again soon: those not
        expired are queued for promotion into the DRAM tier. One that ended takes them out of the queue."""
        advice = ReuseHint(0, 0, continues=continues)
        in_scope = self.in_scope(keys, scope)
        held = [key for key in in_scope if key in self.policy]
        for key in held:
            self.policy.advise(key, advice)
            self.access.reclass(key, self.policy.class_of(key))
        self.metrics.advised.labels(continues=str(continues).lower()).inc(len(held))
        if not continues:
            self.promoter.cancel(in_scope)
        elif self.promoter.enabled:
            self.promoter.enqueue([key for key, live in zip(held, self.present(held)) if live], "advice")
        return len(held)

    # -- for promotion (promotion.PromotionSource) -----------------------------------------------

    def record_bytes(self, key: bytes) -> int | None:
        entry = self._live_entry(key)
        return None if entry is None else entry.record_len

    def tenant_of(self, key: bytes) -> int:
        entry = self.index.get(key)
        return 0 if entry is None else entry.tenant_id

    async def read_for_promotion(self, key: bytes) -> tuple[bytes, RecordBytes] | Literal["gone", "unreadable"]:
        entry = self._live_entry(key)
        if entry is None:
            return "gone"
        found = await self._reader.open_segment(key, entry)
        if isinstance(found, Miss):
            return "gone" if found.cause == "segment_gone" else "unreadable"
        try:
            payload = await self._reader.read_layers(found, 0, found.header.n_layers, keep=False)
        except (CorruptRecord, OSError, ValueError):  # a corrupt block is dropped by the read, as by a Get's
            return "unreadable"
        finally:
            self._reader.close(found)
        now = self.index.get(key)
        if now is None or (now.segment, now.offset) != (entry.segment, entry.offset):
            return "gone"  # deleted (or evicted, or stored again) while it was read
        return found.header_bytes, payload

    def _live_entry(self, key: bytes) -> Entry | None:
        """The index entry of `key`, unless it is gone or expired."""
        entry = self.index.get(key)
        return None if entry is None or self.access.expiry(key, entry) <= self.now_ms() else entry

    # -- for retention (retention.Retained) -----------------------------------------------------

    async def checkpoint(self) -> None:
        await self.access.flush(self.index, self.commit)
        if self.access_log is not None:
            self.access_log.flush()

    def commit_bytes(self, keys: int) -> int:
        return self.index.commit_bytes(keys)

    def next_victim(self) -> tuple[bytes, int] | None:
        while self._victims_again:
            key, size = self._victims_again.popleft()
            if key not in self.policy and self.index.get(key) is not None:  # not removed or put again since
                return key, size
        tracked = self.policy.tracked_bytes
        victim = self.policy.pop_victim()
        return None if victim is None else (victim, tracked - self.policy.tracked_bytes)

    def track_again(self, keys: Sequence[bytes]) -> None:
        """Keep the victims whose removal did not commit first in line, in their order, to be evicted later."""
        again = [(key, entry.record_len) for key, entry in zip(keys, self.index.get_many(keys))
                 if entry is not None and key not in self.policy]
        self._victims_again.extendleft(reversed(again))

    def segment_of(self, key: bytes) -> Segment | None:
        entry = self.index.get(key)
        return None if entry is None else self.segments.segments.get(entry.segment)

    def all_segments(self) -> list[Segment]:
        return list(self.segments.segments.values())

    async def seal_segment(self, segment: Segment) -> None:
        await self.run_io(self.segments.seal, segment)

    async def segment_records(self, segment: Segment) -> Iterator[SegmentRecord]:
        records = await self.run_io(lambda: list(self.segments.scan(segment)))
        now_ms = self.now_ms()

        def looked_up() -> Iterator[SegmentRecord]:  # each entry read when its turn comes, not all up front
            for offset, header in records:
                entry = self.index.get(header.key)
                if entry is not None and (entry.segment, entry.offset) != (segment.id, offset):
                    entry = None  # the block lives elsewhere now
                expired = entry is not None and self.access.expiry(header.key, entry) <= now_ms
                yield SegmentRecord(header.key, (segment.id, offset), entry, expired)
        return looked_up()

    async def copy_forward(self, key: bytes, entry: Entry, segment: Segment) -> None:
        """Copy a live record into the open segment of its (extended) expiry, and point the index at the copy."""
        data = memoryview(await self.run_io(SegmentSet.read, segment, entry.offset, entry.record_len))
        expires_ms = self.access.expiry(key, entry)
        with self.retention.appending():
            new_segment, new_offset = await self.run_io(self.segments.append, self.bucket_end(expires_ms),
                                                        data[: entry.header_len], [data[entry.header_len :]])
        faults.hit("compaction.copied")  # the copy written, the index still at the old place
        sync = [new_segment] if self.config.durability == "fsync" else []
        moved = await self.commit(self.index.move_op(key, (segment.id, entry.offset),
                                                     (new_segment.id, new_offset), expires_ms), sync)
        faults.hit("compaction.moved")  # the index at the copy, the old segment not yet deleted
        if moved:  # else the block was removed or replaced meanwhile, and the copy is dead bytes
            self.accounting.moved(entry, segment, new_segment)
            self.metrics.copied_forward.inc(entry.record_len)

    def delete_segment(self, segment: Segment) -> None:
        self.segments.delete(segment)

    # -- for Verify and the scrub (scrub.Scrubbed) --------------------------------------------------

    async def verify(self, keys: Sequence[bytes], scope: Scope = None, who: str = "") -> int:
        """Check again the copies of blocks a client found corrupt, in memory no client can write: the DRAM
        tier's (a corrupt one is discarded from the tier) and the segment file's (a corrupt one drops the
        block, as a Get's read does). Keys of tenants outside `scope`, and absent ones, are passed over, as
        are keys past the budget of the principal `who` or checked recently (verify_meter.py, counted).
        How many of the blocks had a corrupt copy.

        A client's report proves nothing by itself (its own memory may have changed, or it may lie): only
        a check here drops anything, and a good block stays whatever the report said."""
        found = 0
        for key in self.in_scope(keys, scope):
            entry = self.index.get(key)
            if entry is None:
                continue
            skipped = self.verify_meter.skip_reason(who, key, entry)
            if skipped is not None:
                self.metrics.verify_skipped.labels(reason=skipped).inc()
                continue
            self.metrics.verified_blocks.inc()
            checks = {"dram": await self._reader.check_dram_copy(key),
                      "ssd": await self._reader.check_segment_copy(key, entry)}
            for copy, outcome in checks.items():
                if outcome == "corrupt":
                    self.metrics.verify_corrupt.labels(copy=copy).inc()
            if "corrupt" in checks.values():
                found += 1
            elif checks["ssd"] == "good":  # not an I/O error, which says nothing of the bytes
                self.verify_meter.checked_good(key, entry)
        return found

    async def index_batch(self, start: bytes, limit: int) -> list[tuple[bytes, Entry]]:
        """Up to `limit` index entries in key order from the first key at or after `start` (on an I/O thread)."""
        return await self.run_io(self.index.entries_from, start, limit)

    async def check_stored(self, key: bytes, entry: Entry) -> CopyCheck:
        """Check the record `entry` points at, if the index still points there ("absent" if not): read into
        private memory, its header and every layer; a corrupt block is dropped, as a Get drops it."""
        now = self.index.get(key)
        if now is None or (now.segment, now.offset) != (entry.segment, entry.offset):
            return "absent"
        return await self._reader.check_segment_copy(key, now)

    # -- observability ----------------------------------------------------------------------------

    def refresh_gauges(self) -> None:
        m = self.metrics
        for class_id, count in self.accounting.class_blocks.items():
            m.blocks.labels(traffic_class=self.names.class_name(class_id, f"class{class_id}")).set(count)
        m.live_bytes.set(self.accounting.live_bytes)
        m.disk_bytes.set(self.accounting.disk_bytes)
        m.capacity_bytes.set(self.retention.limit())
        m.hot_bytes.set(self.hot.bytes)
        m.promotion_queued.set(len(self.promoter))
        self.hot.release_aged()
        m.promoted_unread_bytes.set(self.hot.prefetched_bytes)
        if self.access_log is not None:
            m.access_log_dropped.set(self.access_log.dropped)
        m.segments.set(len(self.segments.segments))
        stat = self.index.stat()
        m.index_entries.set(stat["entries"])
        m.index_map_bytes.set(stat["map_bytes"])


def distinct(keys: Sequence[bytes]) -> list[bytes]:
    """`keys` without repeats, in order. A key named many times in one request is acted on once, so
    copies of another tenant's key cannot amplify the time a present block takes over an absent one into
    a signal (the work per present key is then one key's, lost in a call's own noise)."""
    return list(dict.fromkeys(keys))
