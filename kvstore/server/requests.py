"""Validation of requests, shared by the gRPC service and the bulk data channel.

Each check raises RequestError with a message that says what was wrong; the transport maps
`exhausted=False` to INVALID_ARGUMENT and `exhausted=True` to RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import DecodeError

from kvstore.block import KEY_BYTES
from kvstore.eviction import ReuseHint
from kvstore.proto import pb
from kvstore.record import CorruptRecord, RecordBytes, RecordHeader, decode_header, payload_layer_sums
from kvstore.server.config import ServerConfig


class RequestError(Exception):
    def __init__(self, message: str, exhausted: bool = False) -> None:
        super().__init__(message)
        self.exhausted = exhausted

    @property
    def code(self) -> str:
        """The gRPC status code name this error is answered with."""
        return "RESOURCE_EXHAUSTED" if self.exhausted else "INVALID_ARGUMENT"


class PermissionDenied(RequestError):
    """The caller's token does not reach what the request names (another tenant, a verb it lacks)."""

    @property
    def code(self) -> str:
        return "PERMISSION_DENIED"


def check_tenant(header: RecordHeader, scope: frozenset[bytes] | None) -> None:
    """A record may be put only by a caller whose token reaches the record's tenant."""
    if scope is not None and header.tenant not in scope:
        raise PermissionDenied("this token may not write blocks of the record's tenant")


def parse(message_type, raw: bytes):
    """A protobuf message from bytes a client sent, or a RequestError saying it is not one."""
    try:
        return message_type.FromString(raw)
    except DecodeError:
        raise RequestError(f"expected a valid {message_type.DESCRIPTOR.name} message") from None


def check_keys(keys: Sequence[bytes], config: ServerConfig) -> None:
    if len(keys) > config.max_keys_per_request:
        raise RequestError(f"{len(keys)} keys in one request; the limit is {config.max_keys_per_request}")
    for key in keys:
        if len(key) != KEY_BYTES:
            raise RequestError(f"a key is {KEY_BYTES} bytes, got one of {len(key)}")


def check_get(request: pb.GetRequest, config: ServerConfig) -> None:
    check_keys(request.keys, config)
    if request.layer_end and request.layer_end <= request.layer_begin:
        raise RequestError(f"empty layer range [{request.layer_begin}, {request.layer_end})")


def check_put_head(declared: int, config: ServerConfig) -> None:
    if declared == 0:
        raise RequestError("PutHead.record_bytes must be positive")
    if declared > config.max_block_bytes:
        raise RequestError(f"record of {declared} bytes exceeds max_block_bytes={config.max_block_bytes}",
                           exhausted=True)


def reuse_hint(head: pb.PutHead) -> ReuseHint | None:
    """The engine's hint about the request a block came from, or None if it sent none.

    A client cannot buy retention by lying: what a class of hints is worth is learned from how often
    blocks put with it were really used again."""
    if not head.request_blocks:
        return None
    if head.request_hit_blocks > head.request_blocks:
        raise RequestError(f"PutHead says {head.request_hit_blocks} of {head.request_blocks} blocks were cached")
    return ReuseHint(head.request_hit_blocks, head.request_blocks, head.request_turn)


def parse_record_header(header_bytes: bytes, declared: int, known_classes: Sequence[str]) -> RecordHeader:
    """The verified header of a record being put, which must describe exactly `declared` bytes."""
    try:
        header = decode_header(header_bytes)
        if len(header_bytes) != header.header_len:
            raise CorruptRecord("bad_header", "the first chunk must be exactly the record header")
        header.check_identity()
    except CorruptRecord as exc:
        raise RequestError(f"invalid record header: {exc}") from None
    if header.record_len != declared:
        raise RequestError(f"PutHead declares {declared} bytes but the header describes {header.record_len}")
    if header.traffic_class not in known_classes:
        raise RequestError(f"unknown traffic class {header.traffic_class!r}; this daemon knows {sorted(known_classes)}")
    return header


def check_payload(header: RecordHeader, chunks: Sequence[RecordBytes]) -> None:
    try:
        sums = payload_layer_sums(chunks, header.layer_bytes, header.version)
    except CorruptRecord as exc:
        raise RequestError(str(exc)) from None
    if tuple(sums) != header.layer_sums:
        raise RequestError("payload does not match the header's layer checksums")
