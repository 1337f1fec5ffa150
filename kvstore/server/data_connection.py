"""One data-channel connection as the daemon reads it: memory held only for bytes that arrived, every
wait bounded, and the same interface over a plain socket (TCP or Unix) and over TLS.

Bytes read are charged to a daemon-wide FrameBudget until the frame they belong to is finished, so
unfinished frames from all clients together never hold more than `max_unfinished_frame_bytes`.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import ssl
import struct
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from kvstore import wire
from kvstore.record import RecordBytes
from kvstore.server.requests import RequestError

# Memory is taken at most this far ahead of the bytes that arrived: a head or record header grows by at
# most this much per read; a payload up to this size gets a plain buffer, a larger one a mapping.
READ_STEP = 256 * 1024
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11 lacks the name
# What a send enters while it waits for the client to make room (GetsInFlight.waiting_on_client for a Get)
Blocked = Callable[[], AbstractContextManager[object]]
POPULATE_STEP = 1 << 20  # bytes of a fresh mapping faulted in ahead of the bytes arriving into it


def populate(mapping: mmap.mmap, start: int, length: int) -> None:
    """Fault in `length` bytes of a fresh anonymous mapping from `start` (page-aligned) in one call:
    ~0.2 ms per MiB here, where the first touch of each 4 KiB page costs ~0.6 ms per MiB. Best effort:
    an older kernel just takes the faults."""
    try:
        mapping.madvise(MADV_POPULATE_WRITE, start, min(length, len(mapping) - start))
    except OSError:
        pass


class Closed(Exception):
    """The peer went away, or stayed silent past its timeout."""


class FrameBudget:
    """Bytes held daemon-wide for frames still arriving (heads, record headers, record payloads)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, nbytes: int) -> None:
        if self.used + nbytes > self.limit:
            raise RequestError(f"the daemon already holds {self.used} bytes of unfinished frames (limit "
                               f"max_unfinished_frame_bytes = {self.limit}); retry later", exhausted=True)
        self.used += nbytes

    def give(self, nbytes: int) -> None:
        self.used -= nbytes


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is at the other end: what per-peer limits count, and whether it is proven to be on this host."""

    key: str  # "tcp:<address>" or "unix:uid=<uid>"
    local: bool  # connected through the Unix socket
    pid: int = 0  # SO_PEERCRED of a Unix-socket peer
    uid: int = -1
    gid: int = -1

    @staticmethod
    def of(sock: socket.socket) -> Peer:
        if sock.family == socket.AF_UNIX:
            ucred = struct.Struct("3i")
            pid, uid, gid = ucred.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, ucred.size))
            return Peer(f"unix:uid={uid}", True, pid, uid, gid)
        return Peer(f"tcp:{sock.getpeername()[0]}", False)


class Connection:
    """One client's connection. Every read goes through `_read_into` (after `_ready`), every write through
    `send`: a TLS stream slots in by replacing those; `receive_fd` exists only on the Unix socket.

    Bytes read are charged to the daemon-wide FrameBudget until `release` (at the end of each frame).
    Deadlines are in the event loop's clock."""

    def __init__(self, sock: socket.socket, peer: Peer, budget: FrameBudget, frame_timeout_s: float,
                 idle_timeout_s: float) -> None:
        self.sock, self.peer, self.budget = sock, peer, budget
        self.frame_timeout_s, self.idle_timeout_s = frame_timeout_s, idle_timeout_s
        self.held = 0
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()

    # -- the transport ------------------------------------------------------------------------------

    def _read_into(self, view: memoryview) -> int:
        """Bytes already arrived, up to len(view) (> 0); 0 when none yet. Closed at the end of the stream."""
        try:
            received = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return 0
        if received == 0:
            raise Closed()
        return received

    async def _ready(self, deadline: float) -> None:
        """Until bytes can be read; Closed past `deadline`."""
        await self._wait(self._loop.add_reader, self._loop.remove_reader, deadline)

    async def send(self, data: RecordBytes, while_blocked: Blocked = nullcontext) -> None:
        """Send it all; Closed if the client takes none of it for `data_frame_timeout_s` (a stuck reader).
        Each wait for the client to make room is inside `while_blocked()`."""
        view = memoryview(data).cast("B")
        deadline = self._loop.time() + self.frame_timeout_s
        while len(view):
            try:
                sent = self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                with while_blocked():
                    await self._wait(self._loop.add_writer, self._loop.remove_writer, deadline)
                deadline = self._loop.time() + self.frame_timeout_s
                continue
            view = view[sent:]

    async def receive_fd(self) -> int:
        """The descriptor passed (SCM_RIGHTS) in the 1-byte message of its own that follows a REGISTER frame.

        recvmsg reads just that byte, so the frames around it, read with plain recv, never swallow it."""
        deadline = self._loop.time() + self.frame_timeout_s
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, 1, 1)
                break
            except (BlockingIOError, InterruptedError):
                await self._ready(deadline)
        if not data:
            raise Closed()
        if flags & socket.MSG_CTRUNC or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RequestError("REGISTER must be followed by a 1-byte message carrying exactly one file "
                               "descriptor (SCM_RIGHTS): the memory to lend")
        return fds[0]

    async def _wait(self, add, remove, deadline: float) -> None:
        waiter = self._loop.create_future()
        add(self._fd, _settle, waiter, True)
        timer = self._loop.call_at(deadline, _settle, waiter, False)
        try:
            ready = await waiter
        finally:
            remove(self._fd)
            timer.cancel()
        if not ready:
            raise Closed()

    def close(self) -> None:
        self.release()
        self.sock.close()

    # -- reading frames -----------------------------------------------------------------------------

    def hold(self, nbytes: int) -> None:
        """Charge memory held for this connection's unfinished frame; RequestError (exhausted) past the limit."""
        self.budget.take(nbytes)
        self.held += nbytes

    def release(self) -> None:
        """The frame is finished (or abandoned): its memory no longer counts as unfinished."""
        self.budget.give(self.held)
        self.held = 0

    async def read_into(self, view: memoryview, idle: bool = False, charge: bool = True) -> None:
        """Fill `view` as bytes arrive. `idle`: waiting for a frame to begin, so the idle timeout applies
        until its first byte, then the frame timeout."""
        deadline = self._loop.time() + (self.idle_timeout_s if idle else self.frame_timeout_s)
        while len(view):
            received = self._read_into(view)
            if not received:
                await self._ready(deadline)
                continue
            if charge:
                self.hold(received)
            if idle:
                idle, deadline = False, self._loop.time() + self.frame_timeout_s  # a frame has begun
            view = view[received:]

    async def read(self, nbytes: int, idle: bool = False) -> bytes:
        """`nbytes` bytes (a prefix, a head, a record header), in memory that grows only as they arrive:
        a declared length costs nothing until the bytes are here.

        Beyond READ_STEP they land in an anonymous mapping, whose pages exist once written and go back to
        the OS when it is freed: the allocator keeps what it frees (main.tune_allocator), so a flood of
        abandoned large heads would otherwise stay in the daemon's heap."""
        if nbytes <= wire.PREFIX.size:
            buffer = bytearray(nbytes)
            await self.read_into(memoryview(buffer), idle)
            return bytes(buffer)
        if nbytes > READ_STEP:
            mapping = mmap.mmap(-1, nbytes)
            await self.read_into(memoryview(mapping))
            return mapping[:]
        deadline = self._loop.time() + self.frame_timeout_s
        chunks: list[bytes] = []
        have = 0
        while have < nbytes:
            step = bytearray(min(nbytes - have, READ_STEP))  # freed at once if nothing has arrived
            received = self._read_into(memoryview(step))
            if not received:
                await self._ready(deadline)
                continue
            self.hold(received)
            del step[received:]
            chunks.append(bytes(step))
            have += received
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _settle(waiter: asyncio.Future, ready: bool) -> None:
    if not waiter.done():
        waiter.set_result(ready)




