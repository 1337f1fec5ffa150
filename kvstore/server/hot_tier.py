"""The daemon's bounded DRAM tier: whole verified records, in front of the segment files."""

from __future__ import annotations

from kvstore.eviction import EvictionPolicy, LRU


class HotTier:
    def __init__(self, capacity_bytes: int, policy: EvictionPolicy | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self._policy = policy or LRU()
        self._records: dict[bytes, tuple[bytes, bytes]] = {}  # key -> (header, payload)

    def get(self, key: bytes) -> tuple[bytes, bytes] | None:
        record = self._records.get(key)
        if record is not None:
            self._policy.access(key)
        return record

    def put(self, key: bytes, header: bytes, payload: bytes) -> None:
        size = len(header) + len(payload)
        if size > self.capacity_bytes:
            return
        self._records[key] = (header, payload)
        self._policy.insert(key, size)
        while self._policy.tracked_bytes > self.capacity_bytes:
            victim = self._policy.pop_victim()
            if victim is None:
                break
            self._records.pop(victim, None)

    def discard(self, key: bytes) -> None:
        if self._records.pop(key, None) is not None:
            self._policy.remove(key)

    @property
    def bytes(self) -> int:
        return self._policy.tracked_bytes

    def __len__(self) -> int:
        return len(self._records)
