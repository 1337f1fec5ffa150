"""The block store of one daemon: index + segments + DRAM tier, with retention and capacity.

Runs on the daemon's event loop; file I/O goes to a thread pool, index writes to the index's writer
thread. Guarantees (docs/design.md section 10):
* a record becomes visible only after its bytes are written (and synced, with durability "fsync");
* every byte served from the segment files is verified against its header's checksums first;
* start-up cuts torn tails, drops index entries whose place holds no record of their key (and re-indexes
  the key's own record if one is found), and rebuilds a missing or damaged index from the segments.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from kvstore.eviction import EvictionPolicy, ReuseHint, make_policy
from kvstore.proto import pb
from kvstore.record import NO_TENANT, CorruptRecord, RecordHeader, decode_header
from kvstore.server.access_log import KEYS_PER_CALL, AccessLog
from kvstore.server.config import ServerConfig
from kvstore.server.hot_tier import HotEntry, HotTier
from kvstore.server.index import Entry, Index, IndexDamaged, IndexFull, IndexNoSpace
from kvstore.server.key_digest import KeyDigest
from kvstore.server.metrics import Metrics
from kvstore.server.recovery import drop_stale, open_index, rebuild_index, replace_damaged, verify_entries
from kvstore.server.retention import Retention
from kvstore.server.segments import Segment, SegmentSet
from kvstore.server.tenant_share import TenantShare

log = logging.getLogger(__name__)
Scope = frozenset[bytes] | None  # the tenant digests a caller may reach; None: all (no authentication)
# Evict once the LMDB map is this full at its maximum size: deleting needs free pages as well.
INDEX_HIGH_FILL = 0.75
PRIVATE_DIR = 0o700  # every tenant's KV bytes and keys are in here: the daemon's user's alone
POLICY_STATE = b"policy:learned"  # the index meta key of what the eviction policy has learned


class DiskFull(Exception):
    """The segment directory's file system has no room; the put was not stored."""


class DataDirInUse(RuntimeError):
    pass


@dataclass(slots=True)
class OpenBlock:
    """A block being served: its verified header and where its payload comes from."""

    key: bytes
    entry: Entry
    header: RecordHeader
    header_bytes: bytes
    segment: Segment | None  # held (acquired) while serving from the segment file
    hot: HotEntry | None  # pinned while serving from the DRAM tier
    tier: str  # where the hit was found: "dram" or "ssd"

    @property
    def payload(self) -> bytes | bytearray | None:
        return self.hot.payload if self.hot is not None else None


@dataclass(slots=True)
class Miss:
    status: int  # pb.PartStatus
    cause: str


