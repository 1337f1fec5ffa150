"""Record frames: what tells, in a segment file, a record the daemon wrote from bytes a tenant sent.

A record is the client's header and payload, stored as they came, so its bytes are the tenant's to choose: a
payload may hold copies of whole, well-formed records of any tenant. Whatever scans a segment without an index
to guide it (crash recovery, an index rebuild, `kvstore fsck`, compaction) must therefore never take a header
it finds for a record because it checksums: it takes one only behind a frame the daemon wrote.

    frame = magic "KVF1" | kind (u8) | 0 (u8) | 0 (u16) | length (u64) | tag (16 bytes)       32 bytes

* kind RECORD: the record's header follows at once, and `length` is the record's (header and payload).
* kind RESERVED: a place set aside for a record written as it arrives (`SegmentSet.place`), `length` bytes from
  the frame on. It goes to disk in the same write as the place's first payload bytes, ahead of them, and the
  record's own frame replaces it last; so after a process crash an unfinished place is skipped whole, and its
  payload is never looked into.
* tag = keyed BLAKE2b-128 of (segment id, the frame's offset, kind, length, and for a record its whole header:
  the header commits to every layer's checksum). The key is made at a data directory's first start
  (`segments/frame.key`, 0600), never leaves the daemon and is never sent, so no tenant can compute a tag;
  and the tag binds a frame to its place, so no frame is valid anywhere else, even a copy of a real one.

A scan that meets bytes that are not a valid frame (a place whose reservation a power failure lost, damage from
outside) looks for the next frame magic and checks its tag: a tenant can write the magic, never the tag. The
frame sits in front of the header, so index entries, reads and the wire still address the record as before.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
from enum import IntEnum
from pathlib import Path

from kvstore.record import RecordBytes

MAGIC = b"KVF1"
FRAME = struct.Struct("<4sBBHQ16s")
FRAME_BYTES = FRAME.size  # 32
KEY_FILE = "frame.key"
KEY_BYTES = 32
TAG_BYTES = 16
_PERSON = b"kvstore-frame-v1"  # BLAKE2b's personalisation: the same key tags nothing else


class Kind(IntEnum):
    RECORD = 1
    RESERVED = 2


class FrameKeyMissing(RuntimeError):
    """Segments exist but the key that authenticates their frames does not: nothing in them can be trusted."""


class FrameKeyDamaged(RuntimeError):
    pass


class Frames:
    """Makes and checks the frames of one data directory's segments (the key is its own)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a frame key is {KEY_BYTES} bytes, got {len(key)}")
        self._key = key

    @classmethod
    def of_directory(cls, segments_dir: Path, may_create: bool) -> Frames:
        """The frame key of a segment directory; made now if the directory holds no key and `may_create` (it
        holds no segments yet). Raises FrameKeyMissing, FrameKeyDamaged."""
        path = Path(segments_dir) / KEY_FILE
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            if not may_create:
                raise FrameKeyMissing(f"{path} is missing: its segments' records cannot be authenticated") from None
            return cls(_make_key(path))
        if len(key) != KEY_BYTES:
            raise FrameKeyDamaged(f"{path} is damaged ({len(key)} bytes, expected {KEY_BYTES}); restore it from a "
                                  "backup of the data directory, or move the segments aside and start empty")
        return cls(key)

    def _tag(self, segment_id: int, offset: int, kind: Kind, length: int, header: RecordBytes) -> bytes:
        mac = hashlib.blake2b(key=self._key, digest_size=TAG_BYTES, person=_PERSON)
        mac.update(struct.pack("<QQBQ", segment_id, offset, kind, length))
        mac.update(header)
        return mac.digest()

    def record(self, segment_id: int, offset: int, header: RecordBytes, record_len: int) -> bytes:
        """The frame at `offset` of a record whose `header` follows it."""
        return FRAME.pack(MAGIC, Kind.RECORD, 0, 0, record_len,
                          self._tag(segment_id, offset, Kind.RECORD, record_len, header))

    def reserved(self, segment_id: int, offset: int, length: int) -> bytes:
        """The frame at `offset` of a place of `length` bytes (from the frame on) whose record is being written."""
        return FRAME.pack(MAGIC, Kind.RESERVED, 0, 0, length, self._tag(segment_id, offset, Kind.RESERVED, length, b""))

    def check_record(self, segment_id: int, offset: int, frame: bytes | memoryview, header: bytes | memoryview,
                     record_len: int) -> bool:
        """Whether `frame`, read at `offset`, is the daemon's frame of the record whose header and length follow."""
        parsed = parse_frame(frame)
        return (parsed is not None and parsed == (Kind.RECORD, record_len)
                and secrets.compare_digest(bytes(frame[FRAME_BYTES - TAG_BYTES : FRAME_BYTES]),
                                           self._tag(segment_id, offset, Kind.RECORD, record_len, header)))

    def check_reserved(self, segment_id: int, offset: int, frame: bytes | memoryview) -> int | None:
        """The length of the place whose reservation `frame` (read at `offset`) is, or None if it is not one."""
        parsed = parse_frame(frame)
        if parsed is None or parsed[0] != Kind.RESERVED:
            return None
        tag = self._tag(segment_id, offset, Kind.RESERVED, parsed[1], b"")
        return parsed[1] if secrets.compare_digest(bytes(frame[FRAME_BYTES - TAG_BYTES : FRAME_BYTES]), tag) else None


def parse_frame(frame: bytes | memoryview) -> tuple[Kind, int] | None:
    """(kind, length) of bytes shaped as a frame (tag not checked), or None."""
    if len(frame) < FRAME_BYTES:
        return None
    magic, kind, zero, zeros, length, _tag = FRAME.unpack_from(frame)
    if magic != MAGIC or zero or zeros or kind not in (Kind.RECORD, Kind.RESERVED) or length <= 0:
        return None
    return Kind(kind), length


def _make_key(path: Path) -> bytes:
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the daemon's alone, like the segments
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # the key's name must outlive a crash as surely as its segments
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return key
