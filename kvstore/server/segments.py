"""Append-only segment files holding block records (3FS-style large chunk files).

Each segment holds records whose expiry falls in one time bucket, so that expiry is mostly a file
deletion. Appends to a segment are serialised and a failed append is truncated away, so a segment is
always a clean sequence of whole records, except for a torn tail after a crash, which start-up cuts off,
places whose record never came (set aside, then given up or cut off by a crash), and damage from outside (a
bad sector, a stray write), which a scan skips to the next valid frame. Every record is written behind a
frame only the daemon can make (frames.py): a scan takes a header for a record only behind one, never
because bytes a tenant sent look like a record.

File names say the state: `<id>-<bucket_end>.open` while appended to, `.sealed` once full (and synced,
with durability "fsync"). Only `.open` files are scanned after a crash: a daemon crash leaves sealed
files whole; a power failure under durability "os" may not, and then every read's checksums turn the
damage into misses.

Records of at least `direct_min_bytes` are appended with O_DIRECT: each starts at a 4 KiB boundary and
is padded with zeros to the next one, and its bytes go through a reused, page-aligned staging buffer of the
I/O thread straight to the device. A buffered append would wait for fresh page-cache pages, which on VMs
that back guest memory lazily cost more than the device does (docs/performance.md). Smaller records are
buffered, at the segment's end; a scan skips the zeros before an aligned record. A file system that
refuses O_DIRECT (or its alignment) gets buffered appends from then on.

Thread-safety: `append`, `sync`, `read` run on I/O threads; `acquire`/`release`/`delete` and the
bookkeeping run on the event loop thread. A reader holds a reference, so deleting a segment that is
being read unlinks it at once and closes its descriptor when the last reader is done.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore import faults
from kvstore.record import FIXED_HEADER_BYTES, CorruptRecord, RecordBytes, RecordHeader, decode_header
from kvstore.server.frames import FRAME_BYTES, Frames, Kind, parse_frame
from kvstore.server.frames import MAGIC as FRAME_MAGIC

_RESYNC_CHUNK = 1 << 20  # bytes read at a time looking for the next record past a damaged one
ALIGN = 4096  # O_DIRECT's alignment of file offsets, lengths and memory (512-byte devices included)
STAGING_BYTES = 8 * 2**20  # each I/O thread's direct-append buffer: a record goes through it in steps
# Reads at least this large of bytes the page cache does not hold go to the device with O_DIRECT: one 4 KiB
# page of a header is cheaper through the page cache, and small reads waste the device's request size.
DIRECT_READ_MIN_BYTES = 64 * 1024
VERIFY_PIECE_BYTES = 256 * 1024  # verified while still in the CPU's cache
_direct_open_lock = threading.Lock()
_RESIDENCY_MAP_BYTES = 256 * 2**20  # the least a segment's residency mapping covers (a segment's usual size)
_bounce = threading.local()  # .buffer: the I/O thread's aligned buffer for direct reads it cannot place

log = logging.getLogger(__name__)


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(eq=False)
class Segment:
    id: int
    bucket_end: int  # epoch seconds; the records' expiry (as written) is at most this
    path: Path
    fd: int
    size: int
    sealed: bool
    live_bytes: int = 0  # bytes of records the index points at
    direct_fd: int | None = None  # the same file opened with O_DIRECT, while it is appended to
    direct_reads: bool = False  # large reads of what the page cache lacks go to the device with O_DIRECT
    read_direct_fd: int | None = None  # opened on the first such read; closed with `fd`
    residency_map: tuple[int, int] | None = None  # (address, length): mapped to ask the page cache what it holds
    replaced_maps: list[tuple[int, int]] = field(default_factory=list)  # smaller ones, unmapped at close
    readers: int = 0
    writers: int = 0  # records placed in it (`place`) whose bytes are still being written
    given_up: list[tuple[int, int]] = field(default_factory=list)  # [begin, end) of places given up, to reuse
    hole_bytes: int = 0  # their bytes: holes, which hold nothing (not garbage, not disk bytes)
    deleted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def used_bytes(self) -> int:
        """Bytes of records, live or dead: the size less the holes of places given up."""
        return self.size - self.hole_bytes

    @property
    def garbage_ratio(self) -> float:
        return 1.0 - self.live_bytes / self.used_bytes if self.used_bytes else 0.0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a record written while it arrives goes: its payload starts at a 4 KiB boundary, so each page
    of it can be written with O_DIRECT straight from the page-aligned buffer it arrives in, and its header
    ends there, in pages of its own, written last: until then the place holds no record."""

    segment: Segment
    start: int  # where the place begins: the segment's end when it was taken, before the zeros that align it
    offset: int  # the record's first byte (its header); its frame is just before it
    payload_offset: int  # aligned
    payload_len: int
    end: int  # aligned: the payload's last page, padded with zeros

    @property
    def frame_offset(self) -> int:
        return self.offset - FRAME_BYTES

    @property
    def header_pages(self) -> int:
        """Where the pages holding the frame and the header begin (the zeros before them are part of them)."""
        return self.payload_offset - align_up(self.payload_offset - self.frame_offset)


