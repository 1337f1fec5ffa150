"""The daemon's bounded DRAM tier: whole verified records, in front of the segment files.

Payload buffers are recycled: fresh memory on these VMs costs ~3 us per 4 KiB page to fault in (and
much more once a process holds a few GiB), so a buffer freed by eviction is handed to the next put or
read of the same size instead of back to the allocator. A reader pins the entry it is sending from;
an evicted entry's buffer is recycled only once its last reader is done, so eviction never rewrites
bytes a reader holds.

Records also arrive before anyone asks for them (promotion.py): `put_prefetched` keeps them flagged
until their first read, holds at most `prefetch_bytes` of them unread at a time, and makes room only by
evicting entries that no reader pins and that are not themselves unread prefetches; where that cannot
make room it refuses. `hold` flags an entry already here the same way. A plain put (a read, a Put)
passes unread prefetches over while anything else can go, so that ordinary traffic does not push them
out before the read they were brought in for.

The budget is shared fairly between the tenants (the owners) of the prefetched blocks: with n tenants
holding unread prefetches, counting the one asking, each may hold at most prefetch_bytes / n. A tenant
within its share is never refused for the budget: where the budget is spent, the oldest unread prefetches
of tenants past their share stop being held ("reclaimed"). A prefetch unread for `prefetch_max_age_s`
stops being held too ("aged"), so what a tenant never reads cannot keep its share forever. Either way the
entry stays in the tier as a plain one, which a later put may evict.
How each prefetched entry ended, read ("used"), evicted or discarded unread ("wasted"), or no longer held
("aged", "reclaimed"), is told to `on_prefetch_end`.
"""

from __future__ import annotations

import math
import mmap
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvstore import faults
from kvstore.eviction import LRU, EvictionPolicy
from kvstore.record import RecordBytes

FREE_BUFFERS_PER_SIZE = 8
FREE_BYTES_FLOOR = 64 * 2**20  # free buffers kept at most: this, or a quarter of the tier if that is more
Recyclable = bytearray | mmap.mmap  # a payload buffer the tier hands to the next put or read of its size
PrefetchEnd = Literal["used", "wasted", "aged", "reclaimed"]
# Why put_prefetched did not keep a record: the key is held already, the prefetch budget is spent (by this
# owner alone), this owner's share of it is spent (other owners hold unread prefetches too), or no room can
# be made without evicting a pinned entry or another unread prefetch.
PrefetchRefusal = Literal["in_dram", "budget", "tenant_share", "no_room"]


@dataclass(eq=False, slots=True)
class HotEntry:
    header: bytes
    payload: RecordBytes
    key: bytes = b""
    pins: int = 0
    evicted: bool = False
    prefetched: bool = False  # put by put_prefetched (or flagged by hold) and not read since
    owner: int = 0  # while prefetched: the tenant whose share it counts against
    prefetched_at: float = 0.0  # while prefetched: when it was flagged, in the tier's clock

    @property
    def size(self) -> int:
        return len(self.header) + len(self.payload)

    @property
    def held(self) -> bool:
        """Whether put_prefetched may not evict it: a reader pins it, or it is a prefetch nobody has read."""
        return self.pins > 0 or self.prefetched


