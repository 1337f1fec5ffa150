"""The gRPC face of the daemon: control RPCs, and Get/Put for clients without the data channel.

Bulk bytes travel as raw gRPC messages (no protobuf wrapper, see proto/kvstore.proto), so a
multi-MiB payload is handed from the page cache or the DRAM tier to gRPC without another copy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

import kvstore
from kvstore.eviction import ReuseHint
from kvstore.hostid import host_id
from kvstore.proto import SERVICE, pb
from kvstore.server.config import ServerConfig
from kvstore.server.grpc_auth import current_principal
from kvstore.server.reads import get_parts
from kvstore.server.requests import (
    PermissionDenied,
    RequestError,
    check_get,
    check_keys,
    check_payload,
    check_put_head,
    check_tenant,
    parse,
    parse_record_header,
    reuse_hint,
)
from kvstore.server.store import BlockStore, DiskFull, Scope


class ByteBudget:
    """Bounds the bytes of Put records held in memory at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._changed = asyncio.Condition()

    async def acquire(self, nbytes: int, timeout_s: float = 5.0) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.used + nbytes <= self.limit), timeout_s)
            except TimeoutError:
                raise RequestError("too many bytes of puts in flight on this daemon; retry later",
                                   exhausted=True) from None
            self.used += nbytes

    async def release(self, nbytes: int) -> None:
        async with self._changed:
            self.used -= nbytes
            self._changed.notify_all()


