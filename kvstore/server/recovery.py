"""Start-up recovery of the index from the self-describing segments (docs/design.md invariant 7).

A daemon never deletes data it cannot prove dead. Every record carries its key, parent, tenant, traffic
class, lengths and checksums, so the index can always be rebuilt from the segments; what the index
alone knew (access times, extended expiries, the eviction policy's classes) is approximated.

* Reconcile (every start): the header at every entry's place is read and must name the entry's key and
  lengths; an entry that fails is dropped, and the key's own record, if a verifiable one is found in
  the segments, is indexed again.
* Rebuild (the index is new while segments hold records, or damaged): the damaged one is moved aside
  (never deleted) and a fresh index is filled from every verifiable record, the newest copy of a key
  winning. `kvstore fsck --rebuild` does the same offline.

When which happens is written down for operators in docs/operations.md ("When the index is lost or
damaged").
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from kvstore.record import NO_TENANT, CorruptRecord, RecordHeader, peek_header
from kvstore.server.frames import FRAME_BYTES
from kvstore.server.index import Entry, Index, IndexDamaged, IndexUnavailable, Txn, is_damage
from kvstore.server.segments import Segment, SegmentSet

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 5.0  # a rebuild logs how far it has got this often
_INSERT_BATCH = 1024  # entries per index commit during a rebuild
_PREFETCH_WINDOW = 1024  # entries whose record headers are read ahead together at start-up


@dataclass
class RebuildStats:
    segments: int = 0
    records: int = 0  # whole records with a valid header
    indexed: int = 0  # became index entries
    superseded: int = 0  # the index already held the key (or a newer copy of it did)
    unverified: int = 0  # failed the key's identity or a payload checksum: left out
    bytes_scanned: int = 0

    def __str__(self) -> str:
        return (f"{self.indexed:,} records indexed from {self.segments} segments ({self.superseded:,} superseded "
                f"by a newer copy or an existing entry, {self.unverified:,} failed verification)")


REBUILDING = b"rebuilding"  # index meta key: set before a rebuild writes anything into the index, cleared once whole


def open_index(path: Path, map_bytes: int, max_map_bytes: int, fsync: bool) -> tuple[Index, str]:
    """Open a daemon's index at start-up; returns it and why it must be rebuilt ("" when it need not).

    A damaged index is moved aside to `index.damaged-<UTC time>` and a fresh one created in its place; the part
    of an index whose rebuild was cut short (a crash during start-up) is discarded, for it holds nothing the
    segments do not. An index returned for a rebuild is marked so before anything is written into it (the
    traffic classes a daemon names first included), so a crash at any point of the rebuild is seen at the next
    start: a partial index trusted as whole would take every record it lacks for dead, segments included.
    Raises IndexUnavailable when the index cannot be opened and is not damaged (no space, no permission)."""
    try:
        index = Index(path, map_bytes, max_map_bytes, fsync)
    except IndexDamaged as exc:
        aside = set_aside(path, "damaged", exc)
        log.error("%s; moved it aside to %s (kept, never deleted) and rebuilding it from the segments", exc, aside)
        return _fresh(path, map_bytes, max_map_bytes, fsync), f"the index was damaged and moved aside to {aside}"
    if index.meta(REBUILDING):
        return (discard_unfinished(index, path, map_bytes, max_map_bytes, fsync),
                "a rebuild of the index was cut short (the daemon stopped during it)")
    # Every daemon names its traffic classes in the index as it opens it, so an index without them has
    # never been used: created just now because index/ was missing or emptied.
    if not index.classes() and not index.stat()["entries"]:
        begin_rebuild(index)
        return index, "the index is missing or empty"
    return index, ""


def discard_unfinished(index: Index, path: Path, map_bytes: int, max_map_bytes: int, fsync: bool) -> Index:
    """A fresh index, marked for a rebuild, in place of one whose rebuild was cut short."""
    index.close()
    log.warning("the last rebuild of %s was cut short: discarding its part and rebuilding from the segments", path)
    shutil.rmtree(path)
    return _fresh(path, map_bytes, max_map_bytes, fsync)


def begin_rebuild(index: Index) -> None:
    """Mark the index as being rebuilt (durably, before the rebuild writes anything)."""
    index.submit(index.set_meta_op(REBUILDING, b"1")).result()


def end_rebuild(index: Index) -> None:
    """The rebuild is whole: from now on the index is the proof that a record it lacks is dead."""
    if index.meta(REBUILDING):
        index.submit(index.set_meta_op(REBUILDING, b"")).result()


def _fresh(path: Path, map_bytes: int, max_map_bytes: int, fsync: bool) -> Index:
    index = Index(path, map_bytes, max_map_bytes, fsync)
    begin_rebuild(index)
    return index


def replace_damaged(index: Index, path: Path, map_bytes: int, max_map_bytes: int, fsync: bool,
                    damage: IndexDamaged) -> tuple[Index, Path]:
    """Close an index found damaged while reading it, move it aside and open a fresh one in its place (marked
    for a rebuild); returns the fresh one and where the damaged one went."""
    with contextlib.suppress(Exception):  # a damaged environment may fail to sync; it is kept as it is
        index.close()
    aside = set_aside(path, "damaged", damage)
    log.error("%s; moved it aside to %s (kept, never deleted) and rebuilding it from the segments", damage, aside)
    return _fresh(path, map_bytes, max_map_bytes, fsync), aside


def set_aside(index_dir: Path, why: str, cause: Exception | None = None) -> Path:
    """Rename an index directory to `<name>.<why>-<UTC time>` beside it; it is never deleted."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = index_dir.with_name(f"{index_dir.name}.{why}-{stamp}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = index_dir.with_name(f"{index_dir.name}.{why}-{stamp}.{suffix}")
    try:
        os.rename(index_dir, target)
    except OSError as exc:
        raise IndexUnavailable(
            f"{cause or 'the index must be rebuilt'}, and it could not be moved aside to {target} ({exc}). Move "
            f"{index_dir} out of the way yourself, then run `kvstore fsck --rebuild {index_dir.parent}`") from None
    return target


