"""The gRPC face of the daemon: request validation, streaming framing and status codes.

Bulk bytes travel as raw gRPC messages (no protobuf wrapper, see proto/kvstore.proto), so a
multi-MiB payload is handed from the page cache or the DRAM tier to gRPC without another copy.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from kvstore.block import KEY_BYTES
from kvstore.proto import SERVICE, pb
from kvstore.record import CorruptRecord, decode_header, payload_layer_sums
from kvstore.server.config import ServerConfig
from kvstore.server.store import BlockStore, DiskFull, Miss, OpenBlock


class ByteBudget:
    """Bounds the bytes of Put records held in memory at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._changed = asyncio.Condition()

    async def acquire(self, nbytes: int, timeout_s: float) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.used + nbytes <= self.limit), timeout_s)
            except asyncio.TimeoutError:
                return False
            self.used += nbytes
            return True

    async def release(self, nbytes: int) -> None:
        async with self._changed:
            self.used -= nbytes
            self._changed.notify_all()


class KVStoreService:
    def __init__(self, store: BlockStore, config: ServerConfig) -> None:
        self.store = store
        self.config = config
        self.metrics = store.metrics
        self.put_budget = ByteBudget(config.max_inflight_put_bytes)

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode, details: str):
        self.metrics.rpc_errors.labels(method=method, code=code.name).inc()
        await context.abort(code, details)

    async def _check_keys(self, keys, context, method: str) -> None:
        if len(keys) > self.config.max_keys_per_request:
            await self._abort(context, method, grpc.StatusCode.INVALID_ARGUMENT,
                              f"{len(keys)} keys in one request; the limit is {self.config.max_keys_per_request}")
        for key in keys:
            if len(key) != KEY_BYTES:
                await self._abort(context, method, grpc.StatusCode.INVALID_ARGUMENT,
                                  f"a key is {KEY_BYTES} bytes, got one of {len(key)}")

    # -- unary RPCs -------------------------------------------------------------------------------

    async def lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        await self._check_keys(request.keys, context, "Lookup")
        return pb.LookupResponse(hits=self.store.lookup(request.keys))

    async def touch(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        await self._check_keys(request.keys, context, "Touch")
        if request.traffic_class and not self.store.class_known(request.traffic_class):
            await self._abort(context, "Touch", grpc.StatusCode.INVALID_ARGUMENT,
                              f"unknown traffic class {request.traffic_class!r}; known: {sorted(self.config.classes)}")
        return pb.CountResponse(count=await self.store.touch(request.keys, request.traffic_class))

    async def delete(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        await self._check_keys(request.keys, context, "Delete")
        return pb.CountResponse(count=await self.store.delete(request.keys))

    async def stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        self.store.refresh_gauges()
        return pb.StatsResponse(values=self.metrics.flatten())

    # -- Get: server-streamed ---------------------------------------------------------------------

    async def get(self, request: pb.GetRequest, context) -> AsyncIterator[bytes]:
        await self._check_keys(request.keys, context, "Get")
        if request.layer_end and request.layer_end <= request.layer_begin:
            await self._abort(context, "Get", grpc.StatusCode.INVALID_ARGUMENT,
                              f"empty layer range [{request.layer_begin}, {request.layer_end})")
        opened: list[tuple[int, OpenBlock, int, int]] = []
        served: list[OpenBlock] = []
        served_bytes = 0
        try:
            if request.order == pb.LAYER_MAJOR:
                # Headers first, then layer by layer across blocks, so layer 0 of every block arrives first.
                for index, key in enumerate(request.keys):
                    found = await self._open(request, index, key)
                    if isinstance(found, bytes):
                        yield found
                        if request.stop_at_miss:
                            break
                        continue
                    opened.append(found)
                    yield self._head(index, pb.OK, found[2], found[2], found[1].header_bytes, 0)
                alive = list(opened)
                for layer in range(request.layer_begin, max((o[3] for o in opened), default=0)):
                    survivors = []
                    for opened_block in alive:
                        index, block, _, end = opened_block
                        if layer >= end:
                            survivors.append(opened_block)
                            continue
                        head, data = await self._read(block, layer, layer + 1, index, with_header=False)
                        yield head
                        if data is None:
                            if request.stop_at_miss:
                                break  # this block and every later one are no longer part of the prefix
                            continue
                        yield data
                        served_bytes += len(data)
                        survivors.append(opened_block)
                    alive = survivors
                served = [block for _, block, *_ in alive]
            else:
                for index, key in enumerate(request.keys):
                    found = await self._open(request, index, key)
                    if isinstance(found, bytes):
                        yield found
                        if request.stop_at_miss:
                            break
                        continue
                    opened.append(found)
                    _, block, begin, end = found
                    head, data = await self._read(block, begin, end, index, with_header=True)
                    yield head
                    if data is None:
                        if request.stop_at_miss:
                            break
                        continue
                    yield data
                    served_bytes += len(data)
                    served.append(block)
        finally:
            for _, block, *_ in opened:
                self.store.close_block(block)
            self.store.record_hits(served, served_bytes)

    async def _open(self, request: pb.GetRequest, index: int, key: bytes) -> tuple[int, OpenBlock, int, int] | bytes:
        found = await self.store.open_block(key)
        if isinstance(found, Miss):
            return self._head(index, found.status, 0, 0, b"", 0, found.cause)
        n_layers = found.header.n_layers
        begin, end = request.layer_begin, request.layer_end or n_layers
        if end > n_layers:
            self.store.close_block(found)
            return self._head(index, pb.BAD_RANGE, begin, end, b"", 0, f"block has {n_layers} layers")
        return index, found, begin, end

    async def _read(self, block: OpenBlock, begin: int, end: int, index: int,
                    with_header: bool) -> tuple[bytes, bytes | None]:
        header_bytes = block.header_bytes if with_header else b""
        try:
            data = await self.store.read_layers(block, begin, end)
        except CorruptRecord as exc:
            self.metrics.misses.labels(cause=exc.cause).inc()
            return self._head(index, pb.CORRUPT, begin, end, header_bytes, 0, exc.cause), None
        except OSError:
            self.metrics.misses.labels(cause="io_error").inc()
            return self._head(index, pb.UNAVAILABLE, begin, end, header_bytes, 0, "io_error"), None
        return self._head(index, pb.OK, begin, end, header_bytes, len(data)), data

    @staticmethod
    def _head(index: int, status: int, begin: int, end: int, header: bytes, nbytes: int, cause: str = "") -> bytes:
        return pb.GetPartHead(index=index, status=status, layer_begin=begin, layer_end=end, header=header,
                              payload_bytes=nbytes, cause=cause).SerializeToString()

    # -- Put: client-streamed ---------------------------------------------------------------------

    async def put(self, request_iterator: AsyncIterator[bytes], context) -> pb.PutResponse:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        tasks: list[asyncio.Task] = []
        held = 0
        messages = request_iterator.__aiter__()

        async def next_message() -> bytes | None:
            try:
                return await messages.__anext__()
            except StopAsyncIteration:
                return None

        try:
            while (raw := await next_message()) is not None:
                try:
                    head = pb.PutHead.FromString(raw)
                except DecodeError:
                    await self._abort(context, "Put", invalid, "expected a PutHead message")
                declared = head.record_bytes
                if declared == 0:
                    await self._abort(context, "Put", invalid, "PutHead.record_bytes must be positive")
                if declared > self.config.max_block_bytes:
                    await self._abort(context, "Put", grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"record of {declared} bytes exceeds max_block_bytes={self.config.max_block_bytes}")
                if not await self.put_budget.acquire(declared, timeout_s=5.0):
                    await self._abort(context, "Put", grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      "too many bytes of puts in flight on this daemon; retry later")
                held += declared
                header_bytes = await next_message()
                if header_bytes is None:
                    await self._abort(context, "Put", invalid, "stream ended before the record header")
                try:
                    header = decode_header(header_bytes)
                    if len(header_bytes) != header.header_len:
                        raise CorruptRecord("bad_header", "the first chunk must be exactly the record header")
                    header.check_identity()
                except CorruptRecord as exc:
                    await self._abort(context, "Put", invalid, f"invalid record header: {exc}")
                if header.record_len != declared:
                    await self._abort(context, "Put", invalid,
                                      f"PutHead declares {declared} bytes but the header describes {header.record_len}")
                if not self.store.class_known(header.traffic_class):
                    await self._abort(context, "Put", invalid, f"unknown traffic class {header.traffic_class!r}; "
                                      f"this daemon knows {sorted(self.config.classes)}")
                chunks: list[bytes] = []
                received = 0
                while received < header.payload_len:
                    chunk = await next_message()
                    if chunk is None:
                        await self._abort(context, "Put", invalid, f"stream ended inside a record: {received} of "
                                          f"{header.payload_len} payload bytes received")
                    received += len(chunk)
                    if received > header.payload_len:
                        await self._abort(context, "Put", invalid,
                                          f"payload longer than declared ({header.payload_len} bytes)")
                    chunks.append(chunk)
                try:
                    sums = payload_layer_sums(chunks, header.layer_bytes)
                except CorruptRecord as exc:
                    await self._abort(context, "Put", invalid, str(exc))
                if tuple(sums) != header.layer_sums:
                    await self._abort(context, "Put", invalid, "payload does not match the header's layer checksums")
                tasks.append(asyncio.ensure_future(self._store_one(header, header_bytes, chunks, declared)))
                held -= declared  # now owned by the task
            results = await asyncio.gather(*tasks)
        except DiskFull as exc:
            await self._abort(context, "Put", grpc.StatusCode.RESOURCE_EXHAUSTED, f"disk full: {exc}")
        except OSError as exc:
            await self._abort(context, "Put", grpc.StatusCode.UNAVAILABLE, f"I/O error storing a record: {exc}")
        finally:
            if held:
                await self.put_budget.release(held)
            for task in tasks:
                if not task.done():
                    task.cancel()
        return pb.PutResponse(results=results)

    async def _store_one(self, header, header_bytes: bytes, chunks: list[bytes], declared: int) -> int:
        try:
            return await self.store.put(header, header_bytes, chunks)
        finally:
            await self.put_budget.release(declared)

    # -- wiring -----------------------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        def timed(method: str, fn: Callable[..., Awaitable]):
            async def call(request, context):
                started = time.perf_counter()
                try:
                    return await fn(request, context)
                finally:
                    self.metrics.rpc_latency.labels(method=method).observe(time.perf_counter() - started)
            return call

        def timed_stream(method: str, fn: Callable[..., AsyncIterator]):
            async def call(request, context):
                started = time.perf_counter()
                try:
                    async for message in fn(request, context):
                        yield message
                finally:
                    self.metrics.rpc_latency.labels(method=method).observe(time.perf_counter() - started)
            return call

        def parsed(method: str, message_type, fn: Callable[..., Awaitable]):
            # Parse here, not in gRPC's deserializer, so a malformed request is INVALID_ARGUMENT
            # (a failing deserializer would end the call as INTERNAL).
            async def call(raw: bytes, context):
                try:
                    request = message_type.FromString(raw)
                except DecodeError:
                    await self._abort(context, method, grpc.StatusCode.INVALID_ARGUMENT,
                                      f"request is not a valid {message_type.DESCRIPTOR.name}")
                return await fn(request, context)
            return call

        def parsed_stream(method: str, message_type, fn: Callable[..., AsyncIterator]):
            async def call(raw: bytes, context):
                try:
                    request = message_type.FromString(raw)
                except DecodeError:
                    await self._abort(context, method, grpc.StatusCode.INVALID_ARGUMENT,
                                      f"request is not a valid {message_type.DESCRIPTOR.name}")
                async for message in fn(request, context):
                    yield message
            return call

        def serialize(message) -> bytes:
            return message.SerializeToString()

        def unary(method: str, message_type, fn):
            return grpc.unary_unary_rpc_method_handler(timed(method, parsed(method, message_type, fn)), None, serialize)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Lookup": unary("Lookup", pb.LookupRequest, self.lookup),
            "Get": grpc.unary_stream_rpc_method_handler(
                timed_stream("Get", parsed_stream("Get", pb.GetRequest, self.get)), None, None),
            "Put": grpc.stream_unary_rpc_method_handler(timed("Put", self.put), None, serialize),
            "Touch": unary("Touch", pb.KeysRequest, self.touch),
            "Delete": unary("Delete", pb.KeysRequest, self.delete),
            "Stats": unary("Stats", pb.StatsRequest, self.stats),
        })
