"""The client end of a daemon's bulk data channel (kvstore/wire.py): blocking sockets, a small pool.

Calls run on worker threads (the socket calls release the GIL), so shards are read in parallel and
each payload is received with recv_into straight into its destination buffer.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable, Sequence

from kvstore import wire
from kvstore.proto import pb


class TransportError(Exception):
    """A data-channel call failed; `code` is a gRPC status code name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# head -> (where its payload goes, the chunk size to hand over as it arrives), or None to drop it.
PartSink = Callable[[pb.GetPartHead], "tuple[memoryview, int] | None"]
# (head, offset of the chunk in the part, the chunk): called as each chunk lands, so checking it
# overlaps receiving the next one.
ChunkDone = Callable[[pb.GetPartHead, int, memoryview], None]


class DataChannel:
    def __init__(self, host: str, port: int, pool_size: int = 8) -> None:
        self.host, self.port = host, port
        self._idle: list[socket.socket] = []
        self._pool_size = pool_size
        self._lock = threading.Lock()

    def get(self, request: pb.GetRequest, sink: PartSink, done: ChunkDone, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._connection(deadline) as sock:
            _send(sock, wire.frame(wire.GET, request.SerializeToString()), deadline)
            scratch = bytearray(0)
            while True:
                kind, head = self._read_frame(sock, deadline)
                if kind == wire.DONE:
                    return
                if kind != wire.PART:
                    raise TransportError("INTERNAL", f"unexpected frame kind {kind} in a Get")
                part = pb.GetPartHead.FromString(head)
                if part.status != pb.OK or not part.payload_bytes:
                    sink(part)
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

    def put(self, records: Sequence[tuple[bytes, bytes]], timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        with self._connection(deadline) as sock:
            try:
                for header, payload in records:
                    head = pb.PutHead(record_bytes=len(header) + len(payload)).SerializeToString()
                    _send(sock, wire.frame(wire.PUT, head) + header, deadline)
                    _send(sock, payload, deadline)
                _send(sock, wire.frame(wire.PUT_END), deadline)
            except OSError as exc:  # the daemon may have refused and closed: its ERROR frame says why
                try:
                    self._read_frame(sock, deadline)
                except TransportError:
                    raise
                except Exception:
                    pass
                raise TransportError("UNAVAILABLE", f"sending to {self.host}:{self.port} failed: {exc}") from exc
            kind, head = self._read_frame(sock, deadline)
            if kind != wire.PUT_RESULT:
                raise TransportError("INTERNAL", f"unexpected frame kind {kind} after a Put")
            return list(pb.PutResponse.FromString(head).results)

    # -- plumbing -----------------------------------------------------------------------------------

    def _read_frame(self, sock: socket.socket, deadline: float) -> tuple[int, bytes]:
        prefix = bytearray(wire.PREFIX.size)
        _recv_exact(sock, memoryview(prefix), deadline)
        try:
            kind, head_len = wire.parse_prefix(prefix)
        except wire.FrameError as exc:
            raise TransportError("INTERNAL", str(exc)) from None
        head = bytearray(head_len)
        _recv_exact(sock, memoryview(head), deadline)
        if kind == wire.ERROR:
            error = pb.DataError.FromString(bytes(head))
            raise TransportError(error.code or "UNKNOWN", error.message)
        return kind, bytes(head)

    def _connection(self, deadline: float) -> "_Lease":
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(deadline - time.monotonic(), 0.01))
            except OSError as exc:
                raise TransportError("UNAVAILABLE", f"cannot connect to {self.host}:{self.port}: {exc}") from exc
            wire.tune(sock)
        return _Lease(self, sock)

    def _release(self, sock: socket.socket, reusable: bool) -> None:
        with self._lock:
            if reusable and len(self._idle) < self._pool_size:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


class _Lease:
    """A pooled connection for one call; returned to the pool only if the call ended cleanly."""

    def __init__(self, channel: DataChannel, sock: socket.socket) -> None:
        self.channel, self.sock = channel, sock

    def __enter__(self) -> socket.socket:
        return self.sock

    def __exit__(self, exc_type, exc, tb) -> None:
        self.channel._release(self.sock, reusable=exc_type is None)
        if isinstance(exc, (OSError, EOFError)) and not isinstance(exc, TransportError):
            raise TransportError("UNAVAILABLE", f"{self.channel.host}:{self.channel.port}: {exc}") from exc


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    while len(view):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransportError("DEADLINE_EXCEEDED", "data channel call passed its deadline")
        sock.settimeout(remaining)
        try:
            received = sock.recv_into(view)
        except socket.timeout:
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
    except socket.timeout:
        raise TransportError("DEADLINE_EXCEEDED", "data channel call passed its deadline") from None
