"""The daemon's bounded DRAM tier: whole verified records, in front of the segment files.

Payload buffers are recycled: fresh memory on these VMs costs ~3 us per 4 KiB page to fault in (and
much more once a process holds a few GiB), so a buffer freed by eviction is handed to the next put or
read of the same size instead of back to the allocator. A reader pins the entry it is sending from;
an evicted entry's buffer is recycled only once its last reader is done, so eviction never rewrites
bytes a reader holds.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from kvstore.eviction import LRU, EvictionPolicy
from kvstore.record import RecordBytes

FREE_BUFFERS_PER_SIZE = 8
Recyclable = bytearray | mmap.mmap  # a payload buffer the tier hands to the next put or read of its size


@dataclass(eq=False, slots=True)
class HotEntry:
    header: bytes
    payload: RecordBytes
    pins: int = 0
    evicted: bool = False


class HotTier:
    def __init__(self, capacity_bytes: int, policy: EvictionPolicy | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self._policy = policy or LRU()
        self._entries: dict[bytes, HotEntry] = {}
        self._free: dict[int, list[Recyclable]] = {}  # size -> buffers nobody references

    def pin(self, key: bytes) -> HotEntry | None:
        """The entry of `key`, pinned until `unpin`; None on a miss."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.pins += 1
            self._policy.access(key)
        return entry

    def unpin(self, entry: HotEntry) -> None:
        entry.pins -= 1
        if entry.evicted and entry.pins == 0:
            self._recycle(entry.payload)

    def buffer(self, nbytes: int) -> Recyclable:
        """A writable buffer of exactly `nbytes`, recycled when one is free."""
        recycled = self.reuse(nbytes)
        return bytearray(nbytes) if recycled is None else recycled

    def reuse(self, nbytes: int) -> Recyclable | None:
        """A free buffer of exactly `nbytes` (memory the process holds already), or None."""
        free = self._free.get(nbytes)
        return free.pop() if free else None

    def put(self, key: bytes, header: bytes, payload: RecordBytes) -> None:
        size = len(header) + len(payload)
        if size > self.capacity_bytes:
            # Not recycled: the caller still sends from it (a read of a block too big for the tier), and a
            # recycled buffer is refilled by the next read while this one is being sent.
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._drop(old)
        self._entries[key] = HotEntry(header, payload)
        self._policy.insert(key, size)
        while self._policy.tracked_bytes > self.capacity_bytes:
            victim = self._policy.pop_victim()
            if victim is None:
                break
            self._drop(self._entries.pop(victim))

    def discard(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._policy.remove(key)
            self._drop(entry)

    def _drop(self, entry: HotEntry) -> None:
        entry.evicted = True
        if entry.pins == 0:
            self._recycle(entry.payload)

    def _recycle(self, payload: RecordBytes) -> None:
        if isinstance(payload, (bytearray, mmap.mmap)):  # mmap: a large payload from the data channel
            free = self._free.setdefault(len(payload), [])
            if len(free) < FREE_BUFFERS_PER_SIZE:
                free.append(payload)

    @property
    def bytes(self) -> int:
        return self._policy.tracked_bytes

    def __len__(self) -> int:
        return len(self._entries)