class SegmentSet:
    def __init__(self, directory: Path, segment_bytes: int, fsync: bool, direct_min_bytes: int = 0) -> None:
        """Raises frames.FrameKeyMissing where segments exist without the key of their frames."""
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.frames = Frames.of_directory(self.directory, may_create=not any(segment_files(self.directory)))
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.direct_min_bytes = direct_min_bytes  # 0: buffered appends only
        self._staging = threading.local()  # .buffer: the I/O thread's direct-append buffer
        self.segments: dict[int, Segment] = {}
        self._active: dict[int, Segment] = {}  # bucket_end -> the open segment appended to
        self._next_id = 1
        self._lock = threading.Lock()  # guards choosing and creating active segments

    # -- start-up -------------------------------------------------------------------------------

    def open_existing(self) -> list[Segment]:
        """Open every segment file; returns the ones left `.open` by the last run (to be scanned)."""
        unfinished = []
        for path, seg_id, bucket_end in segment_files(self.directory):
            fd = os.open(path, os.O_RDWR)
            segment = Segment(seg_id, bucket_end, path, fd, os.fstat(fd).st_size, sealed=True,
                              direct_reads=self.direct_min_bytes > 0)
            self.segments[seg_id] = segment
            self._next_id = max(self._next_id, seg_id + 1)
            if path.suffix == ".open":
                unfinished.append(segment)
        return unfinished

    def recover(self, segment: Segment) -> list[tuple[int, RecordHeader]]:
        """Cut a crashed segment back to its last whole record, seal it, and list its records."""
        records = list(self.scan(segment))
        end = records[-1][0] + records[-1][1].record_len if records else 0
        if end < segment.size:
            # what a crash left past the last whole record: a torn one, or places whose record never came
            log.info("cut segment %d back from %d to %d bytes after its %d whole records", segment.id, segment.size,
                     end, len(records))
            os.ftruncate(segment.fd, end)
            segment.size = end
        os.fsync(segment.fd)
        self._rename(segment, ".sealed")
        return records

    def scan(self, segment: Segment) -> Iterator[tuple[int, RecordHeader]]:
        """(offset, header) of each whole record behind a valid frame, in order (`scan`)."""
        return scan(segment, self.frames)

    # -- appends (I/O threads) ----------------------------------------------------------------

    def append(self, bucket_end: int, header: RecordBytes, payload: Sequence[RecordBytes]) -> tuple[Segment, int]:
        """Write one record, behind its frame, at the end of the open segment of `bucket_end`; returns where its
        header went."""
        record_len = len(header) + sum(len(p) for p in payload)
        nbytes = FRAME_BYTES + record_len
        direct = 0 < self.direct_min_bytes <= record_len
        while True:
            segment = self._writable(bucket_end, align_up(nbytes) + ALIGN if direct else nbytes)
            with segment.lock:
                if segment.sealed or segment.deleted:
                    continue  # sealed by another writer meanwhile
                start = segment.size
                direct_fd = segment.direct_fd if direct else None
                offset = align_up(start) if direct_fd is not None else start
                try:
                    faults.hit("segment.before_write")
                    frame = self.frames.record(segment.id, offset, header, record_len)
                    end = (self._write_direct(direct_fd, [frame, header, *payload], offset)
                           if direct_fd is not None else None)
                    if end is None:  # buffered, or O_DIRECT refused just now
                        if offset != start:
                            offset = start
                            frame = self.frames.record(segment.id, offset, header, record_len)
                        _write_all(segment.fd, [frame, header, *payload], offset)
                        end = offset + nbytes
                    faults.hit("segment.after_write")
                except OSError:
                    # Keep the file a clean sequence of records: drop what was written, stop appending.
                    try:
                        os.ftruncate(segment.fd, start)
                    finally:
                        self._seal_locked(segment, sync=False)
                    raise
                segment.size = end
                if segment.size >= self.segment_bytes:
                    self._seal_locked(segment, sync=self.fsync)
                return segment, offset + FRAME_BYTES

    def place(self, bucket_end: int, header_len: int, payload_len: int) -> Placement | None:
        """Set aside the place of a record whose payload is written in pieces as it arrives (`write_payload`,
        then `write_header`, then `finish`); None where appends are not direct (then `append` it whole).

        Only the placing holds the segment's lock: writers into different places never wait for one another,
        so a slow client holds up no one. A segment that fills is sealed at once; its O_DIRECT descriptor
        stays open until its last placed record is finished. A place given up earlier in the open segment is
        taken again where the record fits in it, before the segment grows (`finish`).

        The place's reservation frame goes to disk with its first payload bytes, in the same write
        (`write_payload`): from then on, whatever the payload holds, a scan after a crash skips the whole
        place; before it, the place holds nothing."""
        if not 0 < self.direct_min_bytes <= header_len + payload_len:
            return None
        header_pages, payload_pages = align_up(FRAME_BYTES + header_len), align_up(payload_len)
        placement = self._place_in_given_up(bucket_end, header_pages, header_len, payload_len)
        while placement is None:
            segment = self._writable(bucket_end, header_pages + payload_pages + ALIGN)
            with segment.lock:
                if segment.sealed or segment.deleted:
                    continue  # sealed by another writer meanwhile
                if segment.direct_fd is None:
                    return None
                placement = _placement(segment, segment.size, header_pages, header_len, payload_len)
                segment.size = placement.end
                segment.writers += 1  # first: sealing keeps the direct descriptor open for it
                try:
                    if segment.size >= self.segment_bytes:
                        self._seal_locked(segment, sync=self.fsync)
                except BaseException:
                    segment.writers -= 1
                    raise
        return placement

    def _place_in_given_up(self, bucket_end: int, header_pages: int, header_len: int,
                           payload_len: int) -> Placement | None:
        """A place in the first extent given up in the open segment of `bucket_end` that holds the record."""
        needed = header_pages + align_up(payload_len)
        with self._lock:
            segment = self._active.get(bucket_end)
        if segment is None:
            return None
        with segment.lock:
            if segment.sealed or segment.deleted or segment.direct_fd is None:
                return None
            for i, (begin, end) in enumerate(segment.given_up):
                if end - align_up(begin) >= needed:
                    placement = _placement(segment, begin, header_pages, header_len, payload_len)
                    segment.given_up[i : i + 1] = [(placement.end, end)] if end > placement.end else []
                    segment.hole_bytes -= placement.end - begin
                    segment.writers += 1
                    return placement
        return None

    def write_payload(self, placement: Placement, start: int, view: memoryview, last: bool) -> None:
        """Write payload bytes [start, start + len(view)) of a placed record; `start` is a multiple of 4 KiB,
        and so is len(view) unless `last` (the payload's end, padded with zeros)."""
        faults.hit("segment.before_write")
        direct_fd = _placed_fd(placement)
        whole = len(view) - len(view) % ALIGN
        offset = placement.payload_offset + start
        ahead: list[RecordBytes] = []
        if start == 0:  # the place's reservation, in the same write as the first payload bytes (no extra I/O)
            ahead = [self._header_pages(placement, self.frames.reserved(
                placement.segment.id, placement.frame_offset, placement.end - placement.frame_offset),
                bytes(placement.payload_offset - placement.offset))]
            offset = placement.header_pages
        if whole and _address(view) % ALIGN == 0:
            _write_all(direct_fd, [*ahead, view[:whole]], offset)
            view, offset, ahead = view[whole:], offset + sum(map(len, ahead)) + whole, []
        if len(view) or ahead:
            assert last or len(view) % ALIGN == 0
            self._write_direct(direct_fd, [*ahead, view], offset, refuse=True)

    def write_header(self, placement: Placement, header: bytes) -> None:
        """Write the header and its frame over the place's reservation, after the whole payload: from now on the
        place holds a record."""
        faults.hit("segment.payload_written")
        record_len = len(header) + placement.payload_len
        self._write_header_pages(placement, self.frames.record(placement.segment.id, placement.frame_offset, header,
                                                               record_len), header)
        faults.hit("segment.after_write")

    def _write_header_pages(self, placement: Placement, frame: bytes, header: bytes) -> None:
        _write_all(_placed_fd(placement), [self._header_pages(placement, frame, header)], placement.header_pages)

    @staticmethod
    def _header_pages(placement: Placement, frame: bytes, header: bytes) -> mmap.mmap:
        """The pages before a placed record's payload, in page-aligned memory: zeros, `frame`, `header`."""
        pages = mmap.mmap(-1, placement.payload_offset - placement.header_pages)
        pages[len(pages) - len(frame) - len(header) :] = frame + header
        return pages

    def finish(self, placement: Placement, failed: bool = False, given_up: bool = False) -> None:
        """The placed record is written (or given up: then the segment takes no more records if `failed`, as
        after a failed append). Its segment's direct descriptor closes with the last writer of a sealed segment.

        A place `given_up` (erased first) is a hole, not a record: the segment is cut back where it ends the
        segment, else the extent is kept for the next place it fits (`place`). Either way it is counted
        in neither the disk's bytes nor the segment's garbage, so places a client abandons, one after another,
        never fill a disk or make compaction rewrite the records around them."""
        segment = placement.segment
        with segment.lock:
            segment.writers -= 1
            if given_up and not segment.deleted:
                self._release_locked(segment, placement.start, placement.end)
            if failed:
                self._seal_locked(segment, sync=False)
            if segment.sealed and segment.writers == 0:
                _close_direct(segment)

    @staticmethod
    def _release_locked(segment: Segment, begin: int, end: int) -> None:
        segment.given_up.append((begin, end))
        segment.given_up.sort()
        segment.hole_bytes += end - begin
        while segment.given_up and segment.given_up[-1][1] == segment.size:  # holes that end the file: cut off
            begin, end = segment.given_up.pop()
            segment.hole_bytes -= end - begin
            segment.size = begin
            os.ftruncate(segment.fd, begin)

    def erase(self, placement: Placement, written: int) -> bool:
        """Overwrite with zeros the header pages (its frame) and the first `written` payload bytes of a record
        that is not to be one (given up, or not indexed: a second copy of a key), so that its place holds
        nothing a later record placed there could be mistaken for. Best effort: whether it was erased (a place
        not erased keeps its reservation, and is never placed again)."""
        end = placement.payload_offset + align_up(written)
        zeros = bytes(min(end - placement.header_pages, STAGING_BYTES))
        try:
            for start in range(placement.header_pages, end, len(zeros)):
                self._write_direct(_placed_fd(placement), [zeros[: end - start]], start, refuse=True)
        except OSError as exc:
            log.warning("could not erase a record given up in segment %d: %s", placement.segment.id, exc)
            return False
        return True

    def _write_direct(self, direct_fd: int, parts: Sequence[RecordBytes], offset: int,
                      refuse: bool = False) -> int | None:
        """Write the record at the aligned `offset` of a segment opened with O_DIRECT (`direct_fd`), padded
        with zeros to ALIGN; its padded end, or None if the file system refuses O_DIRECT's alignment (then
        appends are buffered)."""
        staging = getattr(self._staging, "buffer", None)
        if staging is None:
            staging = self._staging.buffer = mmap.mmap(-1, STAGING_BYTES)
        filled = 0
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while len(view):
                    take = min(len(view), STAGING_BYTES - filled)
                    staging[filled : filled + take] = view[:take]
                    filled, view = filled + take, view[take:]
                    if filled == STAGING_BYTES:
                        _write_all(direct_fd, [memoryview(staging)], offset)
                        offset, filled = offset + filled, 0
            if filled:
                padded = align_up(filled)
                staging[filled:padded] = bytes(padded - filled)
                _write_all(direct_fd, [memoryview(staging)[:padded]], offset)
                offset += padded
        except OSError as exc:
            if exc.errno != errno.EINVAL or refuse:
                raise
            log.warning("the file system of %s refuses O_DIRECT appends (%s); appending buffered from now on",
                        self.directory, exc)
            self.direct_min_bytes = 0
            return None
        return offset

    def _writable(self, bucket_end: int, nbytes: int) -> Segment:
        with self._lock:
            segment = self._active.get(bucket_end)
            if segment is not None and not segment.sealed and segment.size + nbytes <= self.segment_bytes:
                return segment
            if segment is not None and not segment.sealed and segment.size == 0:
                return segment  # a record larger than a segment gets a segment of its own
            if segment is not None and not segment.sealed:
                with segment.lock:
                    self._seal_locked(segment, sync=self.fsync)
            seg_id = self._next_id
            self._next_id += 1
            path = self.directory / f"{seg_id:010d}-{bucket_end}.open"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # other tenants' KV: no one else's
            direct_fd = self._open_direct(path)
            segment = Segment(seg_id, bucket_end, path, fd, 0, sealed=False, direct_fd=direct_fd,
                              direct_reads=direct_fd is not None)
            self.segments[seg_id] = segment
            self._active[bucket_end] = segment
            return segment

    def _open_direct(self, path: Path) -> int | None:
        if not self.direct_min_bytes:
            return None
        try:
            return os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError as exc:  # tmpfs on older kernels, some network file systems
            log.warning("the file system of %s refuses O_DIRECT (%s); appending buffered", self.directory, exc)
            self.direct_min_bytes = 0
            return None

    def seal(self, segment: Segment) -> None:
        with segment.lock:
            self._seal_locked(segment, sync=self.fsync)

    def _seal_locked(self, segment: Segment, sync: bool) -> None:
        if segment.sealed:
            return
        segment.sealed = True
        if not segment.writers:  # else the last placed record's `finish` closes it
            _close_direct(segment)
        if self._active.get(segment.bucket_end) is segment:
            del self._active[segment.bucket_end]
        if sync:
            os.fsync(segment.fd)
        if not segment.deleted:
            self._rename(segment, ".sealed")

    def _rename(self, segment: Segment, suffix: str) -> None:
        target = segment.path.with_suffix(suffix)
        if target != segment.path:
            os.rename(segment.path, target)
            segment.path = target

    def sync(self, segments: Sequence[Segment]) -> None:
        for segment in segments:
            if not segment.deleted:
                os.fdatasync(segment.fd)

    # -- reads ------------------------------------------------------------------------------------

    def acquire(self, seg_id: int) -> Segment | None:
        segment = self.segments.get(seg_id)
        if segment is None or segment.deleted:
            return None
        segment.readers += 1
        return segment

    def release(self, segment: Segment) -> None:
        segment.readers -= 1
        if segment.deleted and segment.readers == 0:
            _close_files(segment)

    @staticmethod
    def read_into(segment: Segment, offset: int, view: memoryview,
                  verify: Callable[[int, memoryview], None] | None = None,
                  piece_bytes: int = VERIFY_PIECE_BYTES) -> None:
        """Fill `view` from `offset`; a file that ends first holds a truncated record. `verify(start, piece)`
        sees each piece of `piece_bytes` (the last may be shorter) just after it lands, while it is still
        in the CPU's cache.

        What the page cache holds is copied from it. A large read of what it does not hold goes to the
        device with O_DIRECT (where the segment allows it): a buffered read would first take fresh
        page-cache pages, which on these VMs cost more than the device (docs/performance.md)."""
        faults.hit("segment.read")
        length = len(view)
        done = 0
        resident = 0  # the page cache was found to hold the bytes up to here
        while done < length:
            end = length
            if segment.direct_reads and length - done >= DIRECT_READ_MIN_BYTES:
                if done >= resident:
                    resident = done + _resident_bytes(segment, offset + done, length - done)
                    if resident == done:  # not in the page cache: the rest from the device, in one request
                        _read_direct(segment, offset + done, view[done:], verify, done, piece_bytes)
                        return
                end = resident
            if verify is not None:  # whole pieces: a piece partly cached is read through the page cache
                end = min(length, done + piece_bytes)
            piece = view[done:end]
            received = os.preadv(segment.fd, [piece], offset + done)
            if received == 0:
                raise CorruptRecord("truncated", f"segment {segment.id} ends before offset {offset + done}")
            if verify is not None:
                if received < len(piece):
                    _fill(segment, offset + done + received, piece[received:])
                    received = len(piece)
                verify(done, piece)
            done += received

    @staticmethod
    def read(segment: Segment, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        SegmentSet.read_into(segment, offset, memoryview(buffer))
        return bytes(buffer)

    # -- removal and accounting ---------------------------------------------------------------

    def delete(self, segment: Segment) -> None:
        with segment.lock:
            segment.sealed = True
            segment.deleted = True
            if not segment.writers:
                _close_direct(segment)
            if self._active.get(segment.bucket_end) is segment:
                del self._active[segment.bucket_end]
        self.segments.pop(segment.id, None)
        os.unlink(segment.path)
        if segment.readers == 0:
            _close_files(segment)

    @property
    def disk_bytes(self) -> int:
        """Bytes the segments hold: the holes of places given up are sparse, and taken again or cut off."""
        return sum(s.used_bytes for s in self.segments.values())

    def close(self) -> None:
        for segment in list(self.segments.values()):
            if not segment.sealed:
                self.seal(segment)
            if not segment.deleted:
                _close_files(segment)
                segment.deleted = True
        self.segments.clear()


def _placement(segment: Segment, start: int, header_pages: int, header_len: int, payload_len: int) -> Placement:
    """The place of a record from `start`: from the next page, its frame and header end where its payload's page
    starts."""
    payload_offset = align_up(start) + header_pages
    return Placement(segment, start, payload_offset - header_len, payload_offset, payload_len,
                     payload_offset + align_up(payload_len))


def segment_files(directory: Path) -> Iterator[tuple[Path, int, int]]:
    """(path, id, bucket end) of each segment file in `directory`, in name order (the ids' order)."""
    for path in sorted(directory.iterdir()):
        if path.suffix not in (".open", ".sealed"):
            continue
        try:
            seg_id, bucket_end = (int(part) for part in path.stem.split("-"))
        except ValueError:
            continue
        yield path, seg_id, bucket_end


def scan(segment: Segment, frames: Frames) -> Iterator[tuple[int, RecordHeader]]:
    """(offset, header) of each whole record behind a valid frame (frames.py), in order.

    A place reserved for a record that never came is skipped whole. A stretch without a valid frame (a torn
    record at the end, damage, a place whose reservation a power failure lost) is searched for the next valid
    frame, so one bad record never hides the whole records after it; bytes that arrived as a payload are never
    a record, whatever they hold, for they cannot hold a valid frame."""
    offset = 0
    while offset + FRAME_BYTES <= segment.size:
        found = _frame_at(segment, frames, offset)
        if found is None and offset % ALIGN:  # the zeros before an aligned (direct) record
            aligned = align_up(offset)
            found = _frame_at(segment, frames, aligned)
            if found is not None:
                offset = aligned
        if found is None:
            offset = _next_magic(segment, offset + 1)
            continue
        header, length = found
        if header is not None:
            yield offset + FRAME_BYTES, header
        offset += length


def _frame_at(segment: Segment, frames: Frames, offset: int) -> tuple[RecordHeader | None, int] | None:
    """At a valid frame: (the record's verified header, or None for a reserved place; the bytes it spans from
    the frame on). None where `offset` holds no valid frame, or the frame's record runs past the end."""
    head = os.pread(segment.fd, FRAME_BYTES + FIXED_HEADER_BYTES, offset)
    parsed = parse_frame(head)
    if parsed is None:
        return None
    kind, length = parsed
    if kind == Kind.RESERVED:
        reserved = frames.check_reserved(segment.id, offset, head[:FRAME_BYTES])
        return None if reserved is None else (None, reserved)
    header_len = int.from_bytes(head[FRAME_BYTES + 8 : FRAME_BYTES + 12], "little")
    if offset + FRAME_BYTES + length > segment.size or not FIXED_HEADER_BYTES <= header_len <= length:
        return None
    header_bytes = os.pread(segment.fd, header_len, offset + FRAME_BYTES)
    try:
        header = decode_header(header_bytes)
    except CorruptRecord:
        return None
    if header.record_len != length or not frames.check_record(segment.id, offset, head[:FRAME_BYTES],
                                                                        header_bytes, length):
        return None
    return header, FRAME_BYTES + length


def _next_magic(segment: Segment, offset: int) -> int:
    """Where the next frame magic lies at or after `offset` (the segment's size if nowhere).

    The first look is short: a record written as it arrived starts after the zeros that pad its frame and
    header to whole pages, within a page or two."""
    overlap = len(FRAME_MAGIC) - 1
    step = 2 * ALIGN
    while offset + FRAME_BYTES <= segment.size:
        chunk = os.pread(segment.fd, step, offset)
        found = chunk.find(FRAME_MAGIC)
        if found >= 0:
            return offset + found
        if len(chunk) < step:
            break
        offset += len(chunk) - overlap
        step = _RESYNC_CHUNK
    return segment.size


def _placed_fd(placement: Placement) -> int:
    """The O_DIRECT descriptor a placed record is written through: kept open while it has writers."""
    assert placement.segment.direct_fd is not None, "a placed record's segment keeps its direct descriptor"
    return placement.segment.direct_fd


def _close_files(segment: Segment) -> None:
    """Close the descriptors a segment is read through (its last reader is done, or it was never read)."""
    os.close(segment.fd)
    with _direct_open_lock:
        if segment.read_direct_fd is not None:
            os.close(segment.read_direct_fd)
            segment.read_direct_fd = None
        for mapped in [*segment.replaced_maps, *([segment.residency_map] if segment.residency_map else [])]:
            _libc.munmap(*mapped)
        segment.residency_map = None
        segment.replaced_maps.clear()
        segment.direct_reads = False


def _close_direct(segment: Segment) -> None:
    if segment.direct_fd is not None:
        os.close(segment.direct_fd)
        segment.direct_fd = None


def _write_all(fd: int, parts: Sequence[RecordBytes], offset: int) -> None:
    """pwritev until everything is written; a full disk first writes short, then raises ENOSPC."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        written = os.pwritev(fd, views, offset)
        if written == 0:
            raise OSError(errno.ENOSPC, "no progress writing a segment")
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def _resident_bytes(segment: Segment, offset: int, length: int) -> int:
    """How many of the `length` bytes from `offset` the page cache holds in one run from the start.

    Asked with mincore over a mapping of the segment file, which reads nothing: a read that may not wait
    (RWF_NOWAIT) would answer too, but it starts readahead into fresh pages when it misses. The mapping is
    made once per segment (address space only) and covers what the segment may grow to."""
    begin = offset - offset % ALIGN
    span = align_up(offset + length) - begin
    mapped = _residency_map(segment, begin + span)
    if mapped is None:
        return length  # cannot tell: read through the page cache, as before
    pages = ctypes.create_string_buffer(span // ALIGN)
    if _libc.mincore(mapped + begin, span, pages) != 0:
        return length
    run = next((page for page, held in enumerate(pages.raw) if not held & 1), span // ALIGN)
    return max(0, min(length, begin + run * ALIGN - offset))


def _residency_map(segment: Segment, needed: int) -> int | None:
    """The address of a read-only mapping of at least `needed` bytes of the segment file, or None."""
    with _direct_open_lock:
        if segment.residency_map is not None and segment.residency_map[1] >= needed:
            return segment.residency_map[0]
        length = align_up(max(needed, segment.size, _RESIDENCY_MAP_BYTES))
        address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, segment.fd, 0)
        if address in (None, _MAP_FAILED):
            return None
        if segment.residency_map is not None:  # a record past its end: a larger one replaces it, and the old
            segment.replaced_maps.append(segment.residency_map)  # stays until the segment closes (in use)
        segment.residency_map = (address, length)
        return address


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _fill(segment: Segment, offset: int, view: memoryview) -> None:
    """Fill `view` from `offset` with plain reads; CorruptRecord if the file ends first."""
    while len(view):
        received = os.preadv(segment.fd, [view], offset)
        if received == 0:
            raise CorruptRecord("truncated", f"segment {segment.id} ends before offset {offset}")
        view, offset = view[received:], offset + received


def _read_direct(segment: Segment, offset: int, view: memoryview,
                 verify: Callable[[int, memoryview], None] | None, verified_from: int, piece_bytes: int) -> None:
    """Fill `view` from `offset` with O_DIRECT: straight into `view` where its memory lines up with the
    file's 4 KiB pages, else through the thread's aligned bounce buffer, whose pieces are copied out (and
    verified) while in the CPU's cache. A file system that refuses turns direct reads off for the segment."""
    with _direct_open_lock:  # I/O threads read a segment at once: one descriptor for all of them
        direct_fd = segment.read_direct_fd
        if direct_fd is None:
            try:  # through the open descriptor: the same file even once renamed (sealed) or unlinked
                direct_fd = os.open(f"/proc/self/fd/{segment.fd}", os.O_RDONLY | os.O_DIRECT)
            except OSError:  # a file system that refuses O_DIRECT
                segment.direct_reads = False
            else:
                segment.read_direct_fd = direct_fd
    if direct_fd is None:
        _fill(segment, offset, view)
        _verify_all(view, verify, verified_from, piece_bytes)
        return
    begin, end = offset - offset % ALIGN, align_up(offset + len(view))
    lead = offset - begin
    try:
        if lead == 0 and _address(view) % ALIGN == 0 and len(view) % ALIGN == 0:
            _read_aligned(segment, direct_fd, view, begin, len(view))
            _verify_all(view, verify, verified_from, piece_bytes)
            return
        bounce = _bounce_buffer(min(end - begin, max(2 * STAGING_BYTES, piece_bytes + ALIGN)))
        done = 0
        while done < len(view):
            at = begin + (lead + done) // ALIGN * ALIGN  # the page holding the next byte wanted
            skip = offset + done - at
            take = min(len(view) - done, len(bounce) - skip)
            if take < len(view) - done:  # whole pieces, so that each one verified is whole
                take -= take % piece_bytes
            _read_aligned(segment, direct_fd, memoryview(bounce)[: align_up(skip + take)], at, skip + take)
            for start in range(0, take, piece_bytes):
                piece = view[done + start : done + min(take, start + piece_bytes)]
                piece[:] = memoryview(bounce)[skip + start : skip + start + len(piece)]
                if verify is not None:
                    verify(verified_from + done + start, piece)
            done += take
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        log.warning("the file system of %s refuses O_DIRECT reads (%s); reading through the page cache",
                    segment.path.parent, exc)
        segment.direct_reads = False
        _fill(segment, offset, view)
        _verify_all(view, verify, verified_from, piece_bytes)


def _read_aligned(segment: Segment, direct_fd: int, view: memoryview, offset: int, needed: int) -> None:
    """An O_DIRECT read of the aligned `view` at the aligned `offset`; at least `needed` bytes must exist."""
    got = 0
    while got < needed:
        received = os.preadv(direct_fd, [view[got:]], offset + got)
        if received == 0:
            raise CorruptRecord("truncated", f"segment {segment.id} ends before offset {offset + got}")
        got += received
        if got % ALIGN:  # the end of the file: nothing more to read past it
            if got < needed:
                raise CorruptRecord("truncated", f"segment {segment.id} ends before offset {offset + needed}")
            return


def _verify_all(view: memoryview, verify: Callable[[int, memoryview], None] | None, verified_from: int,
                piece_bytes: int) -> None:
    if verify is not None:
        for start in range(0, len(view), piece_bytes):
            verify(verified_from + start, view[start : start + piece_bytes])


def _bounce_buffer(nbytes: int) -> mmap.mmap:
    """The I/O thread's page-aligned bounce buffer, at least `nbytes` (grown, never shrunk)."""
    buffer = getattr(_bounce, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _bounce.buffer = mmap.mmap(-1, align_up(max(nbytes, STAGING_BYTES)))
    return buffer


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0
