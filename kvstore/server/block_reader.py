"""Serving the bytes of a block the store found: from the DRAM tier, or from its segment file.

A header read from a segment file must name the indexed key and lengths (docs/design.md section 10). Payload
bytes read from a segment file into the daemon's own memory (a send over TCP or gRPC, a DRAM tier fill,
promotion) are checked against the header's layer checksums first: bytes that fail them drop the block's
index entry and are a miss. Payload bytes read straight into a client's shared region are not: the client
checks every layer it receives whatever the path, and a check here would be a second pass over the same
bytes, in memory the client can write anyway. A client that finds them corrupt names the block (Verify),
and `check_dram_copy` and `check_segment_copy` then check the daemon's own copies in private memory; the
scrub (scrub.py) does the same for every block in turn.

A reader holds what it serves from until it closes the block: the segment (deleting it waits for its last
reader) or the DRAM tier entry (eviction never recycles a buffer that is being sent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from kvstore.record import CorruptRecord, RecordBytes, RecordHeader, decode_header
from kvstore.server.header_cache import HeaderCache
from kvstore.server.hot_tier import HotEntry, HotTier
from kvstore.server.index import Entry
from kvstore.server.outcomes import Miss, MissStatus
from kvstore.server.segments import Segment, SegmentSet

CHECK_CHUNK_BYTES = 256 * 1024  # read, then verify, this much at a time: it stays in the CPU's cache
CopyCheck = Literal["good", "corrupt", "absent", "unreadable"]  # what a check of one copy of a block found


@dataclass(slots=True)
class OpenBlock:
    """A block being served: its verified header and where its payload comes from."""

    key: bytes
    entry: Entry
    header: RecordHeader
    header_bytes: bytes
    segment: Segment | None  # held (acquired) while serving from the segment file
    hot: HotEntry | None  # pinned while serving from the DRAM tier
    tier: str  # where the hit was found: "dram" or "ssd"

    @property
    def payload(self) -> RecordBytes | None:
        return self.hot.payload if self.hot is not None else None


class BlockReader:
    def __init__(self, segments: SegmentSet, hot: HotTier, run_io: Callable[..., Awaitable],
                 drop_corrupt: Callable[[bytes, Entry], Awaitable[None]], headers: HeaderCache | None = None) -> None:
        self._segments = segments
        self._hot = hot
        self.headers = headers or HeaderCache(0)
        self._run_io = run_io  # on the store's I/O threads
        self._drop_corrupt = drop_corrupt  # removes a block whose bytes failed verification from the index

    async def open(self, key: bytes, entry: Entry) -> OpenBlock | Miss:
        """Pin or acquire what the indexed block is served from, and verify its header; a Miss (not yet
        counted) if it cannot be served. The caller must `close` an OpenBlock."""
        cached = self._hot.pin(key)
        if cached is not None:
            return OpenBlock(key, entry, decode_header(cached.header), cached.header, None, cached, "dram")
        return await self.open_segment(key, entry)

    async def open_segment(self, key: bytes, entry: Entry) -> OpenBlock | Miss:
        """As `open`, from the segment file alone: the DRAM tier is not consulted (promotion reads so, and
        a pin would count as a read of the entry)."""
        segment = self._segments.acquire(entry.segment)
        if segment is None:
            return Miss(MissStatus.UNAVAILABLE, "segment_gone")
        try:
            place = (entry.segment, entry.offset)
            header_bytes = self.headers.get(key, place)
            if header_bytes is None:
                header_bytes = await self._run_io(SegmentSet.read, segment, entry.offset, entry.header_len)
            header = decode_header(header_bytes)
            if header.key != key or header.payload_len != entry.payload_len:
                raise CorruptRecord("key_mismatch", "record at the indexed place belongs to another key")
            self.headers.put(key, place, header_bytes)
        except CorruptRecord as exc:
            self.headers.discard(key)
            self._segments.release(segment)
            await self._drop_corrupt(key, entry)
            return Miss(MissStatus.CORRUPT, exc.cause)
        except OSError:
            self._segments.release(segment)
            return Miss(MissStatus.UNAVAILABLE, "io_error")
        except BaseException:  # cancelled (a Get read ahead and stopped at a miss): no caller will close it
            self._segments.release(segment)
            raise
        return OpenBlock(key, entry, header, header_bytes, segment, None, "ssd")

    async def read_layers(self, block: OpenBlock, begin: int, end: int,
                          into: memoryview | None = None, keep: bool = True) -> RecordBytes:
        """Payload bytes of layers [begin, end), written into `into` when given: verified, but for bytes
        read from the segment file into `into`.

        `into` is a client's shared region, which the client verifies itself (end to end) and can write
        as well: the daemon's check there would cost a second pass over the bytes and prove nothing the
        client's does not. A file that ends before the layers do is still found (and the block dropped).
        Raises CorruptRecord or OSError; ValueError for a range outside the block (a caller's bug, never
        a reason to drop it). A whole block read from its segment is kept in the DRAM tier unless
        `keep` is False (promotion puts it there itself); its buffer is one the tier can keep either way."""
        header = block.header
        if not 0 <= begin < end <= header.n_layers:
            raise ValueError(f"layers [{begin}, {end}) of a block of {header.n_layers}")
        if block.payload is not None:
            if into is not None:
                into[:] = memoryview(block.payload)[begin * header.layer_bytes : end * header.layer_bytes]
                return into
            if begin == 0 and end == header.n_layers:
                return block.payload
            return block.payload[begin * header.layer_bytes : end * header.layer_bytes]
        assert block.segment is not None
        whole = begin == 0 and end == header.n_layers and into is None
        nbytes = (end - begin) * header.layer_bytes
        data = into if into is not None else self._hot.buffer(nbytes) if whole else bytearray(nbytes)
        offset = block.entry.offset + header.layer_offset(begin)
        try:
            if into is not None:
                # Shielded: a Get that stops (a miss ahead, the client gone) must not send DONE, nor let the
                # segment's descriptors close, while an I/O thread still writes into the client's memory.
                reading = asyncio.ensure_future(self._run_io(SegmentSet.read_into, block.segment, offset, into))
                try:
                    await asyncio.shield(reading)
                except asyncio.CancelledError:
                    await asyncio.wait([reading])
                    if not reading.cancelled():
                        reading.exception()  # taken: nobody reads what the stopped Get would have sent
                    raise
            else:
                # Checked on the I/O thread too: CRC32C (format 3) releases the GIL, so the event loop runs on.
                await self._run_io(_read_checked, block.segment, offset, data, header, begin)
        except CorruptRecord:
            await self._drop_corrupt(block.key, block.entry)
            raise
        if whole and keep:  # the DRAM tier keeps it; pinned for this reader, as if it had come from there
            self._hot.put(block.key, block.header_bytes, data)
            block.hot = self._hot.pin(block.key)
        return data

    async def warm(self, block: OpenBlock) -> None:
        """Bring a block read from SSD into the DRAM tier (whole), so its layers are served from memory.

        Layer-by-layer reads would otherwise never fill the tier; a failure is left to the reads that
        follow, which report it as a miss."""
        if block.payload is None and 0 < block.entry.record_len <= self._hot.capacity_bytes:
            try:
                await self.read_layers(block, 0, block.header.n_layers)
            except (CorruptRecord, OSError):
                pass

    # -- checking the daemon's own copies again (Verify, the scrub) ---------------------------------

    async def check_dram_copy(self, key: bytes) -> CopyCheck:
        """Check the DRAM tier's copy of `key` against its header's checksums; a corrupt one is discarded
        from the tier (the segment file's copy is the block's, and is checked apart)."""
        cached = self._hot.pin(key)
        if cached is None:
            return "absent"
        try:
            await self._run_io(_check_payload, cached.header, cached.payload)
        except CorruptRecord:
            self._hot.discard(key, only=cached)
            return "corrupt"
        finally:
            self._hot.unpin(cached)
        return "good"

    async def check_segment_copy(self, key: bytes, entry: Entry) -> CopyCheck:
        """Read the record `entry` points at into private memory and check its header and every layer; a
        corrupt one is dropped (as a Get drops it). "absent": its segment is gone (deleted since the entry
        was read); "unreadable": an I/O error, which proves nothing about the bytes.

        The segment is held only while the record is read, never between records."""
        segment = self._segments.acquire(entry.segment)
        if segment is None:
            return "absent"
        reading = asyncio.ensure_future(self._run_io(_check_record, segment, key, entry))
        try:
            # Shielded: a caller cancelled (shutdown) returns at once, and the segment is released once the
            # I/O thread is done with it, not while it still reads.
            await asyncio.shield(reading)
        except CorruptRecord:
            await self._drop_corrupt(key, entry)
            return "corrupt"
        except OSError:
            return "unreadable"
        finally:
            if reading.done():
                self._segments.release(segment)
            else:
                def release(done: asyncio.Future) -> None:
                    if not done.cancelled():
                        done.exception()  # nobody awaits it any more: taken, so it is not logged as lost
                    self._segments.release(segment)

                reading.add_done_callback(release)
        return "good"

    def close(self, block: OpenBlock) -> None:
        if block.segment is not None:
            self._segments.release(block.segment)
            block.segment = None
        if block.hot is not None:
            self._hot.unpin(block.hot)
            block.hot = None


def _read_checked(segment: Segment, offset: int, data, header: RecordHeader, begin: int) -> None:
    """Read layers from `begin` into `data` and verify them (raises CorruptRecord): a few layers at a time,
    each checked while its bytes are still in the CPU's cache, not in a second pass over memory."""
    step = header.layer_bytes * max(1, CHECK_CHUNK_BYTES // header.layer_bytes)
    SegmentSet.read_into(segment, offset, memoryview(data),
                         lambda start, piece: header.check_layers(piece, begin + start // header.layer_bytes), step)


def _check_payload(header_bytes: bytes, payload: RecordBytes) -> None:
    """Verify a whole payload held in memory against its header (raises CorruptRecord)."""
    decode_header(header_bytes).check_layers(memoryview(payload), 0)


def _check_record(segment: Segment, key: bytes, entry: Entry) -> None:
    """Read the record at `entry` and verify it (raises CorruptRecord): its header, which must name `key` and
    the indexed lengths, and every layer, a chunk at a time through one buffer of about CHECK_CHUNK_BYTES."""
    header = decode_header(SegmentSet.read(segment, entry.offset, entry.header_len))
    if header.key != key or header.payload_len != entry.payload_len:
        raise CorruptRecord("key_mismatch", "record at the indexed place belongs to another key")
    layers_per_chunk = max(1, CHECK_CHUNK_BYTES // header.layer_bytes)
    buffer = memoryview(bytearray(layers_per_chunk * header.layer_bytes))
    offset = entry.offset + header.header_len
    for begin in range(0, header.n_layers, layers_per_chunk):
        chunk = buffer[: (min(begin + layers_per_chunk, header.n_layers) - begin) * header.layer_bytes]
        SegmentSet.read_into(segment, offset + begin * header.layer_bytes, chunk)
        header.check_layers(chunk, begin)