class HotTier:
    def __init__(self, capacity_bytes: int, policy: EvictionPolicy | None = None, prefetch_bytes: int = 0,
                 on_prefetch_end: Callable[[PrefetchEnd, int], None] | None = None,
                 prefetch_max_age_s: float = math.inf, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        self.prefetch_bytes = prefetch_bytes  # the most bytes of unread prefetched entries at a time; 0: none
        self.prefetch_max_age_s = prefetch_max_age_s
        self.clock = clock
        self._on_prefetch_end = on_prefetch_end
        self._policy = policy or LRU()
        self._entries: dict[bytes, HotEntry] = {}
        self._free: dict[int, list[Recyclable]] = {}  # size -> buffers nobody references
        self._free_bytes = 0
        self._free_limit = max(FREE_BYTES_FLOOR, capacity_bytes // 4)
        self.prefetched_bytes = 0  # bytes of entries put by put_prefetched and not read yet
        self._unread: OrderedDict[bytes, HotEntry] = OrderedDict()  # the prefetched entries, oldest first
        self._unread_by_owner: dict[int, int] = {}  # owner -> bytes of its prefetched entries
        self._held_bytes = 0  # bytes of the entries in the tier that are `held`

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def pin(self, key: bytes) -> HotEntry | None:
        """The entry of `key`, pinned until `unpin`; None on a miss. A read: the first one of a prefetched
        entry is when the prefetch was used."""
        entry = self._entries.get(key)
        if entry is not None:
            was_held = entry.held
            if entry.prefetched:
                self._end_prefetch(entry, "used")
            entry.pins += 1
            self._held_changed(entry, was_held)
            self._policy.access(key)
        return entry

    def unpin(self, entry: HotEntry) -> None:
        was_held = entry.held
        entry.pins -= 1
        self._held_changed(entry, was_held)
        if entry.evicted and entry.pins == 0:
            self._recycle(entry.payload)

    def buffer(self, nbytes: int) -> Recyclable:
        """A writable buffer of exactly `nbytes`, recycled when one is free."""
        recycled = self.reuse(nbytes)
        return bytearray(nbytes) if recycled is None else recycled

    def reuse(self, nbytes: int) -> Recyclable | None:
        """A free buffer of exactly `nbytes` (memory the process holds already), or None."""
        free = self._free.get(nbytes)
        if not free:
            return None
        self._free_bytes -= nbytes
        return free.pop()

    def put(self, key: bytes, header: bytes, payload: RecordBytes, done_with: bool = False) -> None:
        """Keep a record. `done_with`: the caller has finished with `payload` (a put, stored), so a buffer
        the tier cannot keep is recycled for the next one, which then lands in memory already faulted in."""
        size = len(header) + len(payload)
        if size > self.capacity_bytes:
            # Else not recycled: the caller still sends from it (a read of a block too big for the tier), and
            # a recycled buffer is refilled by the next read while this one is being sent.
            if done_with:
                self._recycle(payload)
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._drop(old)
        payload = faults.damaged("hot_tier.put", payload)  # the tests' memory gone bad; off: a dictionary miss
        self._entries[key] = HotEntry(header, payload, key)
        self._policy.insert(key, size)
        # Unread prefetches are passed over: they were brought in (or held) for a read known to be coming,
        # and ordinary traffic would otherwise push them out before it. They are at most prefetch_bytes;
        # where nothing else is left, the least recent of them goes too.
        passed_over: list[tuple[bytes, int]] = []  # out of the policy's order while this looks past them
        passed_bytes = 0
        try:
            while self._policy.tracked_bytes + passed_bytes > self.capacity_bytes:
                victim = self._policy.pop_victim()
                if victim is None or (victim == key and passed_over):  # only prefetches left besides this one
                    if victim == key:
                        self._policy.insert(key, size)
                    if not passed_over:
                        break
                    victim, victim_bytes = passed_over.pop(0)
                    passed_bytes -= victim_bytes
                elif victim != key and self._entries[victim].prefetched:
                    passed_over.append((victim, self._entries[victim].size))
                    passed_bytes += passed_over[-1][1]
                    continue
                self._drop(self._entries.pop(victim))
        finally:
            for held_key, held_size in passed_over:
                self._policy.insert(held_key, held_size)

    # -- prefetched entries (promotion.py) ------------------------------------------------------------

    def hold(self, key: bytes, owner: int = 0) -> bool:
        """Flag an entry already here as a prefetch of `owner` until its next read (a read known to be coming),
        within the prefetch budget and the owner's share; whether it is flagged now."""
        self.release_aged()
        entry = self._entries.get(key)
        if entry is None or entry.prefetched:
            return entry is not None
        if self._budget_refusal(entry.size, owner) is not None:
            return False
        self._reclaim(entry.size, owner)
        was_held = entry.held
        self._flag(entry, owner)
        self._held_changed(entry, was_held)
        return True

    def prefetch_refusal(self, key: bytes, size: int, owner: int = 0) -> PrefetchRefusal | None:
        """Why put_prefetched would refuse a record of `size` bytes for `key` of `owner` now; None if it would
        keep it."""
        self.release_aged()
        if key in self._entries:
            return "in_dram"
        refusal = self._budget_refusal(size, owner)
        if refusal is not None:
            return refusal
        if size > self.capacity_bytes - self._held_bytes:  # what evicting every entry not held would leave
            return "no_room"
        return None

    def put_prefetched(self, key: bytes, header: bytes, payload: RecordBytes,
                       owner: int = 0) -> PrefetchRefusal | None:
        """Keep a record of `owner` nobody has asked for yet, flagged until its first read; None once kept,
        else why not. Room is made by evicting only entries that are not `held`; the tier takes `payload`
        either way (a refused buffer is recycled)."""
        size = len(header) + len(payload)
        refusal = self.prefetch_refusal(key, size, owner)
        if refusal is not None:
            self._recycle(payload)
            return refusal
        self._reclaim(size, owner)
        needed = self._policy.tracked_bytes + size - self.capacity_bytes
        passed_over: list[tuple[bytes, int]] = []
        try:
            while needed > 0:
                victim = self._policy.pop_victim()
                if victim is None:  # cannot happen while _held_bytes is right; refuse rather than overfill
                    self._recycle(payload)
                    return "no_room"
                entry = self._entries[victim]
                if entry.held:
                    passed_over.append((victim, entry.size))
                    continue
                del self._entries[victim]
                self._drop(entry)
                needed -= entry.size
        finally:
            for held_key, held_size in passed_over:  # they stay, as the most recent (HostTier does the same)
                self._policy.insert(held_key, held_size)
        entry = HotEntry(header, payload, key)
        self._entries[key] = entry
        self._policy.insert(key, size)
        self._flag(entry, owner)
        self._held_bytes += size
        return None

    def release_aged(self) -> None:
        """Stop holding the prefetches unread for `prefetch_max_age_s` or longer."""
        oldest_kept = self.clock() - self.prefetch_max_age_s
        while self._unread:
            entry = next(iter(self._unread.values()))
            if entry.prefetched_at > oldest_kept:
                break
            self._release(entry, "aged")

    def share(self, owner: int) -> int:
        """The most bytes of unread prefetches `owner` may hold now: an equal part of the budget for each owner
        holding some, counting `owner`."""
        owners = len(self._unread_by_owner) + (owner not in self._unread_by_owner)
        return self.prefetch_bytes // owners

    def unread_bytes_of(self, owner: int) -> int:
        return self._unread_by_owner.get(owner, 0)

    def _budget_refusal(self, size: int, owner: int) -> PrefetchRefusal | None:
        """Whether `size` more bytes of `owner` are past its share (then nothing is reclaimed for them). Within
        it they always fit once other owners past theirs are reclaimed (`_reclaim`)."""
        if self.unread_bytes_of(owner) + size <= self.share(owner):
            return None
        return "budget" if self.share(owner) == self.prefetch_bytes else "tenant_share"

    def _reclaim(self, size: int, owner: int) -> None:
        """Make room in the budget for `size` bytes of `owner` (within its share): the oldest prefetches of
        other owners past their share stop being held, until it fits."""
        needed = self.prefetched_bytes + size - self.prefetch_bytes
        if needed <= 0:
            return
        share = self.share(owner)
        for entry in list(self._unread.values()):
            if needed <= 0:
                break
            if entry.owner != owner and self.unread_bytes_of(entry.owner) > share:
                needed -= entry.size
                self._release(entry, "reclaimed")

    def _flag(self, entry: HotEntry, owner: int) -> None:
        entry.prefetched = True
        entry.owner = owner
        entry.prefetched_at = self.clock()
        self.prefetched_bytes += entry.size
        self._unread[entry.key] = entry
        self._unread_by_owner[owner] = self.unread_bytes_of(owner) + entry.size

    def _release(self, entry: HotEntry, how: PrefetchEnd) -> None:
        """An unread prefetch stops being held; it stays in the tier as a plain entry."""
        was_held = entry.held
        self._end_prefetch(entry, how)
        self._held_changed(entry, was_held)

    def _end_prefetch(self, entry: HotEntry, how: PrefetchEnd) -> None:
        entry.prefetched = False
        self.prefetched_bytes -= entry.size
        del self._unread[entry.key]
        left = self._unread_by_owner[entry.owner] - entry.size
        if left:
            self._unread_by_owner[entry.owner] = left
        else:
            del self._unread_by_owner[entry.owner]
        if self._on_prefetch_end is not None:
            self._on_prefetch_end(how, entry.size)

    def _held_changed(self, entry: HotEntry, was_held: bool) -> None:
        if not entry.evicted and entry.held != was_held:
            self._held_bytes += entry.size if entry.held else -entry.size

    # -- leaving the tier ---------------------------------------------------------------------------

    def discard(self, key: bytes, only: HotEntry | None = None) -> None:
        """Take `key`'s entry out of the tier; with `only`, only while that entry is still the one it holds
        (a put may have replaced it meanwhile)."""
        entry = self._entries.get(key)
        if entry is not None and (only is None or entry is only):
            del self._entries[key]
            self._policy.remove(key)
            self._drop(entry)

    def _drop(self, entry: HotEntry) -> None:
        """`entry`, already out of the entries and the policy, leaves the tier."""
        if entry.held:
            self._held_bytes -= entry.size
        if entry.prefetched:
            self._end_prefetch(entry, "wasted")
        entry.evicted = True
        if entry.pins == 0:
            self._recycle(entry.payload)

    def _recycle(self, payload: RecordBytes) -> None:
        if isinstance(payload, (bytearray, mmap.mmap)):  # mmap: a large payload from the data channel
            free = self._free.setdefault(len(payload), [])
            if len(free) < FREE_BUFFERS_PER_SIZE and self._free_bytes + len(payload) <= self._free_limit:
                free.append(payload)
                self._free_bytes += len(payload)

    @property
    def bytes(self) -> int:
        return self._policy.tracked_bytes

    def __len__(self) -> int:
        return len(self._entries)
