"""How one daemon's Gets and Puts travel: gRPC, its data channel over TCP, or its data channel over a Unix
socket with shared memory. `Shard.transport()` picks one for each daemon, and no other code does.

    GrpcTransport            the daemon's gRPC channel, on the event loop it lives on
    DataChannelTransport     its bulk data channel (kvstore/wire.py): blocking sockets on the client's
                             pool; a call the channel refuses before doing anything (its connection or
                             memory limits, a channel that is gone) goes over gRPC instead
    SharedMemoryTransport    the same on the daemon's own host, over its Unix socket: it can be lent
                             memory (SharedBuffer) that Gets write into in place

Each offers a Get from the event loop (`get`) and from any other thread (`get_blocking`) side by side,
so the Get pipeline, the blocking client and the loader drive every transport the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor
from functools import partial
from typing import TYPE_CHECKING, Protocol

import grpc

from kvstore.client.dataplane import DataChannel, SharedBuffer, SharedPlacement, TransportError, put_head
from kvstore.eviction import ReuseHint
from kvstore.proto import method, pb

if TYPE_CHECKING:
    from kvstore.client.assembly import GetAssembly
    from kvstore.client.config import ClientConfig

# A Get the data channel could not serve, before any part arrived, is repeated over gRPC with these codes.
RETRY_GET_CODES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})

Offload = Callable[[Callable[[], None]], Awaitable[None]]  # runs a blocking step off the event loop


class Transport(Protocol):
    """How one daemon's Gets and Puts travel. Every call raises what failed (grpc.RpcError, TransportError,
    CorruptRecord from the assembly); counting and marking the daemon down are the caller's."""

    async def get(self, request: pb.GetRequest, parts: GetAssembly, shared: SharedPlacement | None = None,
                  offload: Offload | None = None) -> None:
        """Stream a Get into `parts`, from the event loop. `shared`: where the destinations lie in a buffer
        lent to the daemon; `offload`: where blocking socket work runs (default: the client's pool)."""

    def get_blocking(self, request: pb.GetRequest, parts: GetAssembly, shared: SharedPlacement | None = None) -> None:
        """The same Get from a thread other than the event loop's."""

    async def put(self, records: Sequence[tuple[bytes, bytes]], hint: ReuseHint | None) -> list[int]:
        """Store records (header, payload); each one's result (pb.STORED, pb.EXISTS, ...)."""

    async def lend(self, buffer: SharedBuffer) -> None:
        """Lend `buffer` to the daemon, so that Gets into it are written in place; nothing where it is elsewhere."""


class GrpcTransport:
    """Gets and Puts over the daemon's gRPC channel, on `loop`, the event loop that channel lives on."""

    def __init__(self, channel: grpc.aio.Channel, config: ClientConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.config, self.loop = config, loop
        self._get = channel.unary_stream(method("Get"), pb.GetRequest.SerializeToString, None)
        self._put = channel.stream_unary(method("Put"), None, pb.PutResponse.FromString)

    async def get(self, request: pb.GetRequest, parts: GetAssembly, shared: SharedPlacement | None = None,
                  offload: Offload | None = None) -> None:
        pending: pb.GetPartHead | None = None
        async for message in self._get(request, timeout=self.config.timeout_s, metadata=self.config.metadata):
            if pending is None:
                head = pb.GetPartHead.FromString(message)
                parts.accept(head)
                if head.status == pb.OK and head.payload_bytes:
                    pending = head  # its payload is the next message, wanted or not
                continue
            head, pending = pending, None
            parts.received_message(head, message)

    def get_blocking(self, request: pb.GetRequest, parts: GetAssembly, shared: SharedPlacement | None = None) -> None:
        """Waits on the event loop: never call it from there."""
        asyncio.run_coroutine_threadsafe(self.get(request, parts), self.loop).result()

    async def put(self, records: Sequence[tuple[bytes, bytes]], hint: ReuseHint | None) -> list[int]:
        response = await self._put(self._messages(records, hint), timeout=self.config.timeout_s,
                                   metadata=self.config.metadata)
        return list(response.results)

    def _messages(self, records: Sequence[tuple[bytes, bytes]], hint: ReuseHint | None) -> Iterator[bytes]:
        chunk = self.config.put_chunk_bytes
        for header, payload in records:
            yield put_head(len(header) + len(payload), hint)
            yield header
            if len(payload) <= chunk:
                yield payload
            else:
                view = memoryview(payload)
                for start in range(0, len(payload), chunk):
                    yield bytes(view[start : start + chunk])

    async def lend(self, buffer: SharedBuffer) -> None:
        pass


class DataChannelTransport:
    """Gets and Puts over the daemon's data channel, with `fallback` (gRPC) for the calls it refuses before
    doing anything: `refused` is told each time (the daemon is not down; gRPC carries calls for a while).
    Reads are safe to repeat, so a Get goes over gRPC as long as no part of it had arrived."""

    def __init__(self, channel: DataChannel, executor: Executor | None, timeout_s: float, fallback: GrpcTransport,
                 refused: Callable[[TransportError], None]) -> None:
        self.channel, self.executor, self.timeout_s = channel, executor, timeout_s
        self.fallback, self.refused = fallback, refused

    async def get(self, request: pb.GetRequest, parts: GetAssembly, shared: SharedPlacement | None = None,
                  offload: Offload | None = None) -> None:
        step = partial(self.get_blocking, request, parts, shared)
        if offload is not None:
            await offload(step)
        else:
            await asyncio.get_running_loop().run_in_executor(self.executor, step)

    def get_blocking(self, request: pb.GetRequest, parts: GetAssembly, shared: SharedPlacement | None = None) -> None:
        arrived = 0

        def sink(head: pb.GetPartHead) -> tuple[memoryview, int] | None:
            nonlocal arrived
            arrived += 1
            return parts.sink(head)

        try:
            self.channel.get(request, sink, parts.received, self.timeout_s, self._placement(shared))
        except TransportError as exc:
            if arrived or exc.code not in RETRY_GET_CODES:
                raise
            self.refused(exc)
            self.fallback.get_blocking(request, parts)

    async def put(self, records: Sequence[tuple[bytes, bytes]], hint: ReuseHint | None) -> list[int]:
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.executor, self.channel.put, records, self.timeout_s, hint)
        except TransportError as exc:  # refused before anything was stored: gRPC carries it
            if not exc.refused:
                raise
            self.refused(exc)
        return await self.fallback.put(records, hint)

    async def lend(self, buffer: SharedBuffer) -> None:
        pass

    def _placement(self, shared: SharedPlacement | None) -> SharedPlacement | None:
        return None  # no memory is lent over TCP


class SharedMemoryTransport(DataChannelTransport):
    """The data channel on the daemon's own host (its Unix socket), where the client lends it memory: a Get
    whose destinations lie in lent memory is written there by the daemon, and only part heads cross the socket."""

    async def lend(self, buffer: SharedBuffer) -> None:
        await asyncio.get_running_loop().run_in_executor(self.executor, self.channel.adopt, buffer, self.timeout_s)

    def _placement(self, shared: SharedPlacement | None) -> SharedPlacement | None:
        return shared