class KVStoreService:
    def __init__(self, store: BlockStore, config: ServerConfig, put_budget: ByteBudget, data_port: int = 0,
                 data_socket: str = "") -> None:
        self.store = store
        self.config = config
        self.metrics = store.metrics
        self.put_budget = put_budget
        self.data_port = data_port
        self.data_socket = data_socket  # the data channel's Unix socket, for clients on this host

    def caller_scope(self) -> Scope:
        """The tenants the current call may reach: its token's, or all where authentication is off. With
        tokens on, a call that reached here without a principal is refused, never given every tenant."""
        principal = current_principal()
        if principal is None and self.config.auth_tokens is not None:
            raise PermissionDenied("no authenticated caller for this call")
        return None if principal is None else principal.tenants

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode, details: str):
        self.metrics.rpc_errors.labels(method=method, code=code.name).inc()
        await context.abort(code, details)

    async def _reject(self, context, method: str, error: RequestError):
        await self._abort(context, method, getattr(grpc.StatusCode, error.code), str(error))

    # -- unary RPCs -------------------------------------------------------------------------------

    async def lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        check_keys(request.keys, self.config)
        return pb.LookupResponse(hits=self.store.lookup(request.keys, self.caller_scope()))

    async def touch(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        check_keys(request.keys, self.config)
        if request.traffic_class and not self.store.class_known(request.traffic_class):
            raise RequestError(f"unknown traffic class {request.traffic_class!r}; known: {sorted(self.config.classes)}")
        return pb.CountResponse(count=await self.store.touch(request.keys, request.traffic_class, self.caller_scope()))

    async def delete(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        check_keys(request.keys, self.config)
        return pb.CountResponse(count=await self.store.delete(request.keys, self.caller_scope()))

    async def advise(self, request: pb.AdviseRequest, context) -> pb.CountResponse:
        check_keys(request.keys, self.config)
        return pb.CountResponse(count=self.store.advise(request.keys, request.continues, self.caller_scope()))

    async def stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        self.store.refresh_gauges()
        return pb.StatsResponse(values=self.metrics.flatten())

    async def info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        return pb.InfoResponse(data_port=self.data_port, max_block_bytes=self.config.max_block_bytes,
                               max_keys_per_request=self.config.max_keys_per_request,
                               traffic_classes=sorted(self.config.classes), version=kvstore.__version__,
                               host_id=host_id() if self.data_port or self.data_socket else "",
                               data_socket=self.data_socket)

    # -- Get: server-streamed: per part a GetPartHead, then the payload if the part is OK -------------

    async def get(self, request: pb.GetRequest, context) -> AsyncIterator[bytes]:
        check_get(request, self.config)
        if request.region_id:
            raise RequestError("shared-memory regions are only served on the data channel")
        async for head, payload in get_parts(self.store, request, scope=self.caller_scope()):
            yield head.SerializeToString()
            if payload is not None:
                yield payload if isinstance(payload, bytes) else bytes(payload)

    # -- Put: client-streamed: per record a PutHead, the header, then payload chunks ----------------

    async def put(self, request_iterator: AsyncIterator[bytes], context) -> pb.PutResponse:
        tasks: list[asyncio.Task] = []
        held = 0
        messages = request_iterator.__aiter__()
        scope = self.caller_scope()

        async def next_message(what: str, received: int = 0, expected: int = 0) -> bytes:
            try:
                return await messages.__anext__()
            except StopAsyncIteration:
                raise RequestError(f"stream ended before {what}" + (
                    f": {received} of {expected} payload bytes received" if expected else "")) from None

        try:
            while True:
                try:
                    raw = await messages.__anext__()
                except StopAsyncIteration:
                    break
                put_head = parse(pb.PutHead, raw)
                declared = put_head.record_bytes
                check_put_head(declared, self.config)
                await self.put_budget.acquire(declared)
                held += declared
                header_bytes = await next_message("the record header")
                header = parse_record_header(header_bytes, declared, list(self.config.classes))
                check_tenant(header, scope)
                chunks: list[bytes] = []
                received = 0
                while received < header.payload_len:
                    chunk = await next_message("the end of the record", received, header.payload_len)
                    received += len(chunk)
                    if received > header.payload_len:
                        raise RequestError(f"payload longer than declared ({header.payload_len} bytes)")
                    chunks.append(chunk)
                check_payload(header, chunks)
                tasks.append(asyncio.ensure_future(self._store_one(header, header_bytes, chunks, declared,
                                                                   reuse_hint(put_head))))
                held -= declared  # now owned by the task
            results = await asyncio.gather(*tasks)
        except RequestError as exc:
            await self._reject(context, "Put", exc)
        except DiskFull as exc:
            await self._abort(context, "Put", grpc.StatusCode.RESOURCE_EXHAUSTED, f"disk full: {exc}")
        except OSError as exc:
            await self._abort(context, "Put", grpc.StatusCode.UNAVAILABLE, f"I/O error storing a record: {exc}")
        finally:
            # Records already verified are stored even if the stream broke later (see the data channel).
            if held:
                await self.put_budget.release(held)
        return pb.PutResponse(results=results)

    async def _store_one(self, header, header_bytes: bytes, chunks: list[bytes], declared: int,
                         hint: ReuseHint | None) -> int:
        try:
            return await self.store.put(header, header_bytes, chunks, hint)
        finally:
            await self.put_budget.release(declared)

    # -- wiring -----------------------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(method: str, message_type, fn: Callable[..., Awaitable]):
            # Parse here, not in gRPC's deserializer, so a malformed request is INVALID_ARGUMENT
            # (a failing deserializer would end the call as INTERNAL).
            async def call(raw: bytes, context):
                started = time.perf_counter()
                try:
                    return (await fn(parse(message_type, raw), context)).SerializeToString()
                except RequestError as exc:
                    await self._reject(context, method, exc)
                finally:
                    self.metrics.rpc_latency.labels(method=method).observe(time.perf_counter() - started)
            return grpc.unary_unary_rpc_method_handler(call, None, None)

        async def get(raw: bytes, context):
            started = time.perf_counter()
            try:
                async for message in self.get(parse(pb.GetRequest, raw), context):
                    yield message
            except RequestError as exc:
                await self._reject(context, "Get", exc)
            finally:
                self.metrics.rpc_latency.labels(method="Get").observe(time.perf_counter() - started)

        async def put(request_iterator, context):
            started = time.perf_counter()
            try:
                return (await self.put(request_iterator, context)).SerializeToString()
            finally:
                self.metrics.rpc_latency.labels(method="Put").observe(time.perf_counter() - started)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Lookup": unary("Lookup", pb.LookupRequest, self.lookup),
            "Get": grpc.unary_stream_rpc_method_handler(get, None, None),
            "Put": grpc.stream_unary_rpc_method_handler(put, None, None),
            "Touch": unary("Touch", pb.KeysRequest, self.touch),
            "Delete": unary("Delete", pb.KeysRequest, self.delete),
            "Advise": unary("Advise", pb.AdviseRequest, self.advise),
            "Stats": unary("Stats", pb.StatsRequest, self.stats),
            "Info": unary("Info", pb.InfoRequest, self.info),
        })
