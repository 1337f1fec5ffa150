"""S3-FIFO: Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023.

A small FIFO (10% of the capacity) filters one-hit wonders; objects accessed while in it move to the
main FIFO, which evicts with a 2-bit frequency as a second chance (CLOCK-like); a ghost FIFO of keys
recently evicted from the small queue admits them straight into the main one when they return.
Parameters as in the paper: small = 10%, frequency capped at 3, ghost as long as the main queue.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.eviction.base import EvictionPolicy, ReuseHint

MAX_FREQ = 3


class S3FIFO(EvictionPolicy):
    def __init__(self, capacity_bytes: int, small_ratio: float = 0.1) -> None:
        if capacity_bytes < 1 or not 0 < small_ratio < 1:
            raise ValueError("S3FIFO needs a positive capacity and 0 < small_ratio < 1")
        self.capacity_bytes = capacity_bytes
        self.small_ratio = small_ratio
        self._small: OrderedDict = OrderedDict()  # oldest first: key -> size
        self._main: OrderedDict = OrderedDict()
        self._ghost: OrderedDict = OrderedDict()  # keys only
        self._freq: dict = {}
        self._small_bytes = 0
        self._main_bytes = 0

    def insert(self, key, size: int, parent=None, hint: ReuseHint | None = None) -> None:
        if key in self._freq:
            self.access(key)
            return
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = size
            self._main_bytes += size
        else:
            self._small[key] = size
            self._small_bytes += size

    def access(self, key) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, MAX_FREQ)

    def remove(self, key) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        else:
            self._main_bytes -= self._main.pop(key)

    def pop_victim(self):
        while self._small or self._main:
            if self._small and (self._small_bytes >= self.small_ratio * self.capacity_bytes or not self._main):
                key, size = self._small.popitem(last=False)
                self._small_bytes -= size
                if self._freq[key] > 0:  # accessed while on probation: promote
                    self._freq[key] = 0
                    self._main[key] = size
                    self._main_bytes += size
                    continue
                del self._freq[key]
                self._ghost[key] = None
                while len(self._ghost) > max(len(self._main), 1):
                    self._ghost.popitem(last=False)
                return key
            key, size = self._main.popitem(last=False)
            if self._freq[key] > 0:  # second chance, one frequency step at a time
                self._freq[key] -= 1
                self._main[key] = size
                continue
            self._main_bytes -= size
            del self._freq[key]
            return key
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    @property
    def tracked_bytes(self) -> int:
        return self._small_bytes + self._main_bytes
