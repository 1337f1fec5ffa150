"""Framing of the bulk data channel (TCP or Unix socket), shared by daemon and client (docs/protocol.md).

Every frame is a 12-byte prefix — magic "KVD1", kind (u8), 3 zero bytes, length of the protobuf head
(u32, little-endian) — then the head, then raw payload bytes whose length the head declares.
gRPC (HTTP/2 framing, a copy into and out of its slices per message) reaches about a third of
loopback TCP on these machines for MiB payloads; this channel moves payloads with one kernel copy on
each side, straight from the daemon's DRAM tier or page cache into the reader's buffer.
"""

from __future__ import annotations

import socket
import struct

MAGIC = b"KVD1"
PREFIX = struct.Struct("<4sBxxxI")
MAX_HEAD_BYTES = 8 * 2**20  # a GetRequest of 65,536 keys is ~1.2 MiB

GET = 1  # client: head GetRequest; daemon answers PART frames, then DONE
PART = 2  # daemon: head GetPartHead, then payload_bytes raw bytes when the status is OK
DONE = 3  # daemon: the Get is complete
PUT = 4  # client: head PutHead, then record_bytes raw bytes (header, then payload)
PUT_END = 5  # client: no more records; daemon answers PUT_RESULT
PUT_RESULT = 6  # daemon: head PutResponse
ERROR = 7  # daemon: head DataError; the daemon closes the connection after it
REGISTER = 8  # client: head RegisterRegion, then the memory's fd (Unix socket only); daemon answers REGISTERED
REGISTERED = 9  # daemon: head RegionRegistered
AUTH = 10  # client: head DataAuth, the first frame on a connection to a daemon that checks tokens
AUTHED = 11  # daemon: the token is good; then any frame its verbs allow

SOCKET_BUFFER_BYTES = 4 * 2**20


class FrameError(Exception):
    """The peer broke the framing; the connection cannot be used any more."""


def frame(kind: int, head: bytes = b"") -> bytes:
    return PREFIX.pack(MAGIC, kind, len(head)) + head


def parse_prefix(prefix: bytes | memoryview) -> tuple[int, int]:
    if len(prefix) != PREFIX.size:  # a peer that hung up mid-prefix, or a caller's short read
        raise FrameError(f"a frame prefix is {PREFIX.size} bytes, got {len(prefix)}")
    magic, kind, head_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r}")
    if head_len > MAX_HEAD_BYTES:
        raise FrameError(f"frame head of {head_len} bytes exceeds {MAX_HEAD_BYTES}")
    return kind, head_len


def tune(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
