"""What one block store holds, in numbers, kept in one place.

* live bytes: of every record the index points at, in all and per segment (`Segment.live_bytes`, which
  compaction's garbage ratio reads; only this class changes it);
* blocks per traffic class (for the gauges);
* each tenant's bytes and recency, for `tenant_max_share` (tenant_share.py).

The store changes them as its index changes (`added`, `removed`, `moved`) and only then, so they agree
with the index; retention and the gauges read them.
"""

from __future__ import annotations

from kvstore.server.index import Entry
from kvstore.server.segments import Segment, SegmentSet
from kvstore.server.tenant_share import TenantShare


class Accounting:
    def __init__(self, segments: SegmentSet, tenant_max_share: float) -> None:
        self._segments = segments
        self.live_bytes = 0
        self.class_blocks: dict[int, int] = {}  # class id -> blocks indexed
        self.shares = TenantShare(tenant_max_share)

    @property
    def disk_bytes(self) -> int:
        """Bytes of every segment file, live records and dead ones."""
        return self._segments.disk_bytes

    def added(self, key: bytes, entry: Entry) -> None:
        """`entry` was indexed (a put, or start-up: then in order of last access, for the tenants' recency)."""
        segment = self._segments.segments.get(entry.segment)
        if segment is not None:
            segment.live_bytes += entry.record_len
        self.live_bytes += entry.record_len
        self.class_blocks[entry.class_id] = self.class_blocks.get(entry.class_id, 0) + 1
        self.shares.added(entry.tenant_id, key, entry.record_len)

    def removed(self, key: bytes, entry: Entry) -> None:
        """`entry` left the index (removed, or replaced by a newer put of its key)."""
        segment = self._segments.segments.get(entry.segment)
        if segment is not None:
            segment.live_bytes -= entry.record_len
        self.live_bytes -= entry.record_len
        self.class_blocks[entry.class_id] = self.class_blocks.get(entry.class_id, 0) - 1
        self.shares.removed(entry.tenant_id, key)

    def moved(self, entry: Entry, old: Segment, new: Segment) -> None:
        """The record of `entry` was copied forward from `old` into `new`, and the index points at the copy."""
        old.live_bytes -= entry.record_len
        new.live_bytes += entry.record_len

    def accessed(self, tenant_id: int, key: bytes) -> None:
        self.shares.accessed(tenant_id, key)
