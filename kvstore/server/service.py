"""The gRPC face of the daemon: control RPCs, and Get/Put for clients without the data channel.

Bulk bytes travel as raw gRPC messages (no protobuf wrapper, see proto/kvstore.proto), so a
multi-MiB payload is handed from the page cache or the DRAM tier to gRPC without another copy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import grpc
from grpc._cython.cygrpc import ExecuteBatchError  # what a write raises once its call has ended (no public name)

import kvstore
from kvstore.hostid import host_id
from kvstore.proto import SERVICE, pb
from kvstore.record import RecordBytes
from kvstore.server.config import ServerConfig
from kvstore.server.grpc_auth import current_principal
from kvstore.server.limits import ByteBudget, TimedOut, grpc_caller
from kvstore.server.put_stream import Arrived, PutStream
from kvstore.server.reads import get_parts
from kvstore.server.requests import (
    PermissionDenied,
    RequestError,
    check_get,
    check_keys,
    parse,
)
from kvstore.server.store import BlockStore, DiskFull, Scope


class StalledReader(Exception):
    """The client of a Get took no message for `rpc_stream_timeout_s`."""


class KVStoreService:
    def __init__(self, store: BlockStore, config: ServerConfig, put_budget: ByteBudget, data_port: int = 0,
                 data_socket: str = "") -> None:
        self.store = store
        self.config = config
        self.metrics = store.metrics
        self.put_budget = put_budget
        # Get payloads handed to gRPC that the client has not taken yet; gRPC holds each in memory until then.
        self.send_budget = ByteBudget(config.max_grpc_send_bytes, config.max_grpc_send_bytes_per_principal,
                                      "bytes of gRPC Gets not yet taken by their clients",
                                      "max_grpc_send_bytes, max_grpc_send_bytes_per_principal")
        self.data_port = data_port
        self.data_socket = data_socket  # the data channel's Unix socket, for clients on this host

    def caller_scope(self) -> Scope:
        """The tenants the current call may reach: its token's, or all where authentication is off. With
        tokens on, a call that reached here without a principal is refused, never given every tenant."""
        principal = current_principal()
        if principal is None and self.config.auth_tokens is not None:
            raise PermissionDenied("no authenticated caller for this call")
        return None if principal is None else principal.tenants

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode,
                     details: str) -> NoReturn:
        self.metrics.rpc_errors.labels(method=method, code=code.name).inc()
        await context.abort(code, details)  # ends the call with an exception (grpc has no stubs to say so)
        raise AssertionError("ServicerContext.abort returned")

    async def _reject(self, context, method: str, error: RequestError) -> NoReturn:
        await self._abort(context, method, getattr(grpc.StatusCode, error.code), str(error))

    # -- unary RPCs -------------------------------------------------------------------------------

    async def lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        check_keys(request.keys, self.config)
        scope = self.caller_scope()
        hits = self.store.lookup(request.keys, scope, promote=request.promote)
        present = self.store.present(request.keys, scope) if request.each else b""
        return pb.LookupResponse(hits=hits, present=present)

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

    async def verify(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        check_keys(request.keys, self.config)
        return pb.CountResponse(count=await self.store.verify(request.keys, self.caller_scope(), grpc_caller(context)))

    async def stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        self.store.refresh_gauges()
        return self.metrics.stats_response()

    async def info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        return pb.InfoResponse(data_port=self.data_port, max_block_bytes=self.config.max_block_bytes,
                               max_keys_per_request=self.config.max_keys_per_request,
                               traffic_classes=sorted(self.config.classes), version=kvstore.__version__,
                               host_id=host_id() if self.data_port or self.data_socket else "",
                               data_socket=self.data_socket)

    # -- Get: server-streamed: per part a GetPartHead, then the payload if the part is OK -------------

    async def get(self, request: pb.GetRequest, context) -> None:
        check_get(request, self.config)
        if request.region_id:
            raise RequestError("shared-memory regions are only served on the data channel")
        who = grpc_caller(context)
        scope = self.caller_scope()
        with self.store.gets_in_flight:  # promotion waits while any Get is served and not waiting on its client
            async for head, payload in get_parts(self.store, request, scope=scope):
                await self._send(context, head.SerializeToString())
                if payload is not None:
                    await self._send_payload(context, payload, who)

    async def _send_payload(self, context, payload: RecordBytes, who: str) -> None:
        """Send one payload, holding its memory against the send budget until the client has taken it.

        Until then gRPC holds it twice: the bytes object its API takes and its core's own copy. A payload
        larger than a principal's share takes the whole share."""
        charge = min(2 * len(payload), self.send_budget.per_principal)
        with self.store.gets_in_flight.waiting_on_client():  # for bytes of Gets that clients have not taken
            await self.send_budget.acquire(charge, who, self.config.rpc_stream_timeout_s)
        try:
            await self._send(context, payload if isinstance(payload, bytes) else bytes(payload))
        finally:
            await self.send_budget.release(charge, who)

    async def _send(self, context, message: bytes) -> None:
        """Hand `message` to gRPC; StalledReader if the client takes nothing for `rpc_stream_timeout_s`.

        gRPC does not tell whether a write waits for the client's HTTP/2 window, so every write counts as
        waiting on the client (GetsInFlight); one the transport takes at once ends within a round of its
        completion queue."""
        try:
            with self.store.gets_in_flight.waiting_on_client():
                await asyncio.wait_for(context.write(message), self.config.rpc_stream_timeout_s)
        except TimeoutError:
            raise StalledReader() from None

    # -- Put: client-streamed: per record a PutHead, the header, then payload chunks ----------------

    async def put(self, request_iterator: AsyncIterator[bytes], context) -> pb.PutResponse:
        messages = request_iterator.__aiter__()
        stream = PutStream(self.store, self.config, self.put_budget, grpc_caller(context), self.caller_scope())

        async def message_or_end() -> bytes | None:
            """The next message; None where the stream ends."""
            try:
                return await asyncio.wait_for(messages.__anext__(), self.config.rpc_stream_timeout_s)
            except StopAsyncIteration:
                return None
            except TimeoutError:
                raise TimedOut(f"the client sent nothing for {self.config.rpc_stream_timeout_s:g} s "
                               "(rpc_stream_timeout_s)") from None

        async def next_message(what: str, received: int = 0, expected: int = 0) -> bytes:
            """The next message, inside a record: the stream ending before `what` is the client's error."""
            message = await message_or_end()
            if message is None:
                raise RequestError(f"stream ended before {what}" + (
                    f": {received} of {expected} payload bytes received" if expected else ""))
            return message

        async def arrive(declared: int, verify_header):
            """A record as messages: its header, then payload chunks of any size."""
            header_bytes = await next_message("the record header")
            header = verify_header(header_bytes)
            chunks: list[bytes] = []
            received = 0
            while received < header.payload_len:
                chunk = await next_message("the end of the record", received, header.payload_len)
                received += len(chunk)
                if received > header.payload_len:
                    raise RequestError(f"payload longer than declared ({header.payload_len} bytes)")
                chunks.append(chunk)
            return Arrived(header, header_bytes, chunks)

        try:
            while (raw := await message_or_end()) is not None:  # the stream may end between records
                await stream.receive(parse(pb.PutHead, raw), arrive)
            return await stream.results()
        except (RequestError, DiskFull, OSError) as exc:
            await stream.settle()  # the caller hears of the break once what arrived before it is stored
            if isinstance(exc, RequestError):
                await self._reject(context, "Put", exc)
            elif isinstance(exc, DiskFull):
                await self._abort(context, "Put", grpc.StatusCode.RESOURCE_EXHAUSTED, f"disk full: {exc}")
            else:
                await self._abort(context, "Put", grpc.StatusCode.UNAVAILABLE, f"I/O error storing a record: {exc}")

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

        async def get(raw: bytes, context) -> None:  # writes its messages, so that each write can time out
            started = time.perf_counter()
            try:
                await self.get(parse(pb.GetRequest, raw), context)
            except RequestError as exc:
                await self._reject(context, "Get", exc)
            except StalledReader:
                # A status would queue behind the message the client does not take; ending the handler
                # as cancelled makes gRPC cancel the call, which frees that message.
                self.metrics.rpc_errors.labels(method="Get", code="DEADLINE_EXCEEDED").inc()
                raise asyncio.CancelledError() from None
            except ExecuteBatchError:
                # A write met a call that had ended: its client cancelled it or closed its channel mid-Get.
                # gRPC takes a handler that ends cancelled as that; let through, this logs a traceback when the
                # connection went before gRPC marked the call closed.
                self.metrics.rpc_errors.labels(method="Get", code="CANCELLED").inc()
                raise asyncio.CancelledError() from None
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
            "Verify": unary("Verify", pb.KeysRequest, self.verify),
            "Stats": unary("Stats", pb.StatsRequest, self.stats),
            "Info": unary("Info", pb.InfoRequest, self.info),
        })