# -- a daemon's start-up ------------------------------------------------------------------------------

def reconcile(index: Index, segments: SegmentSet, rebuild_reason: str,
              replace: Callable[[IndexDamaged], tuple[Index, Path]], now_ms: int
              ) -> tuple[Index, list[tuple[bytes, Entry]], int]:
    """Cut torn tails, then make the index agree with the segments: rebuilt from them when it is new or
    damaged (`rebuild_reason`), else every entry checked against the record header at its place, the stale
    ones dropped and their keys' own records, if verified ones are found, indexed again.

    `replace(damage)` sets aside an index found damaged while it is read, and returns a fresh one and
    where the damaged one went. Segments left without a live entry are deleted. Returns the index in use,
    its live entries, and how many were stale."""
    started = time.perf_counter()
    scanned = {seg.id: dict(segments.recover(seg)) for seg in segments.open_existing()}
    stale: dict[bytes, tuple[str, Entry]] = {}
    try:
        live, stale = ([], {}) if rebuild_reason else verify_entries(index, segments, scanned)
    except IndexDamaged as exc:  # a page deeper than the meta pages, found while reading
        index, aside = replace(exc)
        live, rebuild_reason = [], f"the index was damaged and moved aside to {aside}"
    if rebuild_reason and segments.disk_bytes:
        log.warning("rebuilding the index from the segments (%.1f GiB): %s", segments.disk_bytes / 2**30,
                    rebuild_reason)
        live, stats = rebuild_index(index, segments, now_ms=now_ms)
        log.warning("index rebuilt in %.1f s: %s", time.perf_counter() - started, stats)
    elif stale:
        begin_rebuild(index)  # cut short between the drop and the re-indexing, the next start rebuilds whole
        drop_stale(index, stale)
        found, _ = rebuild_index(index, segments, only=set(stale), now_ms=now_ms)
        if found:
            log.warning("re-indexed %d of the dropped keys from verified records found in the segments", len(found))
        live += found
    end_rebuild(index)
    # After a rebuild every verifiable record has an entry, so a segment without one holds only superseded
    # copies or damage; with a trusted index, a record it lacks was deleted, evicted or expired
    # (docs/operations.md).
    held = {entry.segment for _, entry in live}
    for segment in [s for s in segments.segments.values() if s.id not in held]:
        segments.delete(segment)
    return index, live, len(stale)


