"""The client end of a daemon's bulk data channel (kvstore/wire.py): blocking sockets, a small pool.

Calls run on worker threads (the socket calls release the GIL), so shards are read in parallel and
each payload is received with recv_into straight into its destination buffer.

On the daemon's own host the channel runs on the daemon's Unix socket, and a client can lend the daemon
memory (SharedBuffer, registered on every pooled connection): a Get whose destinations lie in it is
answered by the daemon writing the payloads straight into place, from its DRAM tier or its segment
files, and only part heads cross the socket. The memory is a memfd sealed against shrinking, passed by
descriptor: it has no name anyone else could open, and a daemon drops its mapping when the connection
closes, so nothing outlives a client that dies.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore import wire
from kvstore.eviction import ReuseHint
from kvstore.proto import pb


class TransportError(Exception):
    """A data-channel call failed; `code` is a gRPC status code name. `refused`: the daemon's data channel
    did nothing of the call (it could not be reached, or refused the connection at its limits), so the
    call may go over gRPC instead."""

    def __init__(self, code: str, message: str, refused: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.refused = refused


# head -> (where its payload goes, the chunk size to hand over as it arrives), or None to drop it.
PartSink = Callable[[pb.GetPartHead], "tuple[memoryview, int] | None"]
# (head, offset of the chunk in the part, the chunk): called as each chunk lands, so checking it
# overlaps receiving the next one.
ChunkDone = Callable[[pb.GetPartHead, int, memoryview], None]


class DataChannel:
    """Connections to one daemon's data channel: its TCP port, or its Unix socket (`unix_path`) on the same
    host, where it can be lent shared buffers."""

    def __init__(self, host: str, port: int, pool_size: int = 8, unix_path: str | None = None,
                 tls: ssl.SSLContext | None = None, server_name: str | None = None, token: str | None = None) -> None:
        self.host, self.port = host, port
        self.unix_path = unix_path
        self.tls, self.server_name = tls, server_name or host  # TLS on TCP; the Unix socket is this host's own
        self.token = token  # sent in an AUTH frame first on every connection
        self._idle: list[_Connection] = []
        self._pool_size = pool_size
        self._lock = threading.Lock()

    @property
    def same_host(self) -> bool:
        return self.unix_path is not None

    @property
    def address(self) -> str:
        return self.unix_path or f"{self.host}:{self.port}"

    def get(self, request: pb.GetRequest, sink: PartSink, done: ChunkDone, timeout_s: float,
            shared: SharedPlacement | None = None) -> None:
        """Stream a Get. With `shared` (where each key's layers lie in a buffer lent to this daemon), the
        daemon writes straight into the caller's memory and only heads come over the socket."""
        deadline = time.monotonic() + timeout_s
        with self._connection(deadline) as connection:
            sock = connection.sock
            lent = connection.lent.get(id(shared.buffer)) if shared else None
            if shared is not None and lent is not None:
                request = _copy(request)
                request.region_id = lent
                request.region_offsets.extend(shared.offsets)
                request.region_layer_stride = shared.layer_stride
                connection.reading = shared.buffer.view
            _send(sock, wire.frame(wire.GET, request.SerializeToString()), deadline)
            scratch = bytearray(0)
            while True:
                kind, head = read_frame(sock, deadline)
                if kind == wire.DONE:
                    return
                if kind != wire.PART:
                    raise TransportError("INTERNAL", f"unexpected frame kind {kind} in a Get")
                part = pb.GetPartHead.FromString(head)
                if part.status != pb.OK or not part.payload_bytes:
                    sink(part)
                    continue
                if part.in_region:
                    connection.from_region(part, sink, done)
                    continue
                wanted = sink(part)
                if wanted is None:  # nobody wants it: read it anyway to keep the stream in step
                    if len(scratch) < part.payload_bytes:
                        scratch = bytearray(part.payload_bytes)
                    _recv_exact(sock, memoryview(scratch)[: part.payload_bytes], deadline)
                    continue
                target, step = wanted
                if len(target) != part.payload_bytes:
                    raise TransportError("INTERNAL", "payload size differs from its destination")
                for start in range(0, len(target), step):
                    chunk = target[start : start + step]
                    _recv_exact(sock, chunk, deadline)
                    done(part, start, chunk)

    def put(self, records: Sequence[tuple[bytes, bytes]], timeout_s: float, hint: ReuseHint | None = None) -> list[int]:
        deadline = time.monotonic() + timeout_s
        with self._connection(deadline) as connection:
            sock = connection.sock
            try:
                for header, payload in records:
                    _send(sock, wire.frame(wire.PUT, put_head(len(header) + len(payload), hint)) + header, deadline)
                    _send(sock, payload, deadline)
                _send(sock, wire.frame(wire.PUT_END), deadline)
            except OSError as exc:  # the daemon may have refused and closed: its ERROR frame says why
                try:
                    read_frame(sock, deadline)
                except TransportError:
                    raise
                except Exception:  # noqa: BLE001 - no ERROR frame to read: report the send failure
                    pass
                raise TransportError("UNAVAILABLE", f"sending to {self.address} failed: {exc}") from exc
            kind, head = read_frame(sock, deadline)
            if kind != wire.PUT_RESULT:
                raise TransportError("INTERNAL", f"unexpected frame kind {kind} after a Put")
            return list(pb.PutResponse.FromString(head).results)

    def _connection(self, deadline: float) -> _Lease:
        while True:
            with self._lock:
                connection = self._idle.pop() if self._idle else None
            if connection is None or not connection.dropped():
                break
            connection.close()  # the daemon closed it while it was idle (its idle timeout)
        if connection is None:
            connection = _Connection(self._connect(deadline))
        return _Lease(self, connection)

    def _connect(self, deadline: float) -> socket.socket:
        timeout_s = max(deadline - time.monotonic(), 0.01)
        try:
            if self.unix_path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(timeout_s)
                    sock.connect(self.unix_path)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
            wire.tune(sock)
            if self.tls is not None and self.unix_path is None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.server_name)
        except ssl.SSLError as exc:  # the daemon's certificate is not trusted, or it refused ours
            sock.close()
            raise TransportError("UNAVAILABLE", f"TLS with {self.address} failed: {exc}") from exc
        except OSError as exc:
            raise TransportError("UNAVAILABLE", f"cannot connect to {self.address}: {exc}", refused=True) from exc
        if self.token is not None:
            try:
                _send(sock, wire.frame(wire.AUTH, pb.DataAuth(token=self.token).SerializeToString()), deadline)
                kind, _ = read_frame(sock, deadline)
            except BaseException:
                sock.close()
                raise
            if kind != wire.AUTHED:
                sock.close()
                raise TransportError("INTERNAL", f"unexpected frame kind {kind} after AUTH")
        return sock

    def _release(self, connection: _Connection, reusable: bool) -> None:
        with self._lock:
            if reusable and len(self._idle) < self._pool_size:
                self._idle.append(connection)
                return
        connection.close()

    def adopt(self, buffer: SharedBuffer, timeout_s: float) -> None:
        """Lend `buffer` to the daemon on every pooled connection (opening the pool now)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            idle, self._idle = self._idle, []
        try:
            while len(idle) < self._pool_size:
                idle.append(self._connection(deadline).connection)
            for connection in idle:
                if id(buffer) not in connection.lent:
                    connection.lent[id(buffer)] = connection.register(buffer, deadline)
        finally:
            for connection in idle:
                self._release(connection, reusable=True)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class SharedBuffer:
    """Memory of this client that daemons on its host write into directly (3FS's USRBIO idea).

    Get into views of it (`KVClient.shared_buffer`) and the payloads land there with no copy on this
    side. It is an anonymous memfd, sealed so that it can neither shrink (a daemon writing into pages
    that are gone would die of SIGBUS, so daemons refuse memory without this seal) nor grow; daemons get
    it by descriptor over their Unix socket, and it is freed when the last mapping goes.
    """

    SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

    def __init__(self, nbytes: int) -> None:
        self.size = nbytes
        self.fd = os.memfd_create(f"kvstore-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, self.SEALS)
            self.mapping = mmap.mmap(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.mapping)
        self.view[:: mmap.PAGESIZE] = bytes(len(range(0, nbytes, mmap.PAGESIZE)))  # fault it in now
        self.base = np.frombuffer(self.view, dtype=np.uint8).ctypes.data

    def offset_of(self, buffer) -> int | None:
        """Where `buffer` lies in this shared buffer, or None if it lies elsewhere."""
        view = memoryview(buffer).cast("B")
        if not len(view):
            return None
        offset = np.frombuffer(view, dtype=np.uint8).ctypes.data - self.base
        return offset if 0 <= offset and offset + len(view) <= self.size else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.view.release()
        try:
            self.mapping.close()
        except BufferError:  # a view of it is still referenced somewhere: unmapped when that goes
            pass


@dataclass(frozen=True, slots=True)
class SharedPlacement:
    """Where a Get's keys go in a shared buffer: each key's first layer, and the step between layers."""

    buffer: SharedBuffer
    offsets: list[int]
    layer_stride: int = 0  # 0: a key's layers are packed one after the other


class _Connection:
    """A socket to the daemon's data port, and the shared-memory region it lends, if any."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lent: dict[int, int] = {}  # id(SharedBuffer) -> its region id on this connection
        self.reading: memoryview | None = None  # the shared buffer the current Get writes into

    def register(self, buffer: SharedBuffer, deadline: float) -> int:
        """Lend `buffer` to the daemon for this connection: the frame, then its descriptor in a 1-byte
        message of its own (the daemon reads that one byte with recvmsg)."""
        _send(self.sock, wire.frame(wire.REGISTER, pb.RegisterRegion(size=buffer.size).SerializeToString()), deadline)
        socket.send_fds(self.sock, [b"\0"], [buffer.fd])
        kind, answer = read_frame(self.sock, deadline)
        if kind != wire.REGISTERED:
            raise TransportError("INTERNAL", f"unexpected frame kind {kind} after REGISTER")
        return pb.RegionRegistered.FromString(answer).region_id

    def from_region(self, part: pb.GetPartHead, sink: PartSink, done: ChunkDone) -> None:
        """A part the daemon wrote into shared memory: verify it in place (or copy it where it is wanted)."""
        region = self.reading
        if region is None or part.region_offset + part.payload_bytes > len(region):
            raise TransportError("INTERNAL", "the daemon named bytes outside the region")
        wanted = sink(part)
        if wanted is None:
            return
        target, step = wanted
        with region[part.region_offset : part.region_offset + part.payload_bytes] as source:
            in_place = address_of(source) == address_of(target)  # written straight into its destination
            for start in range(0, len(target), step):
                chunk = target[start : start + step]
                if not in_place:
                    chunk[:] = source[start : start + len(chunk)]
                done(part, start, chunk)

    def dropped(self) -> bool:
        """Whether the daemon closed this idle connection (or sent on it unasked): not to be reused."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        self.sock.close()
        self.reading = None


class _Lease:
    """A pooled connection for one call; returned to the pool only if the call ended cleanly."""

    def __init__(self, channel: DataChannel, connection: _Connection) -> None:
        self.channel, self.connection = channel, connection

    def __enter__(self) -> _Connection:
        return self.connection

    def __exit__(self, exc_type, exc, tb) -> None:
        self.channel._release(self.connection, reusable=exc_type is None)
        if isinstance(exc, (OSError, EOFError)) and not isinstance(exc, TransportError):
            raise TransportError("UNAVAILABLE", f"{self.channel.address}: {exc}") from exc


def put_head(record_bytes: int, hint: ReuseHint | None) -> bytes:
    """A record's PutHead, the same on both transports."""
    head = pb.PutHead(record_bytes=record_bytes)
    if hint is not None:
        head.request_hit_blocks, head.request_blocks = min(hint.hit_blocks, hint.blocks), hint.blocks
        head.request_turn = hint.turn
    return head.SerializeToString()


def read_frame(sock: socket.socket, deadline: float) -> tuple[int, bytes]:
    prefix = bytearray(wire.PREFIX.size)
    _recv_exact(sock, memoryview(prefix), deadline)
    try:
        kind, head_len = wire.parse_prefix(memoryview(prefix))
    except wire.FrameError as exc:
        raise TransportError("INTERNAL", str(exc)) from None
    head = bytearray(head_len)
    _recv_exact(sock, memoryview(head), deadline)
    if kind == wire.ERROR:
        error = pb.DataError.FromString(bytes(head))
        raise TransportError(error.code or "UNKNOWN", error.message, error.connection_refused)
    return kind, bytes(head)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    while len(view):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransportError("DEADLINE_EXCEEDED", "data channel call passed its deadline")
        sock.settimeout(remaining)
        try:
            received = sock.recv_into(view)
        except TimeoutError:
            raise TransportError("DEADLINE_EXCEEDED", "data channel call passed its deadline") from None
        if received == 0:
            raise TransportError("UNAVAILABLE", "the daemon closed the connection")
        view = view[received:]


def _send(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransportError("DEADLINE_EXCEEDED", "data channel call passed its deadline")
    sock.settimeout(remaining)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise TransportError("DEADLINE_EXCEEDED", "data channel call passed its deadline") from None


def address_of(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def _copy(request: pb.GetRequest) -> pb.GetRequest:
    copied = pb.GetRequest()
    copied.CopyFrom(request)
    return copied
