"""One daemon's share of a Get: checks every part that arrives and gathers the verified blocks.

Transport-agnostic: the data channel hands it payload chunks as they land in their destination
buffers (`sink`, `received`), gRPC hands it whole messages (`received_message`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.block import Block
from kvstore.codec import BlockCodec
from kvstore.proto import pb
from kvstore.record import CorruptRecord, RecordHeader, decode_header

VERIFY_CHUNK_BYTES = 256 * 1024  # verify a part in chunks of about this size while the rest arrives
MAX_MISS_CAUSES = 64  # distinct miss causes counted by name; past that a new one counts as "other"
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Deferred:
    """A payload made when it is stored, on the thread that stores it (`save`'s write-behind thread), not on
    the caller's: an encoding that would hold an engine's thread. `nbytes` is what it is charged meanwhile."""

    make: Callable[[], Buffer]
    nbytes: int


Payload = Buffer | Sequence[Buffer] | Deferred  # a block's payload to store: layer-major, or one buffer per layer


def layer_major(payload: Payload) -> bytes | memoryview:
    """A payload to store as one layer-major buffer (one buffer per layer is joined, a Deferred one made)."""
    if isinstance(payload, Deferred):
        made = payload.make()
        return made if isinstance(made, bytes) else memoryview(made)
    if isinstance(payload, bytes | memoryview):
        return payload
    if isinstance(payload, bytearray):
        return memoryview(payload)
    return b"".join(payload)


def kv_bytes(header: RecordHeader, codec: BlockCodec | None) -> int:
    """The bytes of a record's layers as the engine holds them: its payload, or what the payload decodes to.
    What the bandwidth meter counts, so that load-or-recompute estimates hold whatever the codec."""
    return header.payload_len if codec is None else header.n_layers * codec.geometry.raw_bytes


def payload_bytes(payload: Payload) -> int:
    if isinstance(payload, Deferred):
        return payload.nbytes
    return len(payload) if isinstance(payload, bytes | bytearray | memoryview) else sum(len(p) for p in payload)


@dataclass(slots=True)
class BlockData:
    """A verified block as read: layers [layer_begin, layer_end) of its layer-major payload, in the form the
    store keeps it (encoded with the block's codec, if it has one: `kv` and `layer` decode)."""

    block: Block
    header: RecordHeader
    layer_begin: int
    layer_end: int
    payload: Buffer  # (layer_end - layer_begin) * header.layer_bytes bytes, layer-major

    def stored_layer(self, layer: int) -> memoryview:
        """Layer `layer` as the record holds it."""
        size = self.header.layer_bytes
        start = (layer - self.layer_begin) * size
        return memoryview(self.payload)[start : start + size]

    def layer(self, layer: int) -> memoryview:
        """Layer `layer` as the engine holds it. Raises CorruptLayer for bytes the codec cannot decode."""
        codec = self.block.codec
        if codec is None:
            return self.stored_layer(layer)
        out = memoryview(bytearray(codec.geometry.raw_bytes))
        codec.decode(self.stored_layer(layer), out)
        return out

    def kv(self) -> Buffer:
        """The layers read, layer-major, as the engine holds them (the payload itself for raw blocks)."""
        if self.block.codec is None:
            return self.payload
        return b"".join(self.layer(layer) for layer in range(self.layer_begin, self.layer_end))


class GetAssembly:
    """One shard's share of a Get: checks every part and gathers verified blocks.

    Runs on the data channel's worker thread or on the event loop, never on both at once.
    """

    def __init__(self, blocks: Sequence[Block], positions: list[int], layer_begin: int, layer_end: int | None,
                 into: Sequence[Buffer] | None, miss_causes: Counter) -> None:
        self.blocks, self.positions = blocks, positions
        self.layer_begin, self.layer_end = layer_begin, layer_end
        self.into, self.miss_causes = into, miss_causes
        self.headers: dict[int, RecordHeader] = {}
        self.payloads: dict[int, Buffer] = {}
        self.received_bytes: dict[int, int] = {}  # local -> verified payload bytes so far
        self.broken: set[int] = set()
        # Blocks whose payload failed its layer checksums here: reported to the daemon that sent them (Verify),
        # which does not check bytes it reads from its segment files straight into a shared region.
        self.failed_checksums: set[int] = set()
        self.hot: dict[int, int] = {}  # local -> the copies the daemon wants of a block it finds hot

    @property
    def corrupt_keys(self) -> list[bytes]:
        """The keys of the blocks whose payload failed its layer checksums here."""
        return [self.blocks[self.positions[local]].key for local in sorted(self.failed_checksums)]

    @property
    def bytes_received(self) -> int:
        return sum(self.received_bytes.values())

    @property
    def kv_bytes_received(self) -> int:
        """bytes_received as the engine's KV (decoded, for encoded blocks)."""
        codec = self.blocks[0].codec if self.blocks else None
        if codec is None:
            return self.bytes_received
        return sum(received // self.headers[local].layer_bytes * codec.geometry.raw_bytes
                   for local, received in self.received_bytes.items())

    def _miss(self, local: int, cause: str) -> None:
        # causes are the daemon's words: a misbehaving one must not grow the counter without bound
        if cause not in self.miss_causes and (len(self.miss_causes) >= MAX_MISS_CAUSES or len(cause) > 64):
            cause = "other"
        self.miss_causes[cause] += 1
        self.broken.add(local)

    def accept(self, head: pb.GetPartHead) -> bool:
        """Check a part's head; True when its payload is wanted."""
        if head.index >= len(self.positions):
            raise CorruptRecord("protocol", f"part index {head.index} out of range")
        local = head.index
        if head.status != pb.OK:
            self._miss(local, head.cause or pb.PartStatus.Name(head.status).lower())
            return False
        if head.header:
            try:
                header = decode_header(head.header)
                header.check_expected(self.blocks[self.positions[local]])
                if self.into is not None and len(memoryview(self.into[self.positions[local]]).cast("B")) < (
                        (self.layer_end or header.n_layers) - self.layer_begin) * header.layer_bytes:
                    raise CorruptRecord("layout_mismatch", "a record larger than the caller's buffer")
                self.headers[local] = header
                if head.replicas > 1:
                    self.hot[local] = head.replicas
            except CorruptRecord as exc:  # a collision or a substituted block: a miss
                self._miss(local, exc.cause)
        return bool(head.payload_bytes) and local not in self.broken and local in self.headers

    def destination(self, head: pb.GetPartHead) -> memoryview:
        """Where this part's payload belongs in its block's buffer."""
        local = head.index
        header = self.headers[local]
        end = self.layer_end or header.n_layers
        size = (end - self.layer_begin) * header.layer_bytes
        if local not in self.payloads:
            if self.into is not None:
                target = memoryview(self.into[self.positions[local]]).cast("B")
                if len(target) < size:
                    raise CorruptRecord("layout_mismatch", f"into[{self.positions[local]}] has {len(target)} bytes; "
                                                           f"the block needs {size}")
                self.payloads[local] = target[:size]
            else:
                self.payloads[local] = memoryview(bytearray(size))
        start = (head.layer_begin - self.layer_begin) * header.layer_bytes
        if head.layer_begin < self.layer_begin or start + head.payload_bytes > size:
            raise CorruptRecord("protocol", "part outside the requested layer range")
        return memoryview(self.payloads[local])[start : start + head.payload_bytes]

    def sink(self, head: pb.GetPartHead) -> tuple[memoryview, int] | None:
        if not self.accept(head):
            return None
        layer_bytes = self.headers[head.index].layer_bytes
        return self.destination(head), layer_bytes * max(1, VERIFY_CHUNK_BYTES // layer_bytes)

    def received(self, head: pb.GetPartHead, offset: int, data: memoryview | bytes) -> None:
        """Layers [offset, offset + len(data)) of a part have arrived: verify them."""
        local = head.index
        if local in self.broken:
            return
        header = self.headers[local]
        try:
            header.check_layers(data, head.layer_begin + offset // header.layer_bytes)
        except CorruptRecord as exc:
            if exc.cause == "checksum":
                self.failed_checksums.add(local)
            self._miss(local, exc.cause)
            return
        self.received_bytes[local] = self.received_bytes.get(local, 0) + len(data)

    def received_message(self, head: pb.GetPartHead, message: bytes) -> None:
        """A gRPC payload, which arrives as its own bytes: keep it when it is the whole block."""
        local = head.index
        if local in self.broken or local not in self.headers:
            return
        header = self.headers[local]
        whole = (head.layer_begin == self.layer_begin
                 and head.layer_end == (self.layer_end or header.n_layers))
        if whole and self.into is None:
            self.payloads[local] = message
            self.received(head, 0, message)
            return
        target = self.destination(head)
        target[:] = message
        self.received(head, 0, target)

    def results(self) -> dict[int, BlockData]:
        out = {}
        for local, header in self.headers.items():
            payload = self.payloads.get(local)
            if local in self.broken or payload is None or self.received_bytes.get(local, 0) != len(payload):
                continue  # missed, or the stream ended before all its layers arrived
            end = self.layer_end or header.n_layers
            out[self.positions[local]] = BlockData(self.blocks[self.positions[local]], header,
                                                   self.layer_begin, end, payload)
        return out
