"""Retention and capacity of one BlockStore: expiry, eviction and compaction (docs/operations.md).

* Expiry: a segment whose expiry bucket has ended is emptied — blocks whose retention was extended by
  access are copied forward, the rest are dropped as expired — and its file deleted.
* Capacity: once the live records pass the high watermark of the budget (checked at every put and every
  pass), the eviction policy's victims go until they fit under the low watermark.
* Compaction: sealed segments with many dead bytes (or any, under pressure) have their live records
  copied forward and their file deleted.
* A full disk: eviction's commits may use the reserve (reserve.py); while the disk is full, puts are
  refused and compaction evicts the live records it would otherwise copy, until the reserve is held again.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kvstore.server.index import Entry, IndexNoSpace
from kvstore.server.reserve import SpaceReserve
from kvstore.server.segments import Segment, SegmentSet

if TYPE_CHECKING:
    from kvstore.server.store import BlockStore

log = logging.getLogger(__name__)

EVICTION_BATCH = 256  # keys removed per commit
# Keys removed per commit while the disk is full: small commits need few fresh pages, so a small reserve
# carries eviction until the pages it frees can be reused.
FULL_DISK_BATCH = 8
# LMDB reuses the pages a commit frees only two commits later, so the first commits on a full disk all
# take fresh pages; the reserve holds that many commits' worth, twice over (a reader pins older pages).
RESERVED_COMMITS = 6
RESERVE_FILE = "RESERVE"


class Retention:
    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.wake = asyncio.Event()  # set when a put leaves dead bytes to compact
        self._lock = asyncio.Lock()  # one maintenance pass at a time
        self._evicting = asyncio.Lock()  # one budget check at a time: concurrent puts must not each evict
        self.reserve = SpaceReserve(store.config.data_dir / RESERVE_FILE)
        # Set when the file system is full; appends are refused until a pass ends holding the reserve.
        self.disk_full = False
        self._appends = 0
        self._no_appends = asyncio.Event()
        self._no_appends.set()
        self._stuck_victim: bytes | None = None  # a victim whose eviction could not commit, even with the reserve

    # -- a full disk ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def appending(self) -> Iterator[None]:
        """Around every segment append: refused (ENOSPC) while the disk is full, and counted, so that
        the reserve is given back only when no append can take its room first."""
        if self.disk_full:
            raise OSError(errno.ENOSPC, "the disk is full; eviction is making room")
        self._appends += 1
        self._no_appends.clear()
        try:
            yield
        finally:
            self._appends -= 1
            if not self._appends:
                self._no_appends.set()

    def note_disk_full(self) -> None:
        """The file system is full: refuse appends, and run a pass now if this is news."""
        if not self.disk_full:
            log.warning("the file system of %s is full: puts are refused while eviction makes room",
                        self.store.config.data_dir)
            self.wake.set()
        self.disk_full = True

    async def make_room(self) -> bool:
        """Give the reserve's room to the index, for eviction's commits; False if none was held."""
        self.note_disk_full()
        await self._no_appends.wait()
        freed = await self.store.run_io(self.reserve.release)
        if freed:
            log.warning("no room for an index commit: released the %d-byte reserve so that eviction can commit",
                        freed)
        return freed > 0

    async def hold_reserve(self) -> bool:
        """Take the reserve (again) if there is room, sized for today's index; puts resume once it is
        held with as much free beside it.

        Until then the disk is full: the budget shrinks to what the segments hold now, so that this
        pass and the next evict and compact until there is room."""
        store = self.store
        needed = RESERVED_COMMITS * store.index.commit_bytes(FULL_DISK_BATCH)
        try:
            held = self.reserve.held_bytes >= needed or await store.run_io(self.reserve.hold, needed)
        except OSError as exc:
            log.warning("cannot make the index's reserve %s: %s", self.reserve.path, exc)
            held = False
        fs = os.statvfs(store.config.data_dir)
        free = fs.f_bavail * fs.f_frsize
        if not held or (self.disk_full and free < needed):
            store.disk_is_full()  # each pass then gives back a share, not all at once
            return held
        # Every pass, not only after a full disk: room that another writer on this file system took and
        # gave back is the budget's again, and room it takes lowers the budget before puts hit ENOSPC.
        store.disk_has_room(free)
        if self.disk_full:
            self.disk_full = False
            log.info("room again on the file system of %s: puts resume (budget %d bytes)",
                     store.config.data_dir, store.limit())
        return held

    # -- passes -----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Background loop: flush access times, expire, evict and compact; never raises."""
        config = self.store.config
        last_flush = 0.0
        try:
            await self.hold_reserve()
        except Exception:
            log.exception("could not take the index's reserve; retrying at the next pass")
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=config.sweep_interval_s)
            except TimeoutError:
                pass
            self.wake.clear()
            try:
                # On a full disk, what room there is goes to eviction; access times wait in memory.
                if not self.disk_full and time.monotonic() - last_flush >= config.access_flush_interval_s:
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
            stuck, self._stuck_victim = self._stuck_victim, None
            if stuck is not None and not self.reserve.held_bytes:
                await self._give_back(self._segment_of(stuck))
            await self._compact(store.limit() * config.low_watermark)
            await self.hold_reserve()
            store.refresh_gauges()

    async def enforce_budget(self) -> None:
        """Once live records pass the high watermark, evict down to the low one (puts call it too)."""
        store, config = self.store, self.store.config
        async with self._evicting:
            if store.live_bytes > store.limit() * config.high_watermark and store.shares.enabled:
                await store.keep_to_shares()  # a tenant past its share pays first, never the others
            if store.live_bytes > store.limit() * config.high_watermark:
                await self.evict_bytes(store.live_bytes - store.limit() * config.low_watermark)

    async def evict_bytes(self, nbytes: float) -> int:
        """Evict the policy's victims until at least `nbytes` of records are gone (fewer if even the
        reserve's room cannot carry the commits: the rest stay, and are tried again)."""
        policy = self.store.policy
        chosen = 0.0
        evicted = 0
        while chosen < nbytes:
            victims = []
            while chosen < nbytes and len(victims) < (FULL_DISK_BATCH if self.disk_full else EVICTION_BATCH):
                tracked = policy.tracked_bytes
                key = policy.pop_victim()
                if key is None:
                    break
                chosen += tracked - policy.tracked_bytes
                victims.append(key)
            if not victims:
                break
            removed = await self._remove(victims)
            if removed is None:
                self._stuck_victim = victims[0]  # the pass gives its segment back (not a put: passes own segments)
                break
            evicted += len(removed)
            self.store.metrics.evictions.inc(len(removed))
        return evicted

    async def _remove(self, keys: Sequence[bytes],
                      only_at: dict[bytes, tuple[int, int]] | None = None) -> list[tuple[bytes, Entry]] | None:
        """`store.remove`, given the reserve's room if the index has none; None if even that is not
        enough, and then the keys stay where they were, in the index and in the policy."""
        for attempt in range(2):
            try:
                return await self.store.remove(keys, only_at)
            except IndexNoSpace:
                if attempt or not await self.make_room():
                    break
        log.warning("no room on %s to commit the removal of %d blocks, and no reserve left; will retry",
                    self.store.config.data_dir, len(keys))
        self._keep(keys)
        return None

    def _segment_of(self, key: bytes) -> Segment | None:
        entry = self.store.index.get(key)
        return None if entry is None else self.store.segments.segments.get(entry.segment)

    async def _give_back(self, segment: Segment | None, places: dict[bytes, tuple[int, int]] | None = None) -> None:
        """The last resort on a full disk with no reserve left, when not even eviction can commit: delete
        a segment's file before its index entries (the policy's first victim chose it). They point at
        nothing until they can be removed: reads of them are misses, and start-up drops them."""
        store = self.store
        if segment is None or segment.deleted:
            return
        await store.run_io(store.segments.seal, segment)
        if places is None:
            records = await store.run_io(lambda: list(store.segments.scan(segment)))
            places = {header.key: (segment.id, offset) for offset, header in records}
        log.warning("no room on %s to commit even an eviction: deleting segment %d (%d bytes) before its index "
                    "entries", store.config.data_dir, segment.id, segment.size)
        store.segments.delete(segment)
        store.metrics.compactions.labels(reason="disk_full").inc()
        removed, _ = await self._remove_all(places)
        store.metrics.evictions.inc(removed)

    def _keep(self, keys: Sequence[bytes]) -> None:
        """Track again the victims whose removal did not commit, so they can still be evicted later."""
        store = self.store
        for key, entry in zip(keys, store.index.get_many(keys)):
            if entry is not None and key not in store.policy:
                store.policy.restore(key, entry.record_len, entry.parent or None, entry.policy_class)

    async def _remove_all(self, places: dict[bytes, tuple[int, int]]) -> tuple[int, bool]:
        """Remove the blocks still at the given places, in commits sized for the disk: how many went,
        and whether every commit went through."""
        keys = list(places)
        removed = 0
        while keys:
            batch = keys[: FULL_DISK_BATCH if self.disk_full else EVICTION_BATCH]
            done = await self._remove(batch, only_at=places)
            if done is None:
                return removed, False
            removed += len(done)
            keys = keys[len(batch):]
        return removed, True

    async def _expire_segments(self) -> None:
        now_s = self.store.clock()
        for segment in [s for s in self.store.segments.segments.values() if s.bucket_end <= now_s]:
            await self._empty_segment(segment, "expiry")

    async def _compact(self, target_disk_bytes: float) -> None:
        segments, config = self.store.segments, self.store.config
        candidates = sorted((s for s in segments.segments.values() if s.sealed),
                            key=lambda s: s.garbage_ratio, reverse=True)
        if self.disk_full:
            # Their live records will be evicted, not copied: the dead files first, then the oldest,
            # whose records were written longest ago (the newest are the likeliest to be read again).
            candidates.sort(key=lambda s: (s.live_bytes > 0, s.id))
        for segment in candidates:
            under_pressure = segments.disk_bytes > target_disk_bytes
            if segment.garbage_ratio >= config.compaction_min_garbage or (under_pressure and segment.garbage_ratio > 0):
                await self._empty_segment(segment, "garbage")
        if segments.disk_bytes > target_disk_bytes:
            # Garbage in the open segments is reachable only once they are sealed.
            for segment in [s for s in segments.segments.values() if not s.sealed and s.garbage_ratio > 0]:
                await self.store.run_io(segments.seal, segment)

    async def _empty_segment(self, segment: Segment, reason: str) -> None:
        """Move the segment's live blocks forward (dropping expired ones), then delete the file.

        On a full disk there is no room to copy them: they are evicted instead."""
        store = self.store
        if not segment.sealed:
            await store.run_io(store.segments.seal, segment)
        if segment.live_bytes > 0:
            records = await store.run_io(lambda: list(store.segments.scan(segment)))
            now_ms = store.now_ms()
            expired: dict[bytes, tuple[int, int]] = {}
            evicted: dict[bytes, tuple[int, int]] = {}
            for offset, header in records:
                entry = store.index.get(header.key)
                if entry is None or (entry.segment, entry.offset) != (segment.id, offset):
                    continue  # dead bytes: the block was removed or lives elsewhere now
                if store.effective_expiry(header.key, entry) <= now_ms:
                    expired[header.key] = (segment.id, offset)
                    continue
                if self.disk_full:
                    evicted[header.key] = (segment.id, offset)
                    continue
                try:
                    await self._copy_forward(header.key, entry, segment)
                except OSError as exc:
                    log.warning("compaction of segment %d stopped, will retry: %s", segment.id, exc)
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not self.disk_full:
                        store.disk_is_full()
                    return
            if not await self._drop(segment, expired, evicted):
                return
        if segment.live_bytes > 0:
            return  # something was written meanwhile; try again at the next pass
        store.segments.delete(segment)
        store.metrics.compactions.labels(reason=reason).inc()

    async def _drop(self, segment: Segment, expired: dict[bytes, tuple[int, int]],
                    evicted: dict[bytes, tuple[int, int]]) -> bool:
        """Remove the segment's expired and evicted blocks; False if the segment is not to be deleted now."""
        store = self.store
        for places, counter in ((expired, store.metrics.expiries), (evicted, store.metrics.evictions)):
            removed, complete = await self._remove_all(places)
            counter.inc(removed)
            if complete:
                continue
            if not self.reserve.held_bytes:
                await self._give_back(segment, {**expired, **evicted})
            return False
        return True

    async def _copy_forward(self, key: bytes, entry: Entry, segment: Segment) -> None:
        store = self.store
        data = await store.run_io(SegmentSet.read, segment, entry.offset, entry.record_len)
        expires_ms = store.effective_expiry(key, entry)
        with self.appending():
            new_segment, new_offset = await store.run_io(store.segments.append, store.bucket_end(expires_ms), [data])
        sync = [new_segment] if store.config.durability == "fsync" else []
        moved = await store.commit(store.index.move_op(key, (segment.id, entry.offset),
                                                       (new_segment.id, new_offset), expires_ms), sync)
        if moved:  # else the block was removed or replaced meanwhile, and the copy is dead bytes
            segment.live_bytes -= entry.record_len
            new_segment.live_bytes += entry.record_len
            store.metrics.copied_forward.inc(entry.record_len)
