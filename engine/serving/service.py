"""The gRPC face of a serving loop: proto/decode.proto's DecodeInstance service.

Each Generate runs as a task on the server's event loop: it hands its request to the engine thread, and
that thread's callbacks put tokens and the end into the call's queue (`call_soon_threadsafe`); the task
sends what has come since its last message as one, so a slow client gets fewer, larger messages. A call
that is cancelled, or whose client goes away, is cancelled on the engine, which frees its KV. The requests
held at once are bounded by the serving loop, in all and per principal (a token's name, else the peer's
address, as the daemon's CallLimiter counts them): past either, RESOURCE_EXHAUSTED at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from engine.decode import DecodeError, DecodeRequest, DecodeResult
from engine.prefill import PrefillRequest
from engine.serving.loop import ServingBusy, ServingClosed, ServingLoop
from engine.serving.messages import RequestRefused, decode_request, load_message, parse, result_message
from engine.serving.proto import SERVICE, pb
from kvstore.server.grpc_auth import current_principal, method_verbs
from kvstore.server.limits import grpc_caller

# Generate spends the instance's compute and writes the tenant's blocks to the store; Load only reads
VERBS = {"Generate": "write", "Load": "read"}
verb_of = method_verbs(SERVICE, VERBS)

_End = tuple[DecodeResult | None, Exception | None]  # how the serving loop ends a request: (result, error)


class DecodeService:
    def __init__(self, serving: ServingLoop) -> None:
        self.serving = serving
        self.store = serving.prefill is not None

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            request = decode_request(parse(pb.GenerateRequest, raw), self.store, self.serving.context)
        except RequestRefused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if (refusal := _outside_tenants(request)) is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[int | _End] = asyncio.Queue()  # the reply's tokens, then its end

        def put(event: int | _End) -> None:  # from the engine thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        request.on_token = put
        try:
            ticket = self.serving.submit(request, lambda result, error: put((result, error)), grpc_caller(context))
        except ServingClosed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ServingBusy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        done = False
        try:
            while not done:
                tokens: list[int] = []
                end: int | _End | None = await events.get()
                while isinstance(end, int):  # every token that has come, in one message
                    tokens.append(end)
                    end = events.get_nowait() if not events.empty() else None
                if tokens:
                    yield pb.GenerateReply(tokens=pb.Tokens(ids=tokens)).SerializeToString()
                if end is not None:
                    done = True
                    result, error = end
                    if isinstance(error, DecodeError):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
                    if error is not None:
                        await context.abort(grpc.StatusCode.INTERNAL, str(error))
                    assert result is not None, "the loop ends a request with a result or an error"
                    yield pb.GenerateReply(result=result_message(result)).SerializeToString()
        finally:
            if not done:  # cancelled, or the client went away: nobody reads the rest
                self.serving.cancel(ticket)

    async def load(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            parse(pb.LoadRequest, raw)
        except RequestRefused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return load_message(self.serving.load).SerializeToString()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(self.generate, None, None),
            "Load": grpc.unary_unary_rpc_method_handler(self.load, None, None),
        })


def _outside_tenants(request: DecodeRequest) -> str | None:
    """Why the caller's token may not generate in the request's namespace; None if it may (or no tokens)."""
    principal = current_principal()
    if principal is None or principal.tenants is None or not isinstance(request.prompt, PrefillRequest):
        return None  # without a store a request reads and writes no tenant's blocks
    if request.prompt.tenant_digest() in principal.tenants:
        return None
    return f"token {principal.name!r} may not reach this tenant"

