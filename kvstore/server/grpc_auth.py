"""Token authentication on the gRPC port: an interceptor, and the caller's principal for the service.

Every call but the health check must carry `authorization: Bearer <token>`. A call without a known
token ends UNAUTHENTICATED; a token without the call's verb ends PERMISSION_DENIED, before the service
sees the request. The service reads the caller's principal (its tenants) with `current_principal()`.
Other gRPC servers with the same token files (the decode instances, engine.serving) give the interceptor
the verbs of their own methods (`method_verbs`), and take their TLS credentials from `server_credentials`.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import grpc

from kvstore.proto import SERVICE
from kvstore.server.auth import Authenticator, Principal, bearer

log = logging.getLogger(__name__)

# The verb each RPC needs; "" is any authenticated caller (Info: clients need the data port and limits).
# Verify is a reader's: a client reports what its Gets found, and only blocks proven corrupt are dropped.
VERB_OF = {"Lookup": "read", "Get": "read", "Verify": "read", "Put": "write", "Touch": "write", "Advise": "write",
           "Delete": "delete", "Stats": "admin", "Info": ""}
WARN_EVERY_S = 10
OPEN_METHODS = ("/grpc.health.v1.Health/Check",)  # probes carry no token (Watch would hold a stream open)

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("kvstore_principal", default=None)


def current_principal() -> Principal | None:
    """The principal of the call being served; None where authentication is off."""
    return _principal.get()


def method_verbs(service: str, verbs: Mapping[str, str]) -> Callable[[str], str]:
    """The verb each full method name needs: of `service`'s methods, as `verbs` says ("": any authenticated
    caller), admin for a method not listed; of other services (reflection), any authenticated caller."""
    def verb(method: str) -> str:
        called, _, name = method.strip("/").partition("/")
        return verbs.get(name, "admin") if called == service else ""

    return verb


verb_of = method_verbs(SERVICE, VERB_OF)  # the daemon's


def server_credentials(cert: Path, key: Path, client_ca: Path | None = None) -> grpc.ServerCredentials:
    """TLS for a gRPC port from PEM files; with `client_ca`, clients must present a certificate it signed."""
    ca = client_ca.read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())], root_certificates=ca,
                                       require_client_auth=ca is not None)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, authenticator: Authenticator, verb_of: Callable[[str], str] = verb_of) -> None:
        self.authenticator = authenticator
        self.verb_of = verb_of
        self._last_warning = 0.0  # refusals are logged at most every WARN_EVERY_S, not once per call

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        principal = self.authenticator.authenticate(bearer(details.invocation_metadata))
        if principal is None:
            self._warn("a call to %s without a valid token was refused", details.method)
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                            "a valid token is required: send 'authorization: Bearer <token>'")
        verb = self.verb_of(details.method)
        if verb and not principal.may(verb):
            self._warn("token %r refused %s: it lacks the %r verb", principal.name, details.method, verb)
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED,
                            f"token {principal.name!r} may not {verb} ({details.method})")
        return _bound(handler, principal)


    def _warn(self, message: str, *args) -> None:
        if time.monotonic() - self._last_warning >= WARN_EVERY_S:
            self._last_warning = time.monotonic()
            log.warning(message + " (further refusals in the next %d s are not logged)", *args, WARN_EVERY_S)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `code` at once. It is request-streaming whatever the method is, so
    gRPC does not first wait for (and hold) a request message that a caller without a token may never
    finish; on the wire the two shapes are the same."""
    async def refuse(requests, context):
        await context.abort(code, details)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    return grpc.stream_stream_rpc_method_handler(refuse)


def _bound(handler: grpc.RpcMethodHandler, principal: Principal) -> grpc.RpcMethodHandler:
    """`handler` with `principal` set as the current one while it runs (each call runs in its own task)."""
    @asynccontextmanager
    async def as_principal(context):
        _principal.set(principal)
        yield

    return around(handler, as_principal)


def around(handler: grpc.RpcMethodHandler,
           scope: Callable[[Any], AbstractAsyncContextManager]) -> grpc.RpcMethodHandler:
    """`handler` run inside `scope(context)`, entered when the call starts and left when it ends, whichever
    kind it is: an async generator (messages yielded) or a coroutine (unary, or messages written)."""
    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    inner = getattr(handler, kind)
    behaviour: Callable[[Any, Any], Any]
    if inspect.isasyncgenfunction(inner):
        async def streamed(request, context):
            async with scope(context):
                async for message in inner(request, context):
                    yield message
        behaviour = streamed
    elif inspect.iscoroutinefunction(inner):
        async def awaited(request, context):
            async with scope(context):
                return await inner(request, context)
        behaviour = awaited
    else:  # a synchronous handler runs on gRPC's thread pool; this daemon registers none
        return handler
    return handler._replace(**{kind: behaviour})