class TlsConnection(Connection):
    """A TCP connection after a TLS handshake: the same frames, read and sent through the TLS layer.

    A read may find bytes the TLS layer already decrypted, so `_ready` is only awaited after a read found
    none; a read or write the TLS layer cannot finish yet waits for the socket and tries again."""

    @classmethod
    async def accept(cls, sock: socket.socket, context: ssl.SSLContext, peer: Peer, budget: FrameBudget,
                     frame_timeout_s: float, idle_timeout_s: float) -> TlsConnection:
        """Handshake within the frame timeout; Closed if the client does not complete it."""
        tls = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        connection = cls(tls, peer, budget, frame_timeout_s, idle_timeout_s)
        deadline = connection._loop.time() + frame_timeout_s
        while True:
            try:
                tls.do_handshake()
                return connection
            except ssl.SSLWantReadError:
                await connection._ready(deadline)
            except ssl.SSLWantWriteError:
                await connection._wait(connection._loop.add_writer, connection._loop.remove_writer, deadline)
            except (ssl.SSLError, OSError) as exc:  # not TLS, an untrusted certificate, a reset
                tls.close()
                raise Closed() from exc

    def _read_into(self, view: memoryview) -> int:
        try:
            received = self.sock.recv_into(view)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
            return 0
        except ssl.SSLError as exc:
            raise Closed() from exc
        if received == 0:
            raise Closed()
        return received

    async def send(self, data: RecordBytes, while_blocked: Blocked = nullcontext) -> None:
        view = memoryview(data).cast("B")
        deadline = self._loop.time() + self.frame_timeout_s
        while len(view):
            try:
                sent = self.sock.send(view[: 1 << 20])  # a TLS record layer write of bounded size
            except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                with while_blocked():
                    await self._wait(self._loop.add_writer, self._loop.remove_writer, deadline)
                deadline = self._loop.time() + self.frame_timeout_s
                continue
            except ssl.SSLWantReadError:
                with while_blocked():
                    await self._ready(deadline)
                continue
            except ssl.SSLError as exc:
                raise Closed() from exc
            view = view[sent:]

    async def receive_fd(self) -> int:
        raise RequestError("file descriptors travel only over the Unix socket")
