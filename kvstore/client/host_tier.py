"""The client's host-DRAM tier: verified blocks kept in this process, in front of the daemons.

All slots are carved out of one buffer allocated up front (pinned on CUDA, so copies to the device
can be asynchronous), because fresh memory on these VMs costs ~3 us per 4 KiB page to fault in.
A slot holds one block's payload; blocks larger than a slot are not kept. Thread-safe: the engine
thread, loader threads and write-behind threads use it at once. A reader pins the blocks it copies
from, and eviction skips pinned blocks, so a slot is never rewritten while it is read.

Blocks also arrive before anyone reads them (prefetch.py): `put(..., prefetched=True)` flags them until
their first pin, and evicts neither pinned blocks nor other flagged ones to make room; `hold` flags blocks
already here the same way (at most half the slots are flagged). A plain put passes flagged blocks over
while any other can go, so ordinary traffic does not push them out before the read they are kept for. A
flagged block's first pin counts as `prefetch_used`, its eviction unread as `prefetch_wasted` (in the
ClientStats given).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.client.stats import ClientStats
from kvstore.eviction import LRU, EvictionPolicy
from kvstore.record import RecordHeader


@dataclass(slots=True)
class HostBlock:
    header: RecordHeader
    slot: int
    pins: int = 0
    prefetched: bool = False  # put by a prefetch and not pinned (read) since


class HostTier:
    def __init__(self, capacity_bytes: int, slot_bytes: int, pinned: bool = False,
                 policy: EvictionPolicy | None = None, stats: ClientStats | None = None) -> None:
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
        self.stats = stats or ClientStats()  # where prefetched blocks' use and waste are counted

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
                if block.prefetched:
                    block.prefetched = False
                    self.stats.prefetch_used += 1
            for key in reversed(keys[: len(pinned)]):
                self._policy.access(key)
            self.counters["hits"] += len(pinned)
            self.counters["misses"] += len(keys) > len(pinned)
            return pinned

    def unpin(self, blocks: Sequence[HostBlock]) -> None:
        with self._lock:
            for block in blocks:
                block.pins -= 1

    def hold(self, keys: Sequence[bytes]) -> list[bool]:
        """Flag the blocks of `keys` held here as prefetched, until their first pin (a read known to be coming),
        while at most half the slots are flagged; whether each is flagged now."""
        with self._lock:
            flagged = sum(block.prefetched for block in self._blocks.values())
            out = []
            for key in keys:
                block = self._blocks.get(key)
                if block is not None and not block.prefetched and flagged < self.slots // 2:
                    block.prefetched = True
                    flagged += 1
                out.append(block is not None and block.prefetched)
            return out

    def put(self, header: RecordHeader, payload: bytes | bytearray | memoryview, prefetched: bool = False) -> bool:
        """Copy a verified block in; False if it does not fit or every slot is pinned. A `prefetched` block
        is flagged until its first pin and takes no slot of a pinned or another flagged block."""
        if len(payload) > self.slot_bytes:
            self.counters["too_large"] += 1
            return False
        with self._lock:
            if header.key in self._blocks:
                self._policy.access(header.key)
                return True
            slot = self._take_slot(spare_prefetched=prefetched)
            if slot is None:
                return False
            self._view[slot * self.slot_bytes : slot * self.slot_bytes + len(payload)] = payload
            self._blocks[header.key] = HostBlock(header, slot, prefetched=prefetched)
            self._policy.insert(header.key, len(payload))
            self.counters["inserted"] += 1
            return True

    def _take_slot(self, spare_prefetched: bool = False) -> int | None:
        """A free slot, or the slot of the policy's first victim that is neither pinned nor a prefetched block
        not read yet; failing that, for a plain put (not `spare_prefetched`), the first such prefetched one."""
        if self._free:
            return self._free.pop()
        skipped = []
        try:
            while (victim := self._policy.pop_victim()) is not None:
                block = self._blocks[victim]
                skipped.append((victim, self.slot_bytes))
                if not block.pins and not block.prefetched:
                    return self._evict(skipped.pop())
            if not spare_prefetched:
                unread = next((i for i, (key, _) in enumerate(skipped) if not self._blocks[key].pins), None)
                if unread is not None:
                    return self._evict(skipped.pop(unread))
            return None
        finally:
            for key, size in skipped:  # pinned blocks stay, as the most recent
                self._policy.insert(key, size)

    def _evict(self, victim: tuple[bytes, int]) -> int:
        """Drop the victim (out of the policy already); its slot."""
        block = self._blocks.pop(victim[0])
        self.counters["evicted"] += 1
        if block.prefetched:
            self.stats.prefetch_wasted += 1
        return block.slot

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
