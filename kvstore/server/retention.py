"""Retention and capacity of one BlockStore: expiry, eviction and compaction (docs/operations.md).

* Expiry: a segment whose expiry bucket has ended is emptied — blocks whose retention was extended by
  access are copied forward, the rest are dropped as expired — and its file deleted.
* Capacity: once the live records pass the high watermark of the budget (checked at every put and every
  pass), the eviction policy's victims go until they fit under the low watermark; a tenant past its share
  (`tenant_max_share`) loses its own least recently used blocks first.
* Compaction: sealed segments with many dead bytes (or any, under pressure) have their live records
  copied forward and their file deleted.
* A full disk: eviction's commits may use the reserve (reserve.py); while the disk is full, puts are
  refused and compaction evicts the live records it would otherwise copy, until the reserve is held again.

The store signals pressure: `after_put`, `evict_bytes` (its index is nearly full), `disk_filled`, and
`appending` around every segment append. Retention acts through `Retained`, the store's few public methods
for it, and reads what the store holds from its Accounting (accounting.py). The budget in force, `limit`,
is retention's: a full disk lowers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvstore import faults
from kvstore.server.index import Entry, IndexNoSpace
from kvstore.server.reserve import SpaceReserve
from kvstore.server.segments import Segment

if TYPE_CHECKING:
    from kvstore.server.accounting import Accounting
    from kvstore.server.config import ServerConfig
    from kvstore.server.metrics import Metrics

log = logging.getLogger(__name__)

EVICTION_BATCH = 256  # keys removed per commit
# Keys removed per commit while the disk is full: small commits need few fresh pages, so a small reserve
# carries eviction until the pages it frees can be reused.
FULL_DISK_BATCH = 8
# LMDB reuses the pages a commit frees only two commits later, so the first commits on a full disk all
# take fresh pages; the reserve holds that many commits' worth, twice over (a reader pins older pages).
RESERVED_COMMITS = 6
RESERVE_FILE = "RESERVE"

Places = dict[bytes, tuple[int, int]]  # key -> (segment id, offset) of the record it is removed at


class SegmentRecord(NamedTuple):
    key: bytes
    place: tuple[int, int]  # (segment id, offset)
    entry: Entry | None  # the key's index entry if it points at this record; None: dead bytes
    expired: bool  # (a live record) its retention, extensions counted, has ended


class Retained(Protocol):
    """What retention asks of the store it keeps within budget (BlockStore implements it)."""

    accounting: Accounting  # what the store holds; read only

    async def run_io(self, fn: Callable, *args) -> Any: ...  # on the store's I/O threads
    def commit_bytes(self, keys: int) -> int: ...  # at most the fresh bytes an index commit of `keys` keys takes
    async def checkpoint(self) -> None: ...  # persist access times; flush the access log
    def refresh_gauges(self) -> None: ...

    # blocks
    def next_victim(self) -> tuple[bytes, int] | None: ...  # taken out of the eviction policy, with its bytes
    def track_again(self, keys: Sequence[bytes]) -> None: ...  # victims whose removal did not commit
    async def remove(self, keys: Sequence[bytes], only_at: Places | None = None,
                     reason: str = "deleted") -> list[tuple[bytes, Entry]]: ...
    def segment_of(self, key: bytes) -> Segment | None: ...

    # segments
    def all_segments(self) -> list[Segment]: ...
    async def seal_segment(self, segment: Segment) -> None: ...
    async def segment_records(self, segment: Segment) -> Iterator[SegmentRecord]: ...  # looked up as iterated
    async def copy_forward(self, key: bytes, entry: Entry, segment: Segment) -> None: ...  # raises OSError
    def delete_segment(self, segment: Segment) -> None: ...


class Retention:
    def __init__(self, store: Retained, config: ServerConfig, metrics: Metrics,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.wake = asyncio.Event()  # set when a put leaves dead bytes to compact
        self.passes = 0  # maintenance passes done (the metric kvstore_maintenance_passes_total counts them too)
        self._lock = asyncio.Lock()  # one maintenance pass at a time
        self._evicting = asyncio.Lock()  # one budget check at a time: concurrent puts must not each evict
        self._sharing = asyncio.Lock()  # one share check at a time: concurrent puts would pick the same victims
        self.reserve = SpaceReserve(config.data_dir / RESERVE_FILE)
        self._disk_limit = config.capacity_bytes  # lowered when the file system turns out smaller
        # Set when the file system is full; appends are refused until a pass ends holding the reserve.
        self.disk_full = False
        self._appends = 0
        self._no_appends = asyncio.Event()
        self._no_appends.set()
        self._stuck_victim: bytes | None = None  # a victim whose eviction could not commit, even with the reserve

    # -- the budget, and what the store signals -------------------------------------------------

    def limit(self) -> int:
        """The byte budget in force: the configured one, or the file system's size if that proved smaller."""
        return min(self.config.capacity_bytes, self._disk_limit)

    async def after_put(self, tenant_id: int) -> None:
        """A put stored a record of `tenant_id`: wake compaction if the files hold too many dead bytes, and
        keep the tenant to its share and the store to its budget (at every put, not only every pass)."""
        accounting, high = self.store.accounting, self.config.high_watermark
        if accounting.disk_bytes > self.limit() * high:
            self.wake.set()  # dead bytes to compact
        if accounting.shares.enabled:
            await self.keep_to_shares([tenant_id])
        if accounting.live_bytes > self.limit() * high:
            await self.enforce_budget()

    def disk_filled(self) -> None:
        """The file system is full (an append or a commit met ENOSPC): what the segments hold now is the
        budget, and puts wait for room."""
        self.metrics.disk_full.inc()
        self._disk_limit = min(self._disk_limit, self.store.accounting.disk_bytes)
        self._note_disk_full()

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

    # -- a full disk ------------------------------------------------------------------------------

    def _note_disk_full(self) -> None:
        """The file system is full: refuse appends, and run a pass now if this is news."""
        if not self.disk_full:
            log.warning("the file system of %s is full: puts are refused while eviction makes room",
                        self.config.data_dir)
            self.wake.set()
        self.disk_full = True

    async def make_room(self) -> bool:
        """Give the reserve's room to the index, for eviction's commits; False if none was held."""
        self._note_disk_full()
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
        needed = RESERVED_COMMITS * self.store.commit_bytes(FULL_DISK_BATCH)
        try:
            held = self.reserve.held_bytes >= needed or await self.store.run_io(self.reserve.hold, needed)
        except OSError as exc:
            log.warning("cannot make the index's reserve %s: %s", self.reserve.path, exc)
            held = False
        fs = os.statvfs(self.config.data_dir)
        free = fs.f_bavail * fs.f_frsize
        if not held or (self.disk_full and free < needed):
            self.disk_filled()  # each pass then gives back a share, not all at once
            return held
        # Every pass, not only after a full disk: room that another writer on this file system took and
        # gave back is the budget's again, and room it takes lowers the budget before puts hit ENOSPC. The
        # budget is what the segments and the free space can hold (never more than capacity_bytes), so
        # that it does not stay as low as the worst moment.
        self._disk_limit = self.store.accounting.disk_bytes + free
        if self.disk_full:
            self.disk_full = False
            log.info("room again on the file system of %s: puts resume (budget %d bytes)",
                     self.config.data_dir, self.limit())
        return held

    # -- passes -----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Background loop: flush access times, expire, evict and compact; never raises."""
        config = self.config
        last_flush = 0.0
        try:
            await self.hold_reserve()
        except Exception:
            log.exception("could not take the index's reserve; retrying at the next pass")
        while True:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns when the wait it guards ends as the
                # task is cancelled, swallowing the cancellation, and this loop would outlive the daemon's stop
                async with asyncio.timeout(config.sweep_interval_s):
                    await self.wake.wait()
            except TimeoutError:
                pass
            self.wake.clear()
            try:
                # On a full disk, what room there is goes to eviction; access times wait in memory.
                if not self.disk_full and time.monotonic() - last_flush >= config.access_flush_interval_s:
                    await self.store.checkpoint()
                    last_flush = time.monotonic()
                await self.maintain()
            except Exception:  # maintenance must never take the daemon down
                log.exception("maintenance pass failed; retrying at the next interval")

    async def maintain(self) -> None:
        """One pass: expire, evict down to the low watermark if above the high one, compact."""
        async with self._lock:
            await self._expire_segments()
            await self.enforce_budget()  # too much kept: evict; too many dead bytes: compaction's job
            stuck, self._stuck_victim = self._stuck_victim, None
            if stuck is not None and not self.reserve.held_bytes:
                await self._give_back(self.store.segment_of(stuck))
            await self._compact(self.limit() * self.config.low_watermark)
            await self.hold_reserve()
            self.store.refresh_gauges()
            self.passes += 1
            self.metrics.maintenance_passes.inc()

    async def enforce_budget(self) -> None:
        """Once live records pass the high watermark, evict down to the low one (puts call it too)."""
        accounting, config = self.store.accounting, self.config
        async with self._evicting:
            if accounting.live_bytes > self.limit() * config.high_watermark and accounting.shares.enabled:
                await self.keep_to_shares()  # a tenant past its share pays first, never the others
            if accounting.live_bytes > self.limit() * config.high_watermark:
                await self.evict_bytes(accounting.live_bytes - self.limit() * config.low_watermark)

    async def keep_to_shares(self, tenant_ids: Sequence[int] | None = None) -> None:
        """Evict each tenant's own least recently used blocks while it holds more than its share (all
        tenants, or `tenant_ids`)."""
        shares = self.store.accounting.shares
        async with self._sharing:
            for tenant_id in shares.tenants() if tenant_ids is None else tenant_ids:
                victims = shares.victims(tenant_id, self.limit())
                if victims:
                    removed = await self.store.remove(victims, reason="evicted")
                    self.metrics.evictions.inc(len(removed))
                    self.metrics.share_evictions.inc(len(removed))

    async def evict_bytes(self, nbytes: float) -> int:
        """Evict the policy's victims until at least `nbytes` of records are gone (fewer if even the
        reserve's room cannot carry the commits: the rest stay, and are tried again). The store calls it
        when its index is nearly full."""
        chosen = 0.0
        evicted = 0
        while chosen < nbytes:
            victims: list[bytes] = []
            while chosen < nbytes and len(victims) < (FULL_DISK_BATCH if self.disk_full else EVICTION_BATCH):
                victim = self.store.next_victim()
                if victim is None:
                    break
                chosen += victim[1]
                victims.append(victim[0])
            if not victims:
                break
            removed = await self._remove(victims, "evicted")
            if removed is None:
                self._stuck_victim = victims[0]  # the pass gives its segment back (not a put: passes own segments)
                break
            evicted += len(removed)
            self.metrics.evictions.inc(len(removed))
        return evicted

    async def _remove(self, keys: Sequence[bytes], reason: str,
                      only_at: Places | None = None) -> list[tuple[bytes, Entry]] | None:
        """`store.remove`, given the reserve's room if the index has none; None if even that is not
        enough, and then the keys stay where they were, in the index and in the policy."""
        for attempt in range(2):
            try:
                return await self.store.remove(keys, only_at, reason)
            except IndexNoSpace:
                if attempt or not await self.make_room():
                    break
        log.warning("no room on %s to commit the removal of %d blocks, and no reserve left; will retry",
                    self.config.data_dir, len(keys))
        self.store.track_again(keys)
        return None

    async def _give_back(self, segment: Segment | None, places: Places | None = None) -> None:
        """The last resort on a full disk with no reserve left, when not even eviction can commit: delete
        a segment's file before its index entries (the policy's first victim chose it). They point at
        nothing until they can be removed: reads of them are misses, and start-up drops them."""
        store = self.store
        if segment is None or segment.deleted or segment.writers:  # records still being written into it
            return
        await store.seal_segment(segment)
        if segment.writers:  # placed just before the seal: no more can be, so the next pass may delete it
            return
        if places is None:
            places = {record.key: record.place for record in await store.segment_records(segment)}
        log.warning("no room on %s to commit even an eviction: deleting segment %d (%d bytes) before its index "
                    "entries", self.config.data_dir, segment.id, segment.size)
        store.delete_segment(segment)
        self.metrics.compactions.labels(reason="disk_full").inc()
        removed, _ = await self._remove_all(places, "evicted")
        self.metrics.evictions.inc(removed)

    async def _remove_all(self, places: Places, reason: str) -> tuple[int, bool]:
        """Remove the blocks still at the given places, in commits sized for the disk: how many went,
        and whether every commit went through."""
        keys = list(places)
        removed = 0
        while keys:
            batch = keys[: FULL_DISK_BATCH if self.disk_full else EVICTION_BATCH]
            done = await self._remove(batch, reason, only_at=places)
            if done is None:
                return removed, False
            removed += len(done)
            keys = keys[len(batch):]
        return removed, True

    async def _expire_segments(self) -> None:
        now_s = self.clock()
        for segment in [s for s in self.store.all_segments() if s.bucket_end <= now_s]:
            await self._empty_segment(segment, "expiry")

    async def _compact(self, target_disk_bytes: float) -> None:
        store, accounting = self.store, self.store.accounting
        await self._empty_segments(target_disk_bytes, evict_live=False)
        if self.disk_full and accounting.disk_bytes > target_disk_bytes:
            # Emptying a segment now evicts its live records rather than copying them. The eviction policy
            # chooses them first (its victims leave their segments dead); only then is any garbage worth a
            # segment's live records, oldest segment first. Else a little garbage (a copy the full disk cut
            # short) in the segment of the newest blocks would cost them all.
            await self.evict_bytes(min(accounting.live_bytes, accounting.disk_bytes - target_disk_bytes))
            await self._empty_segments(target_disk_bytes, evict_live=True)
        if accounting.disk_bytes > target_disk_bytes:
            # Garbage in the open segments is reachable only once they are sealed.
            for segment in [s for s in store.all_segments() if not s.sealed and s.garbage_ratio > 0]:
                await store.seal_segment(segment)

    async def _empty_segments(self, target_disk_bytes: float, evict_live: bool) -> None:
        """Empty the sealed segments that are mostly dead, and, while the files pass the target, those with
        any garbage. On a full disk a segment's live records are evicted, not copied: then only the dead
        files go, and, if `evict_live`, while the files pass the target, the oldest segments with garbage."""
        accounting = self.store.accounting
        candidates = sorted((s for s in self.store.all_segments() if s.sealed), key=lambda s: s.garbage_ratio,
                            reverse=True)
        if self.disk_full:
            # The dead files first, then the oldest, whose records were written longest ago. However dead a
            # segment is, its live records may be the newest blocks (compaction copies old ones forward beside
            # them, and the policy evicts those copies first): a mostly dead segment is no cheaper a victim.
            candidates.sort(key=lambda s: (s.live_bytes > 0, s.id))
        for segment in candidates:
            under_pressure = accounting.disk_bytes > target_disk_bytes
            if self.disk_full and segment.live_bytes > 0:
                emptied = evict_live and under_pressure and segment.garbage_ratio > 0
            else:
                emptied = (segment.garbage_ratio >= self.config.compaction_min_garbage
                           or (under_pressure and segment.garbage_ratio > 0))
            if emptied:
                await self._empty_segment(segment, "garbage")

    async def _empty_segment(self, segment: Segment, reason: str) -> None:
        """Move the segment's live blocks forward (dropping expired ones), then delete the file.

        On a full disk there is no room to copy them: they are evicted instead."""
        store = self.store
        if segment.writers:  # records placed in it are still being written; their index entries will follow
            return
        if not segment.sealed:
            await store.seal_segment(segment)
        if segment.live_bytes > 0:
            expired: Places = {}
            evicted: Places = {}
            for record in await store.segment_records(segment):
                if record.entry is None:
                    continue  # dead bytes: the block was removed or lives elsewhere now
                if record.expired:
                    expired[record.key] = record.place
                    continue
                if self.disk_full:
                    evicted[record.key] = record.place
                    continue
                try:
                    await store.copy_forward(record.key, record.entry, segment)
                except OSError as exc:
                    log.warning("compaction of segment %d stopped, will retry: %s", segment.id, exc)
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not self.disk_full:
                        self.disk_filled()
                    return
            if not await self._drop(segment, expired, evicted):
                return
        if segment.live_bytes > 0 or segment.writers:
            return  # something was written (or placed before the seal) meanwhile; try again at the next pass
        faults.hit("compaction.before_delete")  # every live block moved or removed, the file still there
        store.delete_segment(segment)
        self.metrics.compactions.labels(reason=reason).inc()

    async def _drop(self, segment: Segment, expired: Places, evicted: Places) -> bool:
        """Remove the segment's expired and evicted blocks; False if the segment is not to be deleted now."""
        for places, counter, reason in ((expired, self.metrics.expiries, "expired"),
                                        (evicted, self.metrics.evictions, "evicted")):
            removed, complete = await self._remove_all(places, reason)
            counter.inc(removed)
            if complete:
                continue
            if not self.reserve.held_bytes:
                await self._give_back(segment, {**expired, **evicted})
            return False
        return True
