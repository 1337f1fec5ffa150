"""What one caller may hold of the daemon at once: call slots and bytes, bounded daemon-wide and per principal.

A principal is who the limits count: a token's name where tokens are on, else the peer's address (or,
on the Unix socket, its user). One tenant holding everything it is allowed still leaves the rest to
the others (docs/design.md section 10, invariant 6). The health check is never counted, so a probe
answers whatever the tenants hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

import grpc

from kvstore.server.config import ServerConfig
from kvstore.server.grpc_auth import OPEN_METHODS, around, current_principal
from kvstore.server.requests import RequestError

log = logging.getLogger(__name__)
WARN_EVERY_S = 10


class TimedOut(RequestError):
    """A client stalled past a server-side timeout; its stream is ended."""

    @property
    def code(self) -> str:
        return "DEADLINE_EXCEEDED"


def principal_key(principal: Any, peer_key: str) -> str:
    """Whom the per-principal limits charge: the token (by name) where there is one, else the peer."""
    return f"token:{principal.name}" if principal is not None else peer_key


def grpc_peer_key(peer: str) -> str:
    """A gRPC peer ("ipv4:10.0.0.7:53211", "ipv6:[::1]:53211") as the data channel names one ("tcp:10.0.0.7"),
    so that a peer's share is the same whichever transport it uses."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = address.rpartition(":")[0] or address
        return "tcp:" + host.strip("[]")
    return peer


def grpc_caller(context: grpc.aio.ServicerContext) -> str:
    """The principal key of the gRPC call being served (call it inside the handler, after authentication)."""
    return principal_key(current_principal(), grpc_peer_key(context.peer() or ""))


class ByteBudget:
    """Bytes held at once for callers (records being put, messages being sent), bounded daemon-wide and for
    each principal, so one principal can never take what the others need. A reservation is whole or none:
    no caller holds part of one while it waits for the rest, so waiters cannot deadlock each other."""

    def __init__(self, limit: int, per_principal: int | None = None, what: str = "bytes of puts in flight",
                 settings: str = "max_inflight_put_bytes") -> None:
        self.limit = limit
        self.per_principal = min(limit, per_principal or limit)
        self.used = 0
        self.by_principal: dict[str, int] = {}
        self.what, self.settings = what, settings
        self._changed = asyncio.Condition()

    def _fits(self, who: str, nbytes: int) -> bool:
        return self.used + nbytes <= self.limit and self.by_principal.get(who, 0) + nbytes <= self.per_principal

    async def acquire(self, nbytes: int, who: str = "", timeout_s: float = 5.0) -> None:
        """Reserve `nbytes` for `who`; RequestError (exhausted) if they do not fit within `timeout_s`."""
        async with self._changed:
            try:
                # asyncio.timeout, not wait_for: wait_for runs the wait as a task of its own, and when this call
                # is cancelled (the client leaves, the server stops) while that task is taking the lock back
                # after its timeout, this call leaves without the lock and its `async with` releases the lock of
                # whoever holds it; the task then takes the lock and never gives it back, and every later put
                # or Get waits on this budget forever (a daemon that did not stop on SIGTERM). Here the wait
                # runs in this task, and Condition.wait takes the lock back before anything is raised.
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait_for(lambda: self._fits(who, nbytes))
            except TimeoutError:
                mine = self.by_principal.get(who, 0)
                whose = (f"this caller holds {mine} of its {self.per_principal}" if mine + nbytes > self.per_principal
                         else f"the daemon holds {self.used} of {self.limit}")
                raise RequestError(f"too many {self.what}: {whose} ({self.settings}); retry later",
                                   exhausted=True) from None
            self.used += nbytes
            self.by_principal[who] = self.by_principal.get(who, 0) + nbytes

    async def release(self, nbytes: int, who: str = "") -> None:
        async with self._changed:
            self.used -= nbytes
            left = self.by_principal.get(who, 0) - nbytes
            if left > 0:
                self.by_principal[who] = left
            else:
                self.by_principal.pop(who, None)
            self._changed.notify_all()


class CallLimiter(grpc.aio.ServerInterceptor):
    """Concurrent gRPC calls, daemon-wide (`max_concurrent_rpcs`) and per principal
    (`max_concurrent_rpcs_per_principal`); a call past either is RESOURCE_EXHAUSTED at once. Per connection,
    HTTP/2 bounds the streams (`max_concurrent_rpcs_per_connection`, set on the server).

    It must come after the token interceptor in the server's list, so that the principal is known when a
    call starts. gRPC's own limit (`maximum_concurrent_rpcs`) is not used: it counts the health check too."""

    def __init__(self, config: ServerConfig) -> None:
        self.limit = config.max_concurrent_rpcs
        self.per_principal = config.max_concurrent_rpcs_per_principal
        self.active = 0
        self.by_principal: dict[str, int] = {}
        self._last_warning = 0.0

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        return around(handler, self._slot)

    @asynccontextmanager
    async def _slot(self, context):
        who = grpc_caller(context)
        refusal = self._refusal(who)
        if refusal:
            self._warn(refusal)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        self.active += 1
        self.by_principal[who] = self.by_principal.get(who, 0) + 1
        try:
            yield
        finally:
            self.active -= 1
            left = self.by_principal[who] - 1
            if left:
                self.by_principal[who] = left
            else:
                del self.by_principal[who]

    def _refusal(self, who: str) -> str:
        if self.active >= self.limit:
            return f"the daemon serves {self.limit} calls already (max_concurrent_rpcs); retry later"
        if self.by_principal.get(who, 0) >= self.per_principal:
            return (f"this caller has {self.per_principal} calls open already (max_concurrent_rpcs_per_principal); "
                    "finish some, or retry later")
        return ""

    def _warn(self, message: str) -> None:
        if time.monotonic() - self._last_warning >= WARN_EVERY_S:
            self._last_warning = time.monotonic()
            log.warning("refused a call: %s (further refusals in the next %d s are not logged)", message,
                        WARN_EVERY_S)
