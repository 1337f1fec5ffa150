"""The client's host-DRAM tier: verified blocks kept in this process, in front of the daemons.

All slots are carved out of one buffer allocated up front (pinned on CUDA, so copies to the device
can be asynchronous), because fresh memory on these VMs costs ~3 us per 4 KiB page to fault in.
A slot holds one block's payload; blocks larger than a slot are not kept. Thread-safe: the engine
thread, loader threads and write-behind threads use it at once. A reader pins the blocks it copies
from, and eviction skips pinned blocks, so a slot is never rewritten while it is read.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.eviction import LRU, EvictionPolicy
from kvstore.record import RecordHeader


@dataclass(slots=True)
class HostBlock:
    header: RecordHeader
    slot: int
    pins: int = 0


class HostTier:
    def __init__(self, capacity_bytes: int, slot_bytes: int, pinned: bool = False,
                 policy: EvictionPolicy | None = None) -> None:
        if slot_bytes < 1 or capacity_bytes < slot_bytes:
            raise ValueError(f"host tier of {capacity_bytes} bytes cannot hold one {slot_bytes}-byte slot")
        self.slot_bytes = slot_bytes
        self.slots = capacity_bytes // slot_bytes
        self.buffer = _allocate(self.slots * slot_bytes, pinned)  # (slots, slot_bytes) uint8
        self._view = memoryview(self.buffer).cast("B") if not pinned else memoryview(self.buffer.numpy())
        self._free = list(range(self.slots - 1, -1, -1))
        self._blocks: dict[bytes, HostBlock] = {}
        self._policy = policy or LRU()
        self._lock = threading.Lock()
        self.counters: Counter = Counter()  # hits, misses, inserted, evicted, too_large

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def leading_hits(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are held here."""
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._blocks:
                    return i
            return len(keys)

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held here."""
        with self._lock:
            return [key in self._blocks for key in keys]

    def slot_view(self, slot: int, nbytes: int) -> memoryview:
        start = slot * self.slot_bytes
        return self._view[start : start + nbytes]

    def pin(self, keys: Sequence[bytes]) -> list[HostBlock]:
        """Pin the leading run of `keys` held here (leaf first as recency); unpin when done reading."""
        with self._lock:
            pinned = []
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    break
                block.pins += 1
                pinned.append(block)
            for key in reversed(keys[: len(pinned)]):
                self._policy.access(key)
            self.counters["hits"] += len(pinned)
            self.counters["misses"] += len(keys) > len(pinned)
            return pinned

    def unpin(self, blocks: Sequence[HostBlock]) -> None:
        with self._lock:
            for block in blocks:
                block.pins -= 1

    def put(self, header: RecordHeader, payload: bytes | bytearray | memoryview) -> bool:
        """Copy a verified block in; False if it does not fit or every slot is pinned."""
        if len(payload) > self.slot_bytes:
            self.counters["too_large"] += 1
            return False
        with self._lock:
            if header.key in self._blocks:
                self._policy.access(header.key)
                return True
            slot = self._take_slot()
            if slot is None:
                return False
            self._view[slot * self.slot_bytes : slot * self.slot_bytes + len(payload)] = payload
            self._blocks[header.key] = HostBlock(header, slot)
            self._policy.insert(header.key, len(payload))
            self.counters["inserted"] += 1
            return True

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        skipped = []
        try:
            while (victim := self._policy.pop_victim()) is not None:
                block = self._blocks[victim]
                if block.pins:
                    skipped.append((victim, self.slot_bytes))
                    continue
                del self._blocks[victim]
                self.counters["evicted"] += 1
                return block.slot
            return None
        finally:
            for key, size in skipped:  # pinned blocks stay, as the most recent
                self._policy.insert(key, size)

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._blocks))


def _allocate(nbytes: int, pinned: bool):
    if pinned:
        import torch  # the device path only
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buffer = bytearray(nbytes)
    memoryview(buffer)[::4096] = b"\x00" * len(range(0, nbytes, 4096))  # touch every page now, not mid-load
    return buffer
