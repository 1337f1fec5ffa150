"""Retention and capacity of one BlockStore: expiry, eviction and compaction (docs/operations.md).

* Expiry: a segment whose expiry bucket has ended is emptied — blocks whose retention was extended by
  access are copied forward, the rest are dropped as expired — and its file deleted.
* Capacity: once the live records pass the high watermark of the budget (checked at every put and every
  pass), the eviction policy's victims go until they fit under the low watermark.
* Compaction: sealed segments with many dead bytes (or any, under pressure) have their live records
  copied forward and their file deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from kvstore.server.index import Entry
from kvstore.server.segments import Segment, SegmentSet

if TYPE_CHECKING:
    from kvstore.server.store import BlockStore

log = logging.getLogger(__name__)


class Retention:
    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.wake = asyncio.Event()  # set when a put leaves dead bytes to compact
        self._lock = asyncio.Lock()  # one maintenance pass at a time
        self._evicting = asyncio.Lock()  # one budget check at a time: concurrent puts must not each evict

    async def run(self) -> None:
        """Background loop: flush access times, expire, evict and compact; never raises."""
        config = self.store.config
        last_flush = 0.0
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=config.sweep_interval_s)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            try:
                if time.monotonic() - last_flush >= config.access_flush_interval_s:
                    await self.store.flush_access()
                    if self.store.access_log is not None:
                        self.store.access_log.flush()
                    last_flush = time.monotonic()
                await self.maintain()
            except Exception:  # maintenance must never take the daemon down
                log.exception("maintenance pass failed; retrying at the next interval")

    async def maintain(self) -> None:
        """One pass: expire, evict down to the low watermark if above the high one, compact."""
        store, config = self.store, self.store.config
        async with self._lock:
            await self._expire_segments()
            await self.enforce_budget()  # too much kept: evict; too many dead bytes: compaction's job
            await self._compact(store.limit() * config.low_watermark)
            store.refresh_gauges()

    async def enforce_budget(self) -> None:
        """Once live records pass the high watermark, evict down to the low one (puts call it too)."""
        store, config = self.store, self.store.config
        async with self._evicting:
            if store.live_bytes > store.limit() * config.high_watermark:
                await self.evict_bytes(store.live_bytes - store.limit() * config.low_watermark)

    async def evict_bytes(self, nbytes: float) -> int:
        """Evict the policy's victims until at least `nbytes` of records are gone."""
        policy = self.store.policy
        victims = []
        tracked = policy.tracked_bytes
        while tracked - policy.tracked_bytes < nbytes:
            key = policy.pop_victim()
            if key is None:
                break
            victims.append(key)
        removed = await self.store.remove(victims)
        self.store.metrics.evictions.inc(len(removed))
        return len(removed)

    async def _expire_segments(self) -> None:
        now_s = self.store.clock()
        for segment in [s for s in self.store.segments.segments.values() if s.bucket_end <= now_s]:
            await self._empty_segment(segment, "expiry")

    async def _compact(self, target_disk_bytes: float) -> None:
        segments, config = self.store.segments, self.store.config
        candidates = sorted((s for s in segments.segments.values() if s.sealed),
                            key=lambda s: s.garbage_ratio, reverse=True)
        for segment in candidates:
            under_pressure = segments.disk_bytes > target_disk_bytes
            if segment.garbage_ratio >= config.compaction_min_garbage or (under_pressure and segment.garbage_ratio > 0):
                await self._empty_segment(segment, "garbage")
        if segments.disk_bytes > target_disk_bytes:
            # Garbage in the open segments is reachable only once they are sealed.
            for segment in [s for s in segments.segments.values() if not s.sealed and s.garbage_ratio > 0]:
                await self.store.run_io(segments.seal, segment)

    async def _empty_segment(self, segment: Segment, reason: str) -> None:
        """Move the segment's live blocks forward (dropping expired ones), then delete the file."""
        store = self.store
        if not segment.sealed:
            await store.run_io(store.segments.seal, segment)
        if segment.live_bytes > 0:
            records = await store.run_io(lambda: list(store.segments.scan(segment)))
            now_ms = store.now_ms()
            expired: dict[bytes, tuple[int, int]] = {}
            for offset, header in records:
                entry = store.index.get(header.key)
                if entry is None or (entry.segment, entry.offset) != (segment.id, offset):
                    continue  # dead bytes: the block was removed or lives elsewhere now
                if store.effective_expiry(header.key, entry) <= now_ms:
                    expired[header.key] = (segment.id, offset)
                    continue
                try:
                    await self._copy_forward(header.key, entry, segment)
                except OSError as exc:
                    log.warning("compaction of segment %d stopped, will retry: %s", segment.id, exc)
                    return
            if expired:
                removed = await store.remove(list(expired), only_at=expired)
                store.metrics.expiries.inc(len(removed))
        if segment.live_bytes > 0:
            return  # something was written meanwhile; try again at the next pass
        store.segments.delete(segment)
        store.metrics.compactions.labels(reason=reason).inc()

    async def _copy_forward(self, key: bytes, entry: Entry, segment: Segment) -> None:
        store = self.store
        data = await store.run_io(SegmentSet.read, segment, entry.offset, entry.record_len)
        expires_ms = store.effective_expiry(key, entry)
        new_segment, new_offset = await store.run_io(store.segments.append, store.bucket_end(expires_ms), [data])
        sync = [new_segment] if store.config.durability == "fsync" else []
        moved = await store.commit(store.index.move_op(key, (segment.id, entry.offset),
                                                       (new_segment.id, new_offset), expires_ms), sync)
        if moved:  # else the block was removed or replaced meanwhile, and the copy is dead bytes
            segment.live_bytes -= entry.record_len
            new_segment.live_bytes += entry.record_len
            store.metrics.copied_forward.inc(entry.record_len)
