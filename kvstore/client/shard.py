"""One daemon as the client sees it: a gRPC channel, its calls, and whether it is up.

A daemon that fails a call (unreachable, deadline passed, overloaded) is marked down for a backoff
period, during which calls to it are skipped without waiting; the first call after the backoff is the
probe. gRPC reconnects the channel underneath, so a daemon that returns is used again.

A daemon whose data channel refuses a call (too many connections, too many bytes in flight) is not
down: the call goes over gRPC, and so do the next ones for a backoff period.

Its Gets and Puts travel by the transport `transport()` picks (kvstore/client/transport.py). Its other
calls never raise: a failure is counted in the ClientStats it was given and answered as "nothing there".
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

import grpc

from kvstore.client.config import ClientConfig
from kvstore.client.dataplane import DataChannel, TransportError
from kvstore.client.stats import ClientStats
from kvstore.client.transport import DataChannelTransport, GrpcTransport, SharedMemoryTransport, Transport
from kvstore.eviction import ReuseHint
from kvstore.hostid import host_id
from kvstore.proto import method, pb
from kvstore.stats import Stats

log = logging.getLogger(__name__)

T = TypeVar("T")

# Codes that say "this daemon cannot serve now", as opposed to "this request is wrong".
_DOWN_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
               grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class Shard:
    def __init__(self, address: str, config: ClientConfig, stats: ClientStats, executor: Executor | None = None,
                 name: str | None = None) -> None:
        self.address = address  # where to connect
        self.name = name or address  # the member's name (kvstore/client/membership.py): what TLS verifies
        self.config = config
        self.stats = stats  # where this daemon's failed calls, fallbacks and bytes written are counted
        self._executor = executor  # where blocking probes run (None: the event loop's default executor)
        # A member found by SRV is connected to at the address its name resolved to, and TLS checks the name.
        self.server_name = config.tls_server_name or (_host(self.name) if self.name != address else None)
        self.channel = open_channel(address, config, self.server_name)
        self.metadata = config.metadata
        self._data_tls = data_tls(config)
        self._lookup = self.channel.unary_unary(method("Lookup"), pb.LookupRequest.SerializeToString,
                                                pb.LookupResponse.FromString)
        self._touch = self.channel.unary_unary(method("Touch"), pb.KeysRequest.SerializeToString,
                                               pb.CountResponse.FromString)
        self._delete = self.channel.unary_unary(method("Delete"), pb.KeysRequest.SerializeToString,
                                                pb.CountResponse.FromString)
        self._advise = self.channel.unary_unary(method("Advise"), pb.AdviseRequest.SerializeToString,
                                                pb.CountResponse.FromString)
        self._verify = self.channel.unary_unary(method("Verify"), pb.KeysRequest.SerializeToString,
                                                pb.CountResponse.FromString)
        self._stats = self.channel.unary_unary(method("Stats"), pb.StatsRequest.SerializeToString,
                                               pb.StatsResponse.FromString)
        self._info = self.channel.unary_unary(method("Info"), pb.InfoRequest.SerializeToString,
                                              pb.InfoResponse.FromString)
        self._grpc: GrpcTransport | None = None  # made on the event loop the channel lives on
        self._data: DataChannelTransport | None = None
        self._data_checked = False
        self._data_refused_until = 0.0
        self._down_until = 0.0
        self._backoff = config.down_backoff_s
        self.last_error = ""

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def succeeded(self) -> None:
        self._backoff = self.config.down_backoff_s
        self._down_until = 0.0

    def failed(self, error: Exception) -> None:
        """Record a failed call (counted); mark the daemon down if the failure was the daemon's, not the request's."""
        self.stats.shard_errors[self.address] += 1
        if isinstance(error, grpc.RpcError):
            code, details = error.code(), error.details()
        elif isinstance(error, TransportError):
            code, details = getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNKNOWN), error.message
        else:
            code, details = None, str(error)
        self.last_error = f"{code.name if code else type(error).__name__}: {details}"
        if code is None or code in _DOWN_CODES:
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self.config.max_down_backoff_s)
            self._forget_data_channel()  # a restarted daemon may listen on another data port

    async def transport(self) -> Transport:
        """How this daemon's Gets and Puts travel now, chosen here and nowhere else: gRPC where the config
        says so ("grpc"), where the daemon offers no data channel, and for a while after its data channel
        refused a call; else its data channel, found out once (Info) — over its Unix socket with shared
        memory on the daemon's own host (same host_id, and the socket can be connected to; shared_memory
        "off" never), over TCP elsewhere."""
        if self._grpc is None:
            self._grpc = GrpcTransport(self.channel, self.config, asyncio.get_running_loop())
        if self.config.transport == "grpc" or time.monotonic() < self._data_refused_until:
            return self._grpc
        if not self._data_checked:
            info = await self._info(pb.InfoRequest(), timeout=self.config.lookup_timeout_s, metadata=self.metadata)
            host = self.address.rpartition(":")[0].strip("[]")
            mode = self.config.shared_memory
            local = info.data_socket and (mode == "on" or (mode == "auto" and info.host_id == host_id() != ""))
            if local and await asyncio.get_running_loop().run_in_executor(
                    self._executor, _connectable, info.data_socket, self.config.lookup_timeout_s):
                channel = DataChannel(host, info.data_port, unix_path=info.data_socket, tls=self._data_tls,
                                      server_name=self.server_name, token=self.config.token)
                self._data = SharedMemoryTransport(channel, self._executor, self.config.timeout_s, self._grpc,
                                                   self.data_refused)
            elif info.data_port:
                channel = DataChannel(host, info.data_port, tls=self._data_tls, server_name=self.server_name,
                                      token=self.config.token)
                self._data = DataChannelTransport(channel, self._executor, self.config.timeout_s, self._grpc,
                                                  self.data_refused)
            self._data_checked = True
        return self._data or self._grpc

    def known_transport(self) -> Transport | None:
        """The data channel's transport, if it is already known and usable and the daemon is up: one whose
        get_blocking does its socket work on the calling thread. Never blocks."""
        usable = self._data_checked and self.up and time.monotonic() >= self._data_refused_until
        return self._data if usable else None

    def known_data_channel(self) -> DataChannel | None:
        """The data channel known_transport() would use, if any."""
        data = self._data if self.known_transport() is not None else None
        return data.channel if data is not None else None

    def data_refused(self, error: TransportError) -> None:
        """The data channel refused a call that gRPC carries instead (counted): gRPC for a while. The daemon
        is not down."""
        self.stats.data_fallbacks[self.address] += 1
        self._data_refused_until = time.monotonic() + self.config.down_backoff_s
        if error.code == "UNAVAILABLE":
            self._forget_data_channel()  # a restarted daemon may serve it elsewhere; ask Info again

    def _forget_data_channel(self) -> None:
        if self._data is not None:
            self._data.channel.close()
        self._data, self._data_checked = None, False

    async def _call(self, call: Awaitable[T]) -> T | None:
        """A control call's answer; None where it failed (counted, the daemon marked down if it was its fault)."""
        try:
            answer = await call
        except grpc.RpcError as exc:
            self.failed(exc)
            return None
        self.succeeded()
        return answer

    async def put(self, records: Sequence[tuple[bytes, bytes]], hint: ReuseHint | None) -> list[int] | None:
        """Store records (header, payload) over this daemon's transport: each one's result, or None where the
        call failed (counted)."""
        try:
            transport = await self.transport()
            results = await transport.put(records, hint)
        except (grpc.RpcError, TransportError) as exc:
            self.failed(exc)
            return None
        self.succeeded()
        self.stats.bytes_written += sum(len(h) + len(p) for (h, p), r in zip(records, results) if r == pb.STORED)
        return results

    async def lookup(self, keys: Sequence[bytes], promote: bool = False) -> int:
        """How many leading keys are stored (none where the call failed); with `promote`, the daemon starts
        promoting those it holds from SSD into its DRAM tier (a daemon that predates it ignores it)."""
        answer = await self._call(self._lookup(pb.LookupRequest(keys=keys, promote=promote),
                                               timeout=self.config.lookup_timeout_s, metadata=self.metadata))
        return answer.hits if answer is not None else 0

    async def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored, each on its own (none where the call failed; a daemon that predates
        the question answers for the leading run only, which is then all it is taken to say)."""
        response = await self._call(self._lookup(pb.LookupRequest(keys=keys, each=True),
                                                 timeout=self.config.lookup_timeout_s, metadata=self.metadata))
        if response is None:
            return [False] * len(keys)
        if len(response.present) == len(keys):
            return [bool(b) for b in response.present]
        return [i < response.hits for i in range(len(keys))]

    async def touch(self, keys: Sequence[bytes], traffic_class: str) -> int:
        return await self._count(self._touch(pb.KeysRequest(keys=keys, traffic_class=traffic_class),
                                             timeout=self.config.lookup_timeout_s, metadata=self.metadata))

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await self._count(self._delete(pb.KeysRequest(keys=keys), timeout=self.config.lookup_timeout_s,
                                              metadata=self.metadata))

    async def advise(self, keys: Sequence[bytes], continues: bool) -> int:
        return await self._count(self._advise(pb.AdviseRequest(keys=keys, continues=continues),
                                              timeout=self.config.lookup_timeout_s, metadata=self.metadata))

    async def verify(self, keys: Sequence[bytes]) -> int | None:
        """Name blocks whose bytes from this daemon failed their checksums here: it checks its own copies
        and drops the corrupt ones; how many blocks had one. None where the call failed (logged at debug,
        neither counted nor marking the daemon down: a report is best effort, and a daemon that predates
        Verify answers UNIMPLEMENTED)."""
        try:
            answer = await self._verify(pb.KeysRequest(keys=keys), timeout=self.config.lookup_timeout_s,
                                        metadata=self.metadata)
        except grpc.RpcError as exc:
            log.debug("reporting %d corrupt blocks to %s failed: %s", len(keys), self.address, exc)
            return None
        return answer.count

    async def _count(self, call: Awaitable[pb.CountResponse]) -> int:
        answer = await self._call(call)
        return answer.count if answer is not None else 0

    async def server_stats(self) -> Stats | None:
        """The daemon's Stats; None where it did not answer."""
        response = await self._call(self._stats(pb.StatsRequest(), timeout=self.config.lookup_timeout_s,
                                                metadata=self.metadata))
        return Stats.from_pb(response) if response is not None else None

    async def close(self) -> None:
        self._forget_data_channel()
        await self.channel.close()


