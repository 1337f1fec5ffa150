"""Record headers of recent blocks in memory, so that reading a block the page cache lacks costs the device
one request (its payload), not two: a header read waits behind the payload reads already queued, and on
these VMs it took longer than a 4 MiB read (docs/performance.md, "Same host").

An entry holds the header bytes as written and the place they were written at; a block moved (compaction)
or stored again elsewhere misses, and its header is read from the file as before. The headers were verified
when their record was put or read; the payload bytes are verified against them as ever, so a cached header
only spares the read, never a check. Bounded in bytes, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict

Place = tuple[int, int]  # (segment id, offset)
ENTRY_OVERHEAD_BYTES = 200  # what a cached header costs beyond its bytes (the key, the tuple, the dict's node)


class HeaderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, tuple[Place, bytes]] = OrderedDict()

    def get(self, key: bytes, place: Place) -> bytes | None:
        """The header of `key` written at `place`, or None."""
        found = self._entries.get(key)
        if found is None or found[0] != place:
            return None
        self._entries.move_to_end(key)
        return found[1]

    def put(self, key: bytes, place: Place, header: bytes) -> None:
        cost = len(header) + len(key) + ENTRY_OVERHEAD_BYTES
        if cost > self.capacity_bytes:
            return
        self.discard(key)
        self._entries[key] = (place, header)
        self.bytes += cost
        while self.bytes > self.capacity_bytes:
            self._forget(*self._entries.popitem(last=False))

    def discard(self, key: bytes) -> None:
        found = self._entries.pop(key, None)
        if found is not None:
            self._forget(key, found)

    def _forget(self, key: bytes, entry: tuple[Place, bytes]) -> None:
        self.bytes -= len(entry[1]) + len(key) + ENTRY_OVERHEAD_BYTES

    def __len__(self) -> int:
        return len(self._entries)