# -- reconcile ---------------------------------------------------------------------------------------

def verify_entries(index: Index, segments: SegmentSet, scanned: dict[int, dict[int, RecordHeader]]
                   ) -> tuple[list[tuple[bytes, Entry]], dict[bytes, tuple[str, Entry]]]:
    """Check every entry against the record header at its place: (live entries, stale key -> (why, entry)).

    One header read per entry (`scanned` holds the headers of segments already scanned). Raises
    IndexDamaged if LMDB fails reading the index itself."""
    live: list[tuple[bytes, Entry]] = []
    stale: dict[bytes, tuple[str, Entry]] = {}

    def check(window: list[tuple[bytes, Entry]]) -> None:
        _prefetch(window, segments, scanned)
        for key, entry in window:
            problem = _entry_problem(key, entry, segments, scanned)
            if problem:
                stale[key] = (problem, entry)
            else:
                live.append((key, entry))
    try:
        window: list[tuple[bytes, Entry]] = []
        with contextlib.closing(index.items()) as items:
            for item in items:
                window.append(item)
                if len(window) == _PREFETCH_WINDOW:
                    check(window)
                    window = []
        check(window)
    except lmdb.Error as exc:
        if is_damage(exc):
            raise IndexDamaged(f"the index is damaged ({exc})") from None
        raise
    return live, stale


def _prefetch(window: list[tuple[bytes, Entry]], segments: SegmentSet, scanned: dict[int, Any]) -> None:
    """Ask the kernel to read the window's headers at once: one by one from a cold disk, each read would
    wait its own latency (measured on a cold cache: 10 s instead of 1.9 s for 100,000 entries)."""
    for _, entry in window:
        segment = segments.segments.get(entry.segment)
        if segment is not None and entry.segment not in scanned:
            os.posix_fadvise(segment.fd, max(0, entry.offset - FRAME_BYTES), FRAME_BYTES + entry.header_len,
                             os.POSIX_FADV_WILLNEED)


def _entry_problem(key: bytes, entry: Entry, segments: SegmentSet, scanned: dict[int, dict[int, RecordHeader]]) -> str:
    segment = segments.segments.get(entry.segment)
    if segment is None:
        return "its segment is gone"
    if entry.offset + entry.record_len > segment.size or entry.offset < FRAME_BYTES:
        return "its record runs past the end of the segment"
    framed = True  # a scanned segment's records are all behind valid frames
    if entry.segment in scanned:
        header = scanned[entry.segment].get(entry.offset)
        if header is None:
            return "no whole record starts at its place"
        found = header.key, header.header_len, header.payload_len
    else:
        try:
            raw = os.pread(segment.fd, FRAME_BYTES + entry.header_len, entry.offset - FRAME_BYTES)
            found = peek_header(raw[FRAME_BYTES:])
        except CorruptRecord as exc:
            return f"no valid record header at its place ({exc.cause})"
        except OSError as exc:
            return f"its record header cannot be read ({exc.strerror})"
        framed = segments.frames.check_record(entry.segment, entry.offset - FRAME_BYTES, raw[:FRAME_BYTES],
                                              raw[FRAME_BYTES:], entry.record_len)
    if found[0] != key:
        return "the record at its place belongs to another key"
    if found[1:] != (entry.header_len, entry.payload_len):
        return "its lengths differ from the record's header"
    if not framed:
        return "no frame of this daemon's stands before its record"
    return ""


def drop_stale(index: Index, stale: dict[bytes, tuple[str, Entry]]) -> None:
    """Remove stale entries (each only while it still points where it was found) and log why they went."""
    if not stale:
        return
    places = {key: (entry.segment, entry.offset) for key, (_, entry) in stale.items()}
    index.submit(index.remove_op(list(stale), only_at=places)).result()
    reasons: dict[str, int] = {}
    for why, _ in stale.values():
        reasons[why] = reasons.get(why, 0) + 1
    log.warning("dropped %d index entries that do not match their record: %s", len(stale),
                ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())))