def open_channel(address: str, config: ClientConfig, server_name: str | None = None) -> grpc.aio.Channel:
    """A gRPC channel to one daemon: TLS (mutual, with a client certificate) where the config says so;
    `server_name`: the name its certificate must carry, if not `address`'s host."""
    options: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.enable_retries", 0),
    ]
    if config.tls_ca is None:
        host = address.rpartition(":")[0].strip("[]")
        if config.token and host not in ("localhost", "::1") and not host.startswith("127."):
            log.warning("sending a token to %s without TLS: anyone on the path can read it; set tls_ca", address)
        return grpc.aio.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca), private_key=_read(config.tls_key),
        certificate_chain=_read(config.tls_cert))
    if name_override := server_name or config.tls_server_name:
        options.append(("grpc.ssl_target_name_override", name_override))
    return grpc.aio.secure_channel(address, credentials, options=options)


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _connectable(path: str, timeout_s: float) -> bool:
    """Whether a Unix socket at `path` accepts connections from this process (same host, same file system)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout_s)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def data_tls(config: ClientConfig) -> ssl.SSLContext | None:
    """The TLS context of the data channel: the same CA and client certificate as the gRPC channel."""
    if config.tls_ca is None:
        return None
    context = ssl.create_default_context(cafile=config.tls_ca)
    if config.tls_cert is not None:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    return context
