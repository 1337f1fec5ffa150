"""One daemon as the client sees it: a gRPC channel, its calls, and whether it is up.

A daemon that fails a call (unreachable, deadline passed, overloaded) is marked down for a backoff
period, during which calls to it are skipped without waiting; the first call after the backoff is the
probe. gRPC reconnects the channel underneath, so a daemon that returns is used again.

A daemon whose data channel refuses a call (too many connections, too many bytes in flight) is not
down: the call goes over gRPC, and so do the next ones for a backoff period.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import Executor

import grpc

from kvstore.client.config import ClientConfig
from kvstore.client.dataplane import DataChannel, TransportError
from kvstore.hostid import host_id
from kvstore.proto import method, pb
from kvstore.stats import Stats

log = logging.getLogger(__name__)

# Codes that say "this daemon cannot serve now", as opposed to "this request is wrong".
_DOWN_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
               grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class Shard:
    def __init__(self, address: str, config: ClientConfig, executor: Executor | None = None,
                 name: str | None = None) -> None:
        self.address = address  # where to connect
        self.name = name or address  # the member's name (kvstore/client/membership.py): what TLS verifies
        self.config = config
        self._executor = executor  # where blocking probes run (None: the event loop's default executor)
        # A member found by SRV is connected to at the address its name resolved to, and TLS checks the name.
        self.server_name = config.tls_server_name or (_host(self.name) if self.name != address else None)
        self.channel = open_channel(address, config, self.server_name)
        self.metadata = config.metadata
        self._data_tls = data_tls(config)
        self._lookup = self.channel.unary_unary(method("Lookup"), pb.LookupRequest.SerializeToString,
                                                pb.LookupResponse.FromString)
        self._get = self.channel.unary_stream(method("Get"), pb.GetRequest.SerializeToString, None)
        self._put = self.channel.stream_unary(method("Put"), None, pb.PutResponse.FromString)
        self._touch = self.channel.unary_unary(method("Touch"), pb.KeysRequest.SerializeToString,
                                               pb.CountResponse.FromString)
        self._delete = self.channel.unary_unary(method("Delete"), pb.KeysRequest.SerializeToString,
                                                pb.CountResponse.FromString)
        self._advise = self.channel.unary_unary(method("Advise"), pb.AdviseRequest.SerializeToString,
                                                pb.CountResponse.FromString)
        self._stats = self.channel.unary_unary(method("Stats"), pb.StatsRequest.SerializeToString,
                                               pb.StatsResponse.FromString)
        self._info = self.channel.unary_unary(method("Info"), pb.InfoRequest.SerializeToString,
                                              pb.InfoResponse.FromString)
        self._data: DataChannel | None = None
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
        """Record a failed call; mark the daemon down if the failure was the daemon's, not the request's."""
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

    async def data_channel(self) -> DataChannel | None:
        """The daemon's data channel, asked for once; None for gRPC-only transport, and for a while after
        the data channel refused a call.

        On the daemon's host (same host_id, and its Unix socket can be connected to) the channel runs on
        the Unix socket, where buffers can be lent; elsewhere, or with shared_memory "off", on TCP."""
        if self.config.transport == "grpc" or time.monotonic() < self._data_refused_until:
            return None
        if not self._data_checked:
            info = await self._info(pb.InfoRequest(), timeout=self.config.lookup_timeout_s, metadata=self.metadata)
            host = self.address.rpartition(":")[0].strip("[]")
            mode = self.config.shared_memory
            local = info.data_socket and (mode == "on" or (mode == "auto" and info.host_id == host_id() != ""))
            security = dict(tls=self._data_tls, server_name=self.server_name, token=self.config.token)
            if local and await asyncio.get_running_loop().run_in_executor(
                    self._executor, _connectable, info.data_socket, self.config.lookup_timeout_s):
                self._data = DataChannel(host, info.data_port, unix_path=info.data_socket, **security)
            else:
                self._data = DataChannel(host, info.data_port, **security) if info.data_port else None
            self._data_checked = True
        return self._data

    def known_data_channel(self) -> DataChannel | None:
        """The data channel if it is already known, usable and the daemon is up; never blocks."""
        usable = self._data_checked and self.up and time.monotonic() >= self._data_refused_until
        return self._data if usable else None

    def data_refused(self, error: TransportError) -> None:
        """The data channel refused a call that gRPC will carry: use gRPC for a while. The daemon is not down."""
        self._data_refused_until = time.monotonic() + self.config.down_backoff_s
        if error.code == "UNAVAILABLE":
            self._forget_data_channel()  # a restarted daemon may serve it elsewhere; ask Info again

    def _forget_data_channel(self) -> None:
        if self._data is not None:
            self._data.close()
        self._data, self._data_checked = None, False

    async def lookup(self, keys: list[bytes]) -> int:
        response = await self._lookup(pb.LookupRequest(keys=keys), timeout=self.config.lookup_timeout_s,
                                      metadata=self.metadata)
        return response.hits

    async def present(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is stored, each on its own (a daemon that predates the question answers for the
        leading run only, which is then all it is taken to say)."""
        response = await self._lookup(pb.LookupRequest(keys=keys, each=True), timeout=self.config.lookup_timeout_s,
                                      metadata=self.metadata)
        if len(response.present) == len(keys):
            return [bool(b) for b in response.present]
        return [i < response.hits for i in range(len(keys))]

    def get(self, request: pb.GetRequest) -> AsyncIterator[bytes]:
        return self._get(request, timeout=self.config.timeout_s, metadata=self.metadata)

    async def put(self, messages: Iterable[bytes]) -> list[int]:
        response = await self._put(iter(messages), timeout=self.config.timeout_s, metadata=self.metadata)
        return list(response.results)

    async def touch(self, keys: list[bytes], traffic_class: str) -> int:
        response = await self._touch(pb.KeysRequest(keys=keys, traffic_class=traffic_class),
                                     timeout=self.config.lookup_timeout_s, metadata=self.metadata)
        return response.count

    async def delete(self, keys: list[bytes]) -> int:
        response = await self._delete(pb.KeysRequest(keys=keys), timeout=self.config.lookup_timeout_s,
                                      metadata=self.metadata)
        return response.count

    async def advise(self, keys: list[bytes], continues: bool) -> int:
        request = pb.AdviseRequest(keys=keys, continues=continues)
        return (await self._advise(request, timeout=self.config.lookup_timeout_s, metadata=self.metadata)).count

    async def stats(self) -> Stats:
        response = await self._stats(pb.StatsRequest(), timeout=self.config.lookup_timeout_s, metadata=self.metadata)
        return Stats.from_pb(response)

    async def close(self) -> None:
        self._forget_data_channel()
        await self.channel.close()


def open_channel(address: str, config: ClientConfig, server_name: str | None = None) -> grpc.aio.Channel:
    """A gRPC channel to one daemon: TLS (mutual, with a client certificate) where the config says so;
    `server_name`: the name its certificate must carry, if not `address`'s host."""
    options = [
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
    if server_name or config.tls_server_name:
        options.append(("grpc.ssl_target_name_override", server_name or config.tls_server_name))
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