class BlockStore:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.time, policy: EvictionPolicy | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.policy = policy or make_policy(config.eviction_policy, config.capacity_bytes)
        self.hot = HotTier(config.hot_tier_bytes)
        self.live_bytes = 0
        self._class_ids: dict[str, int] = {}
        self._class_names: dict[int, str] = {}
        self._class_blocks: dict[int, int] = {}
        self._tenant_ids: dict[bytes, int] = {}  # tenant digest -> its id in index entries
        self._dirty: dict[bytes, tuple[int, int, int]] = {}  # key -> (access_ms, expires_ms, class_id)
        self._reclassed: dict[bytes, int] = {}  # key -> its new eviction policy class, to persist
        self._learned_saved: bytes | None = None  # the policy snapshot last persisted
        self._pending: dict[bytes, asyncio.Future] = {}  # key -> done when the put writing it ends
        self._disk_limit = config.capacity_bytes  # lowered when the file system turns out smaller
        self.retention = Retention(self)
        self.shares = TenantShare(config.tenant_max_share)
        self._share_lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-io")
        self._lock_fd: int | None = None
        self.closed = False
        self.key_digest = KeyDigest(config.data_dir / "log-digest.key")  # stands for keys in every log line
        self.access_log = (AccessLog(config.access_log, config.access_log_max_bytes, self.key_digest)
                           if config.access_log else None)
        self.index: Index
        self.segments: SegmentSet

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
        # A damaged index is moved aside and rebuilt (kvstore/server/recovery.py, docs/operations.md).
        self.index, rebuild_reason = open_index(data_dir / "index", self.config.lmdb_map_bytes,
                                                self.config.lmdb_max_map_bytes, fsync)
        self.segments = SegmentSet(data_dir / "segments", self.config.segment_bytes, fsync)
        self._load_names()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._recover, rebuild_reason)
        self.refresh_gauges()

    def _load_names(self) -> None:
        """The index's ids of the configured traffic classes (assigned on first use), and all names known."""
        for name in self.config.classes:
            self._class_ids[name] = self.index.class_id(name)
        self._class_names = {v: k for k, v in self.index.classes().items()}
        self._tenant_ids = self.index.tenants()

    def _recover(self, rebuild_reason: str = "") -> None:
        """Cut torn tails, then make the index agree with the segments: rebuilt from them when it is new or
        damaged, else every entry checked against the record header at its place (kvstore/server/recovery.py)."""
        started = time.perf_counter()
        scanned = {seg.id: dict(self.segments.recover(seg)) for seg in self.segments.open_existing()}
        stale: dict[bytes, tuple[str, Entry]] = {}
        try:
            live, stale = ([], {}) if rebuild_reason else verify_entries(self.index, self.segments, scanned)
        except IndexDamaged as exc:  # a page deeper than the meta pages, found while reading
            config = self.config
            self.index, aside = replace_damaged(self.index, config.data_dir / "index", config.lmdb_map_bytes,
                                                config.lmdb_max_map_bytes, config.durability == "fsync", exc)
            self._load_names()
            live, rebuild_reason = [], f"the index was damaged and moved aside to {aside}"
        if rebuild_reason and self.segments.disk_bytes:
            log.warning("rebuilding the index from the segments (%.1f GiB): %s",
                        self.segments.disk_bytes / 2**30, rebuild_reason)
            live, stats = rebuild_index(self.index, self.segments, now_ms=self.now_ms())
            log.warning("index rebuilt in %.1f s: %s", time.perf_counter() - started, stats)
        elif stale:
            drop_stale(self.index, stale)
            found, _ = rebuild_index(self.index, self.segments, only=set(stale), now_ms=self.now_ms())
            if found:
                log.warning("re-indexed %d of the dropped keys from verified records found in the segments",
                            len(found))
            live += found
        self._load_names()  # a rebuild names the classes and tenants its records carry
        order: list[tuple[int, bytes, int, bytes, int, int]] = []
        for key, entry in live:
            segment = self.segments.segments[entry.segment]
            segment.live_bytes += entry.record_len
            self.live_bytes += entry.record_len
            self._class_blocks[entry.class_id] = self._class_blocks.get(entry.class_id, 0) + 1
            order.append((entry.access_ms, key, entry.record_len, entry.parent, entry.policy_class, entry.tenant_id))
        order.sort()
        self._restore_learned()
        for _, key, size, parent, policy_class, tenant_id in order:  # the prefix tree and classes too
            self.policy.restore(key, size, parent or None, policy_class)
            self.shares.added(tenant_id, key, size)
        # After a rebuild every verifiable record has an entry, so a segment without one holds only
        # superseded copies or damage; with a trusted index, a record it lacks was deleted, evicted or
        # expired (docs/operations.md).
        for segment in list(self.segments.segments.values()):
            if segment.live_bytes == 0:
                self.segments.delete(segment)
        log.info("recovered %d blocks in %d segments (%d stale index entries dropped) in %.1f s",
                 len(order), len(self.segments.segments), len(stale), time.perf_counter() - started)

    def _restore_learned(self) -> None:
        saved = self.index.meta(POLICY_STATE)
        if saved is None:
            return
        try:
            self.policy.load(json.loads(saved))
            self._learned_saved = bytes(saved)
        except ValueError as exc:  # another policy's, or damaged: learning starts afresh, nothing else is lost
            log.warning("the eviction policy's learned state was not restored: %s", exc)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        loop = asyncio.get_running_loop()
        try:
            await self.flush_access()
            if self._dirty or self._reclassed:
                log.warning("no room to save the access times of %d blocks since the last flush: they are lost, "
                            "as in a crash", len(self._dirty.keys() | self._reclassed.keys()))
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

    def _ttl_ms(self, class_id: int) -> int:
        name = self._class_names.get(class_id, self.config.default_class)
        return int(self.config.classes.get(name, self.config.classes[self.config.default_class]) * 1000)

    def bucket_end(self, expires_ms: int) -> int:
        bucket = self.config.expiry_bucket_s
        return int(math.ceil(expires_ms / 1000 / bucket) * bucket)

    def effective_expiry(self, key: bytes, entry: Entry) -> int:
        dirty = self._dirty.get(key)
        return max(entry.expires_ms, dirty[1]) if dirty else entry.expires_ms

    def class_known(self, name: str) -> bool:
        return name in self._class_ids

    def tenant_ids(self, scope: Scope) -> frozenset[int] | None:
        """The index's ids of the tenants in `scope` (None: every tenant, as without authentication)."""
        if scope is None:
            return None
        return frozenset(self._tenant_ids[t] for t in scope if t in self._tenant_ids)

    def visible(self, entry: Entry | None, scope: Scope) -> bool:
        """Whether a caller limited to `scope` may see `entry`; another tenant's block is as good as absent."""
        return entry is not None and (scope is None or entry.tenant_id in self.tenant_ids(scope))

    async def tenant_id(self, tenant: bytes) -> int:
        if tenant == NO_TENANT:
            return 0
        known = self._tenant_ids.get(tenant)
        if known is None:
            known = self._tenant_ids[tenant] = await self.commit(self.index.tenant_id_op(tenant))
        return known

    async def run_io(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def commit(self, op, sync: Sequence[Segment] = ()):
        return await asyncio.wrap_future(self.index.submit(op, sync))

    # -- reads ------------------------------------------------------------------------------------

    def present(self, keys: Sequence[bytes], scope: Scope = None) -> bytes:
        """For each key on its own, 1 if it exists, has not expired and belongs to a tenant in `scope`."""
        return self.index.live_each(keys, self.now_ms(), self._dirty, self.tenant_ids(scope))

    def lookup(self, keys: Sequence[bytes], scope: Scope = None) -> int:
        """How many leading keys exist, have not expired, and belong to a tenant in `scope`."""
        now_ms = self.now_ms()
        hits = self.index.live_prefix(keys, now_ms, self._dirty, self.tenant_ids(scope))
        if self.access_log is not None:
            logged = keys[:KEYS_PER_CALL]
            for position, key in enumerate(logged):
                self.access_log.write(now_ms, "lookup", key, "", "hit" if position < hits else "missing", "", 0)
            self.access_log.skipped(len(keys) - len(logged))
        self.metrics.lookup_keys.inc(len(keys))
        self.metrics.lookup_hits.inc(hits)
        return hits

    async def open_block(self, key: bytes, scope: Scope = None) -> OpenBlock | Miss:
        """Find a block of a tenant in `scope` and verify its header; the caller must `close_block` an OpenBlock."""
        entry = self.index.get(key)
        if not self.visible(entry, scope):
            return self.miss(pb.MISSING, "missing", key)
        if self.effective_expiry(key, entry) <= self.now_ms():
            return self.miss(pb.EXPIRED, "expired", key, entry)
        cached = self.hot.pin(key)
        if cached is not None:
            return OpenBlock(key, entry, decode_header(cached.header), cached.header, None, cached, "dram")
        segment = self.segments.acquire(entry.segment)
        if segment is None:
            return self.miss(pb.UNAVAILABLE, "segment_gone", key, entry)
        try:
            header_bytes = await self.run_io(SegmentSet.read, segment, entry.offset, entry.header_len)
            header = decode_header(header_bytes)
            if header.key != key or header.payload_len != entry.payload_len:
                raise CorruptRecord("key_mismatch", "record at the indexed place belongs to another key")
        except CorruptRecord as exc:
            self.segments.release(segment)
            await self.drop_corrupt(key, entry)
            return self.miss(pb.CORRUPT, exc.cause, key, entry)
        except OSError:
            self.segments.release(segment)
            return self.miss(pb.UNAVAILABLE, "io_error", key, entry)
        except BaseException:  # cancelled (a Get read ahead and stopped at a miss): no caller will close it
            self.segments.release(segment)
            raise
        return OpenBlock(key, entry, header, header_bytes, segment, None, "ssd")

    async def read_layers(self, block: OpenBlock, begin: int, end: int,
                          into: memoryview | None = None) -> bytes | bytearray | memoryview:
        """Payload bytes of layers [begin, end), verified; written into `into` when given.

        Raises CorruptRecord or OSError; ValueError for a range outside the block (a caller's bug, never
        a reason to drop it). `into` may be memory the client can write (its shared region): bytes there
        that fail their checksums are read again into the daemon's own memory, and the block is dropped
        only if they fail there too."""
        header = block.header
        if not 0 <= begin < end <= header.n_layers:
            raise ValueError(f"layers [{begin}, {end}) of a block of {header.n_layers}")
        if block.payload is not None:
            if into is not None:
                into[:] = memoryview(block.payload)[begin * header.layer_bytes : end * header.layer_bytes]
                return into
            if begin == 0 and end == header.n_layers:
                return block.payload
            return block.payload[begin * header.layer_bytes : end * header.layer_bytes]
        assert block.segment is not None
        whole = begin == 0 and end == header.n_layers and into is None
        nbytes = (end - begin) * header.layer_bytes
        data = into if into is not None else self.hot.buffer(nbytes) if whole else bytearray(nbytes)
        offset = block.entry.offset + header.layer_offset(begin)
        try:
            await self.run_io(SegmentSet.read_into, block.segment, offset, memoryview(data))
            header.check_layers(data, begin)
        except CorruptRecord as exc:
            if into is not None and exc.cause != "truncated":
                await self._verify_privately(block, offset, nbytes, begin)
                raise CorruptRecord("changed_in_client_memory",
                                    "the bytes changed in the client's memory while the daemon checked them") from None
            await self.drop_corrupt(block.key, block.entry)
            raise
        if whole:  # the DRAM tier keeps it; pinned for this reader, as if it had come from there
            self.hot.put(block.key, block.header_bytes, data)
            block.hot = self.hot.pin(block.key)
        return data

    async def _verify_privately(self, block: OpenBlock, offset: int, nbytes: int, begin: int) -> None:
        """Read the layers again into memory no client can write; drop the block if they are corrupt there."""
        private = bytearray(nbytes)
        try:
            await self.run_io(SegmentSet.read_into, block.segment, offset, memoryview(private))
            block.header.check_layers(private, begin)
        except CorruptRecord:
            await self.drop_corrupt(block.key, block.entry)
            raise

    async def warm(self, block: OpenBlock) -> None:
        """Bring a block read from SSD into the DRAM tier (whole), so its layers are served from memory.

        Layer-by-layer reads would otherwise never fill the tier; a failure is left to the reads that
        follow, which report it as a miss."""
        if block.payload is None and 0 < block.entry.record_len <= self.hot.capacity_bytes:
            try:
                await self.read_layers(block, 0, block.header.n_layers)
            except (CorruptRecord, OSError):
                pass

    def close_block(self, block: OpenBlock) -> None:
        if block.segment is not None:
            self.segments.release(block.segment)
            block.segment = None
        if block.hot is not None:
            self.hot.unpin(block.hot)
            block.hot = None

    def record_hits(self, blocks: Sequence[OpenBlock], served_bytes: int) -> None:
        """Count and retain what was served; leaf first, so parents stay at least as recent as children."""
        now_ms = self.now_ms()
        for block in reversed(blocks):
            self.metrics.hits.labels(tier=block.tier).inc()
            self.metrics.class_hits.labels(traffic_class=self.class_name(block.entry) or "unknown").inc()
            self.policy.access(block.key)
            self.shares.accessed(block.entry.tenant_id, block.key)
            self._extend(block.key, block.entry, now_ms, block.entry.class_id)
        if self.access_log is not None:
            for block in blocks:
                self.access_log.write(now_ms, "get", block.key, self.class_name(block.entry), "hit", block.tier,
                                      block.entry.payload_len)
        self.metrics.bytes_read.inc(served_bytes)

    def _extend(self, key: bytes, entry: Entry, now_ms: int, class_id: int) -> None:
        """Retain `key` for the TTL of the longest-lived class that has used it, from now."""
        previous = self._dirty.get(key)
        classes = [class_id, entry.class_id] + ([previous[2]] if previous else [])
        class_id = max(classes, key=self._ttl_ms)
        expires = now_ms + self._ttl_ms(class_id)
        self._dirty[key] = (now_ms, max(expires, previous[1] if previous else 0), class_id)

    def miss(self, status: int, cause: str, key: bytes, entry: Entry | None = None) -> Miss:
        """Count (and log) a block not served, and say why."""
        self.metrics.misses.labels(cause=cause).inc()
        if self.access_log is not None:
            self.access_log.write(self.now_ms(), "get", key, self.class_name(entry), cause, "", 0)
        return Miss(status, cause)

    def class_name(self, entry: Entry | None) -> str:
        return self._class_names.get(entry.class_id, "") if entry is not None else ""

    async def drop_corrupt(self, key: bytes, entry: Entry) -> None:
        log.warning("dropping corrupt block %s in segment %d at %d", self.key_digest(key), entry.segment, entry.offset)
        await self.remove([key], only_at={key: (entry.segment, entry.offset)})

    # -- writes -----------------------------------------------------------------------------------

    async def put(self, header: RecordHeader, header_bytes: bytes, chunks: Sequence[bytes],
                  hint: ReuseHint | None = None) -> int:
        """Store one verified record; returns pb.STORED or pb.EXISTS. Raises DiskFull.

        `hint` (from the engine, about the request that computed the block) goes to the eviction policy."""
        key = header.key
        class_id = self._class_ids[header.traffic_class]
        tenant_id = await self.tenant_id(header.tenant)
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
            return pb.STORED
        if entry is not None and self.effective_expiry(key, entry) > now_ms:
            self._extend(key, entry, now_ms, class_id)
            self.metrics.puts.labels(result="exists").inc()
            if self.access_log is not None:
                self.access_log.write(now_ms, "put", key, header.traffic_class, "exists", "", 0)
            return pb.EXISTS
        self._pending[key] = asyncio.get_running_loop().create_future()
        try:
            expires_ms = now_ms + self._ttl_ms(class_id)
            if self.retention.disk_full:  # what room eviction makes goes to the index's reserve first
                raise DiskFull("the disk is full and eviction is making room; retry shortly")
            try:
                with self.retention.appending():
                    segment, offset = await self.run_io(self.segments.append, self.bucket_end(expires_ms),
                                                        [header_bytes, *chunks])
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    self.disk_is_full()
                    raise DiskFull(f"no space left for a {header.record_len}-byte record") from exc
                raise
            new = Entry(segment.id, offset, len(header_bytes), header.payload_len, expires_ms, now_ms, class_id,
                        header.parent, self.policy.classify(hint), tenant_id)
            if self.index.fill_ratio() > INDEX_HIGH_FILL:
                await self.retention.evict_bytes(self.policy.tracked_bytes * 0.05)
            payload = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            try:
                # Shielded: a caller that goes away must not leave the index committed and the accounting not.
                await asyncio.shield(self._commit_put(key, new, segment, header_bytes, payload, hint))
            except IndexNoSpace as exc:  # the record's bytes are left dead, for compaction
                self.disk_is_full()
                raise DiskFull(f"no space left to index a {header.record_len}-byte record") from exc
            if self.shares.enabled:
                await self.keep_to_shares([tenant_id])
            if self.live_bytes > self.limit() * self.config.high_watermark:
                # The budget holds at every put, not only when the maintenance loop comes round.
                await self.retention.enforce_budget()
            return pb.STORED
        finally:
            self._pending.pop(key).set_result(None)

    async def _commit_put(self, key: bytes, new: Entry, segment: Segment, header_bytes: bytes,
                          payload: bytes | bytearray, hint: ReuseHint | None) -> None:
        sync = [segment] if self.config.durability == "fsync" else []
        old = await self.commit(self.index.put_op(key, new), sync)
        if old is not None:
            self._account_removed(key, old)
        self._account_added(key, new, hint)
        self.hot.put(key, header_bytes, payload)
        self.metrics.puts.labels(result="stored").inc()
        if self.access_log is not None:
            self.access_log.write(new.access_ms, "put", key, self._class_names.get(new.class_id, ""), "stored", "",
                                  new.record_len)
        self.metrics.bytes_written.inc(new.record_len)
        if self.segments.disk_bytes > self.limit() * self.config.high_watermark:
            self.retention.wake.set()  # dead bytes to compact

    async def keep_to_shares(self, tenant_ids: Sequence[int] | None = None) -> None:
        """Evict each tenant's own least recently used blocks while it holds more than its share (all
        tenants, or `tenant_ids`). One at a time: concurrent puts would pick the same victims."""
        async with self._share_lock:
            for tenant_id in self.shares.tenants() if tenant_ids is None else tenant_ids:
                victims = self.shares.victims(tenant_id, self.limit())
                if victims:
                    removed = await self.remove(victims)
                    self.metrics.evictions.inc(len(removed))
                    self.metrics.share_evictions.inc(len(removed))

    def _account_added(self, key: bytes, entry: Entry, hint: ReuseHint | None = None) -> None:
        segment = self.segments.segments.get(entry.segment)
        if segment is not None:
            segment.live_bytes += entry.record_len
        self.live_bytes += entry.record_len
        self._class_blocks[entry.class_id] = self._class_blocks.get(entry.class_id, 0) + 1
        self.policy.insert(key, entry.record_len, entry.parent or None, hint)
        self.shares.added(entry.tenant_id, key, entry.record_len)

    def _account_removed(self, key: bytes, entry: Entry) -> None:
        segment = self.segments.segments.get(entry.segment)
        if segment is not None:
            segment.live_bytes -= entry.record_len
        self.live_bytes -= entry.record_len
        self._class_blocks[entry.class_id] = self._class_blocks.get(entry.class_id, 0) - 1
        self.shares.removed(entry.tenant_id, key)

    async def remove(self, keys: Sequence[bytes],
                     only_at: dict[bytes, tuple[int, int]] | None = None) -> list[tuple[bytes, Entry]]:
        # Hashed keys are spread over every leaf page and a delete copies each page it touches, so in a
        # nearly full map one big delete would need a free copy of the tree: use small transactions.
        batch = 8 if len(keys) > 8 and self.index.fill_ratio() > INDEX_HIGH_FILL * 0.8 else 256
        removed = []
        for start in range(0, len(keys), batch):
            removed += await self.commit(self.index.remove_op(keys[start : start + batch], only_at))
        for key, entry in removed:
            self._account_removed(key, entry)
            self.policy.remove(key)
            self.hot.discard(key)
            self._dirty.pop(key, None)
            self._reclassed.pop(key, None)
        return removed

    async def touch(self, keys: Sequence[bytes], class_name: str = "", scope: Scope = None) -> int:
        now_ms = self.now_ms()
        keys = distinct(keys)
        touched = 0
        for key, entry in zip(keys, self.index.get_many(keys)):
            if not self.visible(entry, scope) or self.effective_expiry(key, entry) <= now_ms:
                continue
            class_id = self._class_ids[class_name] if class_name else entry.class_id
            self._extend(key, entry, now_ms, class_id)
            self.policy.access(key)
            self.shares.accessed(entry.tenant_id, key)
            touched += 1
        return touched

    async def delete(self, keys: Sequence[bytes], scope: Scope = None) -> int:
        return len(await self.remove(self.in_scope(keys, scope)))

    def in_scope(self, keys: Sequence[bytes], scope: Scope) -> Sequence[bytes]:
        """The distinct keys whose blocks a caller limited to `scope` may act on."""
        keys = distinct(keys)
        if scope is None:
            return keys
        return [key for key, entry in zip(keys, self.index.get_many(keys)) if self.visible(entry, scope)]

    def advise(self, keys: Sequence[bytes], continues: bool, scope: Scope = None) -> int:
        """Tell the eviction policy whether the conversation that put `keys` goes on; how many it holds."""
        advice = ReuseHint(0, 0, continues=continues)
        held = [key for key in self.in_scope(keys, scope) if key in self.policy]
        for key in held:
            self.policy.advise(key, advice)
            self._reclassed[key] = self.policy.class_of(key)
        self.metrics.advised.labels(continues=str(continues).lower()).inc(len(held))
        return len(held)

    async def flush_access(self) -> None:
        """Persist access times, extended expiries, changed policy classes and what the policy has learned
        (a crash loses at most one flush interval of them)."""
        snapshot = self.policy.snapshot()
        learned = json.dumps(snapshot).encode() if snapshot is not None else None
        if learned == self._learned_saved:
            learned = None
        if not (self._dirty or self._reclassed or learned):
            return
        dirty, self._dirty = self._dirty, {}
        reclassed, self._reclassed = self._reclassed, {}
        save_learned = self.index.set_meta_op(POLICY_STATE, learned) if learned else None

        def op(txn, db) -> None:
            for key, (access_ms, expires_ms, class_id) in dirty.items():
                raw = txn.get(key, db=db)
                if raw is not None:
                    txn.put(key, Entry.unpack(raw).with_access(access_ms, expires_ms, class_id).pack(), db=db)
            for key, policy_class in reclassed.items():
                raw = txn.get(key, db=db)
                if raw is not None:
                    txn.put(key, replace(Entry.unpack(raw), policy_class=policy_class).pack(), db=db)
            if save_learned is not None:
                save_learned(txn, db)
        try:
            await self.commit(op)
        except (IndexFull, IndexNoSpace):  # kept for the next flush; a full disk's reserve is eviction's
            for key, value in dirty.items():
                self._dirty.setdefault(key, value)
            for key, value in reclassed.items():
                self._reclassed.setdefault(key, value)
            return
        if learned:
            self._learned_saved = learned

    def limit(self) -> int:
        """The byte budget in force: the configured one, or the file system's size if that proved smaller."""
        return min(self.config.capacity_bytes, self._disk_limit)

    def disk_is_full(self) -> None:
        """The file system is full: what the segments hold now is the budget, and puts wait for room."""
        self.metrics.disk_full.inc()
        self._disk_limit = min(self._disk_limit, self.segments.disk_bytes)
        self.retention.note_disk_full()

    def disk_has_room(self, free_bytes: int) -> None:
        """Room is back after a full disk: the budget is what the segments and the free space can hold
        (still never more than capacity_bytes), so that it does not stay as low as the worst moment."""
        self._disk_limit = self.segments.disk_bytes + free_bytes

    # -- observability ----------------------------------------------------------------------------

    def refresh_gauges(self) -> None:
        m = self.metrics
        for class_id, count in self._class_blocks.items():
            m.blocks.labels(traffic_class=self._class_names.get(class_id, f"class{class_id}")).set(count)
        m.live_bytes.set(self.live_bytes)
        m.disk_bytes.set(self.segments.disk_bytes)
        m.capacity_bytes.set(self.limit())
        m.hot_bytes.set(self.hot.bytes)
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