# -- rebuild ----------------------------------------------------------------------------------------

def rebuild_index(index: Index, segments: SegmentSet, only: set[bytes] | None = None, now_ms: int | None = None
                  ) -> tuple[list[tuple[bytes, Entry]], RebuildStats]:
    """Index every verifiable record whose key the index lacks (only the keys in `only`, when given).

    Segments are read newest first (ids grow with creation), so a key already indexed from a newer
    segment (or by the index before) is not looked at again; within a segment a later copy replaces an
    earlier one. Records are read front to back, so the kernel reads ahead. A record is indexed only once
    its key's identity (the chained hash of parent and tokens) and every payload checksum are verified.
    Each new entry takes from its header the traffic class, parent and tenant; its expiry is its
    segment's bucket end (no record in a segment was written to live longer) and its last access the
    segment file's modification time. Returns the entries added and what was found."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    names = _Names(index)
    stats = RebuildStats()
    added: list[tuple[bytes, Entry]] = []
    ordered = sorted(segments.segments.values(), key=lambda s: s.id, reverse=True)
    total_bytes = sum(s.size for s in ordered)
    started = last_report = time.monotonic()
    for segment in ordered:
        records = list(segments.scan(segment))
        stats.records += len(records)
        newest: dict[bytes, tuple[int, RecordHeader]] = {}
        for (offset, header), entry in zip(records, index.get_many([header.key for _, header in records])):
            if only is not None and header.key not in only:
                continue
            if entry is not None:
                stats.superseded += 1
            elif not _verified(segment, offset, header):
                stats.unverified += 1
            else:
                stats.superseded += header.key in newest
                newest[header.key] = (offset, header)
        access_ms = min(now_ms, int(os.fstat(segment.fd).st_mtime * 1000))
        entries = [(key, Entry(segment.id, offset, header.header_len, header.payload_len, segment.bucket_end * 1000,
                               access_ms, names.class_id(header.traffic_class), header.parent, 0,
                               names.tenant_id(header.tenant)))
                   for key, (offset, header) in newest.items()]
        for start in range(0, len(entries), _INSERT_BATCH):
            added += _insert(index, entries[start : start + _INSERT_BATCH])
        stats.segments += 1
        stats.bytes_scanned += segment.size
        if time.monotonic() - last_report >= PROGRESS_INTERVAL_S:
            last_report = time.monotonic()
            log.info("rebuilding the index: %d of %d segments, %.1f of %.1f GiB read, %d records indexed (%.0f s)",
                     stats.segments, len(ordered), stats.bytes_scanned / 2**30, total_bytes / 2**30, len(added),
                     last_report - started)
    stats.indexed = len(added)
    return added, stats


def _verified(segment: Segment, offset: int, header: RecordHeader) -> bool:
    try:
        header.check_identity()
        header.check_layers(SegmentSet.read(segment, offset + header.header_len, header.payload_len), 0)
    except (CorruptRecord, OSError):
        return False
    return True


def _insert(index: Index, items: list[tuple[bytes, Entry]]) -> list[tuple[bytes, Entry]]:
    """Add entries whose key has none yet, in one commit; returns those added."""
    if not items:
        return []

    def op(txn: Txn, db: Any) -> list[tuple[bytes, Entry]]:
        return [(key, entry) for key, entry in items if txn.put(key, entry.pack(), db=db, overwrite=False)]
    return index.submit(op).result()


class _Names:
    """Traffic class names and tenant digests -> the index's small ids, assigning new ones as met."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self.classes = index.classes()
        self.tenants = index.tenants()

    def class_id(self, name: str) -> int:
        if name not in self.classes:
            self.classes[name] = self.index.class_id(name)
        return self.classes[name]

    def tenant_id(self, tenant: bytes) -> int:
        if tenant == NO_TENANT:  # a format-1 record
            return 0
        if tenant not in self.tenants:
            self.tenants[tenant] = self.index.submit(self.index.tenant_id_op(tenant)).result()
        return self.tenants[tenant]

