"""Which blocks are hot: read at least `min_reads` times within about one window.

Counts live in two dicts, this window's and the last one's, so a key's rate spans one to two windows
and memory is bounded by the keys read in two windows, capped at `max_keys` (past the cap, keys not
already counted are not counted: a flood of one-off reads cannot push the hot ones out).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class HotKeys:
    def __init__(self, min_reads: int, window_s: float, max_keys: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_reads, self.window_s, self.max_keys, self.clock = min_reads, window_s, max_keys, clock
        self.current: dict[bytes, int] = {}
        self.previous: dict[bytes, int] = {}
        self.window_end = clock() + window_s

    def read(self, key: bytes) -> bool:
        """Count one read of `key`; whether it is hot now."""
        now = self.clock()
        if now >= self.window_end:
            self.previous = self.current if now < self.window_end + self.window_s else {}
            self.current = {}
            self.window_end = now + self.window_s
        count = self.current.get(key)
        if count is None:
            if len(self.current) >= self.max_keys:
                return self.previous.get(key, 0) >= self.min_reads
            count = 0
        self.current[key] = count = count + 1
        return count + self.previous.get(key, 0) >= self.min_reads
