"""A record written to its segment while it arrives: a put costs the slower of the receive and the disk
write, not their sum (docs/performance.md, "Data plane").

The store sets the record's place aside as soon as its header is verified (BlockStore.place). Each layer is
checked against the header's checksums as soon as it is in, and what is verified goes to the disk in
page-aligned pieces, straight from the buffer it arrived in, while later bytes still arrive. The header
is written last, once every layer has been verified and written: until then the place holds no record,
so a record cut off (a client gone, a timeout, a crash) leaves a hole that scans skip, never a readable
record. A record given up is erased. If a write fails, the record is appended whole once it has arrived,
as a record that was never placed.
"""

from __future__ import annotations

import asyncio
import logging

from kvstore.record import CorruptRecord, RecordHeader
from kvstore.server.requests import RequestError
from kvstore.server.segments import ALIGN
from kvstore.server.store import BlockStore, PlacedPut

log = logging.getLogger(__name__)

WRITE_STEP = 1024 * 1024  # verified bytes gathered before a write starts: fewer, larger requests to the device
WRITES_IN_FLIGHT = 2  # the device takes a second request while the first is served


class ArrivingRecord:
    def __init__(self, store: BlockStore, placed: PlacedPut, header: RecordHeader, payload: memoryview) -> None:
        self.store, self.placed, self.header, self.payload = store, placed, header, payload  # payload: (payload_len,)
        self.verified = 0  # payload bytes whose layers passed their checksums
        self.written = 0  # payload bytes handed to writes: a multiple of ALIGN until the last
        self._writing: list[asyncio.Future] = []  # writes started and not yet seen to end
        self._failed = False  # a write failed: the record goes the ordinary way
        self._given_up = False

    def arrived(self, received: int) -> None:
        """Payload bytes [0, received) are in: verify the layers now whole, and write what is verified.

        Raises RequestError when a layer does not match its checksum (nothing of it is written)."""
        layer_bytes = self.header.layer_bytes
        whole = received - received % layer_bytes if layer_bytes else received
        if whole > self.verified:
            try:
                self.header.check_layers(self.payload[self.verified : whole], self.verified // layer_bytes)
            except CorruptRecord:
                raise RequestError("payload does not match the header's layer checksums") from None
            self.verified = whole
        self._write(final=False)

    async def finish(self, header_bytes: bytes) -> PlacedPut | None:
        """Every byte is in and verified: write the rest, then the header. The place, or None if a write
        failed (the record is then appended whole by the put)."""
        assert self.verified == len(self.payload), "finish once the whole payload is verified"
        try:
            while self.written < len(self.payload) and not self._failed:
                if len(self._writing) >= WRITES_IN_FLIGHT:
                    await asyncio.wait(self._writing, return_when=asyncio.FIRST_COMPLETED)
                self._write(final=True)
            await self._wait()
            if not self._failed:
                header = asyncio.ensure_future(self.store.write_placed_header(self.placed, header_bytes))
                self._writing.append(header)  # so that a give-up waits for it too
                await asyncio.shield(header)  # cancelled, it still ends before anything is erased
                self._writing.clear()
                return self.placed
        except OSError as exc:
            self._note_failure(exc)
        except BaseException:  # cancelled (the daemon stops): the place is given up, once its writes end
            self._failed = True
            self.give_up()
            raise
        self.give_up()
        return None

    def give_up(self) -> None:
        """The record will not be put at its place: once the write in flight ends, erase what was written and
        let the place go. Runs on by itself, so that a cancelled receive cannot leave the place held."""
        if self._given_up:
            return
        self._given_up = True
        task = asyncio.ensure_future(self._give_up(self._writing, self.written))
        self.store.background(task)
        self._writing = []

    async def _give_up(self, writing: list[asyncio.Future], written: int) -> None:
        if writing:
            await asyncio.wait(writing)
        self.store.give_up(self.placed, written, self._failed)

    def _write(self, final: bool) -> None:
        self._writing = [writing for writing in self._writing if not writing.done()]
        if self._failed or len(self._writing) >= WRITES_IN_FLIGHT:
            return
        end = self.verified if final else self.verified - self.verified % ALIGN
        if end > self.written and (final or end - self.written >= WRITE_STEP):
            writing = asyncio.ensure_future(
                self.store.write_placed(self.placed, self.written, self.payload[self.written : end], final))
            writing.add_done_callback(self._written)
            self._writing.append(writing)
            self.written = end

    def _written(self, writing: asyncio.Future) -> None:
        if writing.cancelled() or writing.exception() is not None:  # a write not known to be done is not done
            self._note_failure(None if writing.cancelled() else writing.exception())

    async def _wait(self) -> None:
        if self._writing:
            await asyncio.wait(self._writing)
            self._writing = []

    def _note_failure(self, exc: BaseException | None) -> None:
        if not self._failed:
            self._failed = True
            log.warning("writing a record as it arrived failed (%s); it is appended whole instead", exc)
