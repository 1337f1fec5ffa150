"""A client of one decode instance: its calls as futures, from any thread.

    client = InstanceClient("127.0.0.1:PORT", token=..., tls_ca=...)     # token and TLS: as the store's client
    future = client.generate([5, 7, 9], max_tokens=8, temperature=0.8, seed=1, on_tokens=print)
    reply = future.result()           # a GenerateResult; InstanceError for a refused or failed call
    future.cancel()                   # cancels the call, and so the request on the instance (its KV freed)
    client.load()                     # the instance's Load, at once; client.instance_load(): the router's view

The calls run on an event loop thread of the client's own (one channel, any number of calls in flight),
so any thread may start, wait for or cancel them. `on_tokens` gets each Tokens message's ids, in order,
on that thread: it must not block.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import grpc

from engine.decode.router import InstanceLoad
from engine.serving.loop import Load
from engine.serving.messages import GenerateResult, load_of
from engine.serving.proto import method, pb
from kvstore.block import tenant_of
from kvstore.client.config import ClientConfig
from kvstore.client.shard import open_channel


class InstanceError(RuntimeError):
    """A call the instance refused or failed (`code`: INVALID_ARGUMENT, UNAUTHENTICATED, ...), or whose
    connection ended before its answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class InstanceClient:
    def __init__(self, address: str, *, token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_server_name: str | None = None,
                 max_message_bytes: int = 64 * 2**20) -> None:
        """`address` host:port. Token and TLS settings mean what they mean to the store's client
        (kvstore.client.ClientConfig, which checks them): a bearer token, the CA that signed the instance's
        certificate (set: TLS), a client certificate and key (mutual TLS), the name the certificate carries."""
        self.address = address
        security = ClientConfig((address,), token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                tls_server_name=tls_server_name, max_message_bytes=max_message_bytes)
        self._metadata = security.metadata
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"instance-client-{address}", daemon=True)
        self._thread.start()
        self._channel = self._run(self._open(security)).result()  # a channel belongs to its loop: made there

    async def _open(self, security: ClientConfig) -> grpc.aio.Channel:
        channel = open_channel(self.address, security)
        self._generate = channel.unary_stream(method("Generate"), pb.GenerateRequest.SerializeToString,
                                              pb.GenerateReply.FromString)
        self._load = channel.unary_unary(method("Load"), pb.LoadRequest.SerializeToString, pb.LoadReply.FromString)
        return channel

    def _run(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    # -- calls ------------------------------------------------------------------------------------------

    def generate(self, prompt: Sequence[int], max_tokens: int | None, *,
                 on_tokens: Callable[[list[int]], None] | None = None, **options: Any) -> Future[GenerateResult]:
        """Continue `prompt` for at most `max_tokens` (None: to a stop token or the model's context). `options`
        are GenerateRequest's fields: temperature, top_k, top_p, seed, stop_token_ids; with a store
        from_handoff, tenant, traffic_class, session_id (ValueError or TypeError here for one it has not), and
        `salt`, which is sent as its tenant (`generate_request`)."""
        return self._run(self._generate_call(generate_request(prompt, max_tokens, **options), on_tokens))

    async def _generate_call(self, request: pb.GenerateRequest, on_tokens) -> GenerateResult:
        call = self._generate(request, metadata=self._metadata)
        try:
            async for reply in call:
                if reply.HasField("result"):
                    return GenerateResult.of(reply.result)
                if on_tokens is not None:
                    on_tokens(list(reply.tokens.ids))
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            raise InstanceError(exc.code(), exc.details() or "") from None
        raise InstanceError(grpc.StatusCode.INTERNAL, "the stream ended without a result")

    def load_async(self) -> Future[Load]:
        return self._run(self._load_call())

    async def _load_call(self) -> Load:
        try:
            return load_of(await self._load(pb.LoadRequest(), metadata=self._metadata))
        except grpc.aio.AioRpcError as exc:
            raise InstanceError(exc.code(), exc.details() or "") from None

    def load(self, timeout_s: float = 30.0) -> Load:
        """The instance's load: its state after its last step, and the requests it has received since."""
        return self.load_async().result(timeout_s)

    def instance_load(self, timeout_s: float = 30.0) -> InstanceLoad:
        return to_instance_load(self.load(timeout_s))

    def close(self) -> None:
        """Close the channel (calls in flight end, and are cancelled on the instance) and the loop's thread."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._channel.close()).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def __enter__(self) -> InstanceClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def generate_request(prompt: Sequence[int], max_tokens: int | None, **options: Any) -> pb.GenerateRequest:
    """The GenerateRequest `InstanceClient.generate` sends. A `salt` option becomes its tenant
    (kvstore.block.tenant_of) here: the salt never leaves this process (docs/design.md section 3), and the
    instance needs only the tenant."""
    if "salt" in options:
        if "tenant" in options:
            raise ValueError("generate: give the salt or its tenant, not both")
        options["tenant"] = tenant_of(options.pop("salt"))
    length = {"to_context": True} if max_tokens is None else {"max_tokens": max_tokens}
    return pb.GenerateRequest(prompt=prompt, **length, **options)


def to_instance_load(load: Load) -> InstanceLoad:
    """The router's view of a load: requests running or queued, and the KV held plus the prompts queued
    (so a request placed a moment ago counts before the instance admits it)."""
    return InstanceLoad(running=load["running"] + load["waiting"], kv_tokens=load["kv_tokens"] + load["queued_tokens"],
                        kv_capacity=load["kv_capacity"])
