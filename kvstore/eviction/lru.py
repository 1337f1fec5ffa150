"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict

from kvstore.eviction.base import EvictionPolicy, ReuseHint


class LRU(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, int] = OrderedDict()  # oldest first: key -> size
        self._bytes = 0

    def insert(self, key, size: int, parent=None, hint: ReuseHint | None = None) -> None:
        old = self._order.pop(key, None)
        if old is not None:
            self._bytes -= old
        self._order[key] = size
        self._bytes += size

    def access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        size = self._order.pop(key, None)
        if size is not None:
            self._bytes -= size

    def pop_victim(self) -> bytes | None:
        if not self._order:
            return None
        key, size = self._order.popitem(last=False)
        self._bytes -= size
        return key

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    @property
    def tracked_bytes(self) -> int:
        return self._bytes
