"""Offline check (and rebuild) of a stopped daemon's data directory: do the index and the segments agree?

`check` (`kvstore fsck DATA_DIR`): the index must be a sound LMDB file (walked page by page without
handing it to LMDB, so damage is reported, never crashes the tool), and every entry must point at a
whole record in an existing segment whose header names the same key and whose payload matches its
checksums. Records that no entry points at are counted; they are a problem only when the index is
missing or new while the segments hold records, the case in which a daemon rebuilds at start-up.
The crash tests run it after every kill -9 and restart.

`rebuild` (`kvstore fsck --rebuild DATA_DIR`): what a daemon does at start-up with a lost or damaged
index (kvstore/server/recovery.py), offline: a damaged index is moved aside, entries that do not match
their record are dropped, and every verifiable record the index lacks is indexed.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from kvstore.record import CorruptRecord, decode_header
from kvstore.server.config import ServerConfig
from kvstore.server.frames import FRAME_BYTES, FrameKeyDamaged, FrameKeyMissing, Frames
from kvstore.server.index import Entry, Index, IndexDamaged, is_damage, structural_damage
from kvstore.server.recovery import (
    REBUILDING,
    RebuildStats,
    begin_rebuild,
    discard_unfinished,
    drop_stale,
    end_rebuild,
    rebuild_index,
    replace_damaged,
    set_aside,
    verify_entries,
)
from kvstore.server.segments import Segment, SegmentSet, scan, segment_files


@dataclass
class FsckReport:
    entries: int = 0
    verified: int = 0
    problems: list[str] = field(default_factory=list)
    segments: int = 0
    open_segments: int = 0
    segment_bytes: int = 0
    live_bytes: int = 0
    unindexed: int = 0  # whole records with a valid header whose key has no entry
    index_damage: str = ""  # why the index cannot be read, if it cannot
    index_used: bool = False  # a daemon has opened the index (it names its traffic classes in it)

    @property
    def ok(self) -> bool:
        return not self.problems


class DataDirBusy(Exception):
    """A daemon holds the data directory's lock."""


def check(data_dir: Path, verify_payloads: bool = True) -> FsckReport:
    data_dir = Path(data_dir)
    report = FsckReport()
    segments: dict[int, Path] = {}
    segments_dir = data_dir / "segments"
    for path, seg_id, _ in segment_files(segments_dir) if segments_dir.is_dir() else ():
        segments[seg_id] = path
        report.segments += 1
        report.open_segments += path.suffix == ".open"
        report.segment_bytes += path.stat().st_size
    try:
        frames = Frames.of_directory(segments_dir, may_create=False)
    except (FrameKeyMissing, FrameKeyDamaged) as exc:
        if segments:
            report.problems.append(f"{exc}: no record in the segments can be trusted")
            return report
        frames = None  # no segments: nothing to authenticate
    index_dir = data_dir / "index"
    advice = _REBUILD_ADVICE.format(data_dir=data_dir)
    try:
        report.index_damage = structural_damage(index_dir)
    except OSError as exc:
        report.problems.append(f"the index cannot be read ({exc})")
        return report
    if not report.index_damage:
        try:
            _check_index(index_dir, segments, frames, verify_payloads, report)
        except lmdb.Error as exc:
            if not is_damage(exc):
                raise
            report.index_damage = str(exc).removeprefix(f"{index_dir}: ")
    if report.index_damage:
        report.problems.append(f"the index is damaged ({report.index_damage}): {advice}")
    elif report.unindexed and not report.entries and not report.index_used:
        report.problems.append(f"the index is missing or new, but the segments hold {report.unindexed} records: "
                               f"{advice}")
    return report


_REBUILD_ADVICE = ("rebuild it from the segments with `kvstore fsck --rebuild {data_dir}` (a damaged index is moved "
                   "aside, never deleted), or start the daemon, which does the same")


def _check_index(index_dir: Path, segments: dict[int, Path], frames: Frames | None, verify_payloads: bool,
                 report: FsckReport) -> None:
    data = index_dir / "data.mdb"
    if not data.exists() or data.stat().st_size == 0:  # no index: LMDB would create a new one
        _check_unindexed(None, segments, frames, report)
        return
    env = lmdb.open(str(index_dir), readonly=True, lock=False, max_dbs=4)
    fds: dict[int, int] = {}
    try:
        report.index_used = _named_classes(env)
        if _rebuild_unfinished(env):
            report.problems.append("the index's last rebuild was cut short: it lacks records it must hold; "
                                   + _REBUILD_ADVICE.format(data_dir=index_dir.parent))
            return
        try:
            blocks = env.open_db(b"blocks", create=False)
        except lmdb.NotFoundError:  # created, never written
            _check_unindexed(None, segments, frames, report)
            return
        with env.begin(db=blocks) as txn:
            scanned = _check_unindexed(txn, segments, frames, report)
            for key, raw in txn.cursor():
                report.entries += 1
                entry = Entry.unpack(raw)
                problem = _check_entry(bytes(key), entry, segments, frames, fds, verify_payloads)
                if not problem and (entry.segment, entry.offset) not in scanned:
                    # whole and framed where the index says, yet a scan of its segment walks past it: the index
                    # is all that knows it, and a rebuild (a lost index, `kvstore fsck --rebuild`) would lose it
                    problem = f"a scan of segment {entry.segment} does not find its record at {entry.offset}"
                if problem:
                    report.problems.append(f"{bytes(key).hex()}: {problem}")
                else:
                    report.verified += 1
                    report.live_bytes += entry.record_len
    finally:
        env.close()
        for fd in fds.values():
            os.close(fd)


