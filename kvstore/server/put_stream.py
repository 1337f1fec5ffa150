"""The records of one Put stream, whichever transport carries them: gRPC (service.py) or the data channel
(dataplane.py). The transports differ only in how a record's bytes arrive; this is everything else.

Per record: its declared size is checked and reserved in the caller's share of the put budget; the
record must then arrive whole within `put_record_timeout_s` (a stalled record gives its reservation back);
its header must describe exactly the declared bytes, of a tenant the caller may write; its payload must
match the header's layer checksums (a transport may verify and write each layer as it lands: arriving.py);
and then it is stored, while later records are still arriving. The
reservation is held until the store has the record. A record that arrived and verified is stored even if
the stream breaks later (unacknowledged, as after a crash), never cut off half-way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvstore.eviction import ReuseHint
from kvstore.proto import pb
from kvstore.record import RecordBytes, RecordHeader
from kvstore.server.arriving import ArrivingRecord
from kvstore.server.config import ServerConfig
from kvstore.server.limits import ByteBudget, TimedOut
from kvstore.server.outcomes import PutResult
from kvstore.server.protocol_map import put_response
from kvstore.server.requests import check_payload, check_put_head, check_tenant, parse_record_header, reuse_hint
from kvstore.server.store import BlockStore

Payload = Sequence[RecordBytes]  # a record's payload, in the pieces it arrived in
VerifyHeader = Callable[[bytes], RecordHeader]  # a record's header bytes -> the header, verified


@dataclass(frozen=True, slots=True)
class Arrived:
    header: RecordHeader
    header_bytes: bytes
    payload: Payload
    arriving: ArrivingRecord | None = None  # verified as it arrived, and being written to its place


# How a transport reads one record of `declared` bytes: it hands the header's bytes to `verify` as soon as
# they are in (so that nothing is allocated for an unverified header) and returns what arrived.
Arrive = Callable[[int, VerifyHeader], Awaitable[Arrived]]


class PutStream:
    def __init__(self, store: BlockStore, config: ServerConfig, budget: ByteBudget, who: str,
                 scope: frozenset[bytes] | None) -> None:
        self.store, self.config, self.budget = store, config, budget
        self.who, self.scope = who, scope
        self._storing: list[asyncio.Task] = []

    async def receive(self, put_head: pb.PutHead, arrive: Arrive) -> None:
        """Receive the record `put_head` announces, through the transport's `arrive`; then start storing it."""
        declared = put_head.record_bytes
        check_put_head(declared, self.config)
        hint = reuse_hint(put_head)
        await self.budget.acquire(declared, self.who)
        try:
            async with asyncio.timeout(self.config.put_record_timeout_s):
                arrived = await arrive(declared, lambda raw: self._header(raw, declared))
            if arrived.arriving is None:  # else each layer was verified before it was written
                check_payload(arrived.header, arrived.payload)
        except TimeoutError:
            await self.budget.release(declared, self.who)
            raise TimedOut(f"a record did not arrive whole within {self.config.put_record_timeout_s:g} s of its "
                           "head (put_record_timeout_s)") from None
        except BaseException:
            await self.budget.release(declared, self.who)
            raise
        self._storing.append(asyncio.ensure_future(self._store(arrived, declared, hint)))

    async def results(self) -> pb.PutResponse:
        """Every record's outcome, in order, once all are stored."""
        return put_response(await asyncio.gather(*self._storing))

    async def settle(self) -> None:
        """Wait until the records that arrived whole are stored (or failed): the stream broke, and its
        client hears why only once what it sent before the break is in the store."""
        await asyncio.gather(*self._storing, return_exceptions=True)

    def _header(self, header_bytes: bytes, declared: int) -> RecordHeader:
        header = parse_record_header(header_bytes, declared, list(self.config.classes))
        check_tenant(header, self.scope)
        return header

    async def _store(self, arrived: Arrived, declared: int, hint: ReuseHint | None) -> PutResult:
        """Store a record, while later ones arrive: one written as it arrived is finished first (its last
        bytes, then its header), or appended whole if writing there failed."""
        try:
            placed = await arrived.arriving.finish(arrived.header_bytes) if arrived.arriving is not None else None
            return await self.store.put(arrived.header, arrived.header_bytes, arrived.payload, hint, placed)
        finally:
            await self.budget.release(declared, self.who)