def _named_classes(env: lmdb.Environment) -> bool:
    """Whether a daemon has used the index: each names its traffic classes in it as it opens it."""
    return any(key.startswith(b"class:") for key in _meta(env))


def _rebuild_unfinished(env: lmdb.Environment) -> bool:
    return bool(_meta(env).get(REBUILDING))


def _meta(env: lmdb.Environment) -> dict[bytes, bytes]:
    """The index's meta entries (a few: traffic classes, tenants, marks); none where it has no meta table."""
    try:
        meta = env.open_db(b"meta", create=False)
    except lmdb.NotFoundError:
        return {}
    with env.begin(db=meta) as txn:
        return {bytes(key): bytes(value) for key, value in txn.cursor()}


def _check_unindexed(txn: lmdb.Transaction | None, segments: dict[int, Path], frames: Frames | None,
                     report: FsckReport) -> set[tuple[int, int]]:
    """Count the whole records behind a valid frame that no index entry points at; the (segment, offset) of
    every record a scan finds."""
    found = set()
    for seg_id, path in sorted(segments.items()):
        assert frames is not None, "segments are checked only with their frame key"
        fd = os.open(path, os.O_RDONLY)
        try:
            segment = Segment(seg_id, 0, path, fd, os.fstat(fd).st_size, sealed=True)
            for offset, header in scan(segment, frames):
                found.add((seg_id, offset))
                if txn is None or txn.get(header.key) is None:
                    report.unindexed += 1
        finally:
            os.close(fd)
    return found


def _check_entry(key: bytes, entry: Entry, segments: dict[int, Path], frames: Frames | None, fds: dict[int, int],
                 verify: bool) -> str:
    if entry.segment not in segments or frames is None:
        return f"segment {entry.segment} does not exist"
    if entry.segment not in fds:
        fds[entry.segment] = os.open(segments[entry.segment], os.O_RDONLY)
    fd = fds[entry.segment]
    if entry.offset + entry.record_len > os.fstat(fd).st_size or entry.offset < FRAME_BYTES:
        return f"record at {entry.offset}+{entry.record_len} runs past the end of segment {entry.segment}"
    try:
        raw = os.pread(fd, FRAME_BYTES + entry.header_len, entry.offset - FRAME_BYTES)
        header = decode_header(raw[FRAME_BYTES:])
        if header.key != key:
            return "the record there belongs to another key"
        if not frames.check_record(entry.segment, entry.offset - FRAME_BYTES, raw[:FRAME_BYTES], raw[FRAME_BYTES:],
                                   entry.record_len):
            return "no frame of the daemon's stands before the record: it was not written as a record"
        header.check_identity()
        if header.payload_len != entry.payload_len:
            return "payload length differs between index and header"
        if verify:
            header.check_layers(os.pread(fd, entry.payload_len, entry.offset + entry.header_len), 0)
    except CorruptRecord as exc:
        return str(exc)
    return ""


@dataclass
class RebuildResult:
    stats: RebuildStats
    dropped: int  # entries that did not match their record
    set_aside: Path | None  # where a damaged index was moved


def rebuild(data_dir: Path) -> RebuildResult:
    """Make a stopped daemon's index know every verifiable record in its segments (see the module doc).

    Raises DataDirBusy if a daemon holds the directory, IndexUnavailable if the index can be neither
    opened nor moved aside."""
    data_dir = Path(data_dir)
    lock_fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _locked(lock_fd):
            raise DataDirBusy(f"a kvstore-server is using {data_dir}; stop it first (a daemon rebuilds a missing "
                              "or damaged index by itself as it starts)")
        return _rebuild_locked(data_dir)
    finally:
        os.close(lock_fd)


def in_use(data_dir: Path) -> bool:
    """Whether a daemon holds the data directory now: its LOCK file is locked (kvstore/server/store.py keeps it
    so while it runs). Checked by taking the lock for an instant, as `rebuild` takes it for its whole run."""
    try:
        lock_fd = os.open(Path(data_dir) / "LOCK", os.O_RDONLY)
    except FileNotFoundError:  # no daemon has opened it
        return False
    try:
        return not _locked(lock_fd)
    finally:
        os.close(lock_fd)  # and with it the lock, if it was taken


def _locked(lock_fd: int) -> bool:
    """Take the data directory's lock on `lock_fd` without waiting; False where a daemon holds it."""
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _rebuild_locked(data_dir: Path) -> RebuildResult:
    defaults = ServerConfig()
    index_dir = data_dir / "index"
    sizes = (defaults.lmdb_map_bytes, defaults.lmdb_max_map_bytes, True)
    aside = None
    try:
        index = Index(index_dir, *sizes)
    except IndexDamaged as exc:
        aside = set_aside(index_dir, "damaged", exc)
        index = Index(index_dir, *sizes)
    if index.meta(REBUILDING):  # a rebuild cut short: its part holds nothing the segments do not
        index = discard_unfinished(index, index_dir, *sizes)
    segments = SegmentSet(data_dir / "segments", defaults.segment_bytes, fsync=True)
    try:
        segments.open_existing()
        begin_rebuild(index)  # cut short, the next start (or fsck) rebuilds whole rather than trust a part
        try:
            _, stale = verify_entries(index, segments, {})
        except IndexDamaged as exc:
            index, aside = replace_damaged(index, index_dir, *sizes, exc)
            stale = {}
        drop_stale(index, stale)
        _, stats = rebuild_index(index, segments)
        end_rebuild(index)
    finally:
        for segment in list(segments.segments.values()):
            os.close(segment.fd)
        index.close()
    return RebuildResult(stats, len(stale), aside)

