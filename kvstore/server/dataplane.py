"""The daemon's bulk data channel: Get and Put in raw frames (kvstore/wire.py), on TCP and on a Unix socket.

One request at a time per connection; clients keep a few connections open. The same validation,
limits and store calls as the gRPC service; a protocol violation is answered with an ERROR frame
naming a gRPC status code, and the connection is closed.

No client can wedge or exhaust the daemon through it (DESIGN.md section 10, invariant 6):
* connections are limited in total and per peer (an address on TCP, a user on the Unix socket); the
  excess is answered RESOURCE_EXHAUSTED and closed;
* a connection silent between frames for `data_idle_timeout_s`, or stalled inside one (or in taking
  what it asked for) for `data_frame_timeout_s`, is closed;
* memory is held only for bytes that arrived, and bounded daemon-wide for frames still arriving
  (`max_unfinished_frame_bytes`): heads grow as they arrive, and a large record payload lands in a
  mapping whose pages exist only once bytes are written into them and go back to the OS when freed.

Shared memory is offered only on the Unix socket, that is to peers on this host: the client passes the
descriptor of a memfd sealed against shrinking, so a region is memory the peer holds (never an object
named by path) and no truncation can pull pages from under the daemon's mapping.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore import wire
from kvstore.eviction import ReuseHint
from kvstore.proto import pb
from kvstore.record import FIXED_HEADER_BYTES
from kvstore.server.config import ServerConfig
from kvstore.server.reads import get_parts
from kvstore.server.requests import (PermissionDenied, RequestError, check_get, check_payload, check_put_head, parse,
                                     parse_record_header, reuse_hint)
from kvstore.server.service import ByteBudget
from kvstore.server.store import BlockStore, DiskFull

log = logging.getLogger(__name__)


MAX_REGIONS_PER_CONNECTION = 4
# Memory is taken at most this far ahead of the bytes that arrived: a head or record header grows by at
# most this much per read; a payload up to this size gets a plain buffer, a larger one a mapping.
READ_STEP = 256 * 1024
REFUSED_LINGER_S = 1.0  # a refused connection stays open this long, so its ERROR frame is not lost to a reset
MAX_LINGERING = 64
ERROR_SEND_TIMEOUT_S = 5.0


class _Closed(Exception):
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
    def of(sock: socket.socket) -> "Peer":
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
        """Bytes already arrived, up to len(view) (> 0); 0 when none yet. _Closed at the end of the stream."""
        try:
            received = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return 0
        if received == 0:
            raise _Closed()
        return received

    async def _ready(self, deadline: float) -> None:
        """Until bytes can be read; _Closed past `deadline`."""
        await self._wait(self._loop.add_reader, self._loop.remove_reader, deadline)

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send it all; _Closed if the client takes none of it for `data_frame_timeout_s` (a stuck reader)."""
        view = memoryview(data).cast("B")
        deadline = self._loop.time() + self.frame_timeout_s
        while len(view):
            try:
                sent = self.sock.send(view)
            except (BlockingIOError, InterruptedError):
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
            raise _Closed()
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
            raise _Closed()

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


class Region:
    """Memory a Unix-socket client lent for one connection: a memfd it holds, sealed against shrinking."""

    def __init__(self, mapping: mmap.mmap, size: int) -> None:
        self.mapping, self.size = mapping, size
        self.view = memoryview(mapping)

    @staticmethod
    def adopt(fd: int, size: int, peer: Peer) -> "Region":
        """Map `size` bytes of `fd`; RequestError unless it cannot shrink, is the peer's and is big enough.

        A shared mapping of a file that shrinks loses its pages: the next write into them is a SIGBUS."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # not a sealable object (a regular file, a socket)
        if not seals & fcntl.F_SEAL_SHRINK:
            raise RequestError("shared memory must be a memfd sealed against shrinking: memfd_create with "
                               "MFD_ALLOW_SEALING, ftruncate, then F_ADD_SEALS with F_SEAL_SHRINK")
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != peer.uid:
            raise RequestError("shared memory must be a memfd created by the registering client")
        if info.st_size < size:
            raise RequestError(f"the memory holds {info.st_size} bytes, fewer than the {size} registered")
        try:
            mapping = mmap.mmap(fd, size)
        except (OSError, ValueError) as exc:  # write-sealed, or read-only
            raise RequestError(f"cannot map the memory for writing: {exc}") from None
        return Region(mapping, size)

    def close(self) -> None:
        self.view.release()
        try:
            self.mapping.close()
        except BufferError:  # a read cut short still holds a view of it: unmapped when that goes
            pass


class DataPlaneServer:
    def __init__(self, store: BlockStore, config: ServerConfig, put_budget: ByteBudget) -> None:
        self.store = store
        self.config = config
        self.put_budget = put_budget
        self.frame_budget = FrameBudget(config.max_unfinished_frame_bytes)
        self.metrics = store.metrics
        self._listeners: list[socket.socket] = []
        self._accepting: list[asyncio.Task] = []
        self._connections: set[asyncio.Task] = set()
        self._per_peer: dict[str, int] = {}
        self._lingering = 0
        self._unix_path: str | None = None
        self._last_refusal_log = 0.0

    async def start(self, host: str, port: int) -> int:
        """Serve on TCP; the bound port."""
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        self._listen(listener)
        return listener.getsockname()[1]

    async def start_unix(self, path: Path) -> str:
        """Serve on a Unix socket at `path` (a stale one left by a daemon that died is replaced)."""
        path = os.path.abspath(path)
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise OSError(f"{path} exists and is not a socket; remove it or set data_socket elsewhere")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                try:
                    probe.connect(path)
                except OSError:
                    os.unlink(path)
                else:
                    raise OSError(f"another process serves the Unix socket {path}; give each daemon its own")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        self._unix_path = path
        self._listen(listener)
        return path

    def _listen(self, listener: socket.socket) -> None:
        listener.listen(1024)
        listener.setblocking(False)
        self._listeners.append(listener)
        self._accepting.append(asyncio.create_task(self._accept_loop(listener)))

    async def stop(self, grace_s: float) -> None:
        for task in self._accepting:
            task.cancel()
        for listener in self._listeners:
            listener.close()
        if self._unix_path is not None:
            try:
                os.unlink(self._unix_path)
            except FileNotFoundError:
                pass
        if self._connections:
            _, pending = await asyncio.wait(self._connections, timeout=grace_s)
            for task in pending:
                task.cancel()

    # -- admission ----------------------------------------------------------------------------------

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors, or a connection gone before it was accepted
                log.warning("data channel: accepting a connection failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            try:
                peer = Peer.of(sock)
            except OSError:
                sock.close()
                continue
            refusal = self._refusal(peer)
            if refusal:
                self._refuse(sock, peer, refusal)
                continue
            sock.setblocking(False)
            wire.tune(sock)
            self._per_peer[peer.key] = self._per_peer.get(peer.key, 0) + 1
            task = asyncio.create_task(self._serve(sock, peer))
            self._connections.add(task)
            task.add_done_callback(lambda done, key=peer.key: self._gone(done, key))

    def _refusal(self, peer: Peer) -> str:
        if len(self._connections) >= self.config.max_data_connections:
            return (f"the daemon serves {self.config.max_data_connections} data connections already "
                    "(max_data_connections); retry later or use gRPC")
        if self._per_peer.get(peer.key, 0) >= self.config.max_data_connections_per_peer:
            return (f"{self.config.max_data_connections_per_peer} data connections from {peer.key} already "
                    "(max_data_connections_per_peer); retry later or use gRPC")
        return ""

    def _refuse(self, sock: socket.socket, peer: Peer, message: str) -> None:
        self.metrics.rpc_errors.labels(method="data", code="RESOURCE_EXHAUSTED").inc()
        if time.monotonic() - self._last_refusal_log > 10:
            self._last_refusal_log = time.monotonic()
            log.warning("data channel: refused a connection from %s: %s", peer.key, message)
        try:
            sock.setblocking(False)
            refusal = pb.DataError(code="RESOURCE_EXHAUSTED", message=message, connection_refused=True)
            sock.send(wire.frame(wire.ERROR, refusal.SerializeToString()))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if self._lingering >= MAX_LINGERING:
            sock.close()
            return
        self._lingering += 1  # closed with unread bytes, the socket would reset and the client lose the frame

        def close() -> None:
            self._lingering -= 1
            sock.close()
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, close)

    def _gone(self, task: asyncio.Task, peer_key: str) -> None:
        self._connections.discard(task)
        left = self._per_peer.get(peer_key, 1) - 1
        if left:
            self._per_peer[peer_key] = left
        else:
            self._per_peer.pop(peer_key, None)

    # -- a connection -------------------------------------------------------------------------------

    async def _serve(self, sock: socket.socket, peer: Peer) -> None:
        connection = Connection(sock, peer, self.frame_budget, self.config.data_frame_timeout_s,
                                self.config.data_idle_timeout_s)
        regions: dict[int, Region] = {}  # lent by this connection's client; gone with the connection
        try:
            while True:
                connection.release()
                try:
                    prefix = await connection.read(wire.PREFIX.size, idle=True)
                except _Closed:
                    return
                try:
                    kind, head_len = wire.parse_prefix(prefix)
                    head = await connection.read(head_len)
                    if kind == wire.GET:
                        await self._get(connection, parse(pb.GetRequest, head), regions)
                    elif kind == wire.REGISTER:
                        await self._register(connection, head, regions)
                    elif kind == wire.PUT:
                        await self._puts(connection, parse(pb.PutHead, head))
                    else:
                        raise RequestError(f"unexpected frame kind {kind}")
                except RequestError as exc:
                    await self._error(connection, exc.code, str(exc))
                    return
                except wire.FrameError as exc:
                    await self._error(connection, "INVALID_ARGUMENT", str(exc))
                    return
                except DiskFull as exc:
                    self.metrics.rpc_errors.labels(method="data.Put", code="RESOURCE_EXHAUSTED").inc()
                    await self._error(connection, "RESOURCE_EXHAUSTED", f"disk full: {exc}")
                    return
                except OSError as exc:  # an I/O error of the store (or of the socket: then the frame is lost)
                    await self._error(connection, "UNAVAILABLE", f"I/O error: {exc}")
                    return
        except (_Closed, OSError):  # the peer went away or stalled
            return
        finally:
            connection.close()
            for region in regions.values():
                region.close()

    # -- Get ----------------------------------------------------------------------------------------

    async def _get(self, connection: Connection, request: pb.GetRequest, regions: dict[int, Region]) -> None:
        check_get(request, self.config)
        started = time.perf_counter()
        region = self._region_of(request, regions)
        target = None
        if region is not None:
            def target(index: int, layer_begin: int, nbytes: int) -> memoryview | None:
                offset, room = self._place(request, region, index, layer_begin, nbytes)
                if nbytes > room:
                    return None  # does not fit what the client set aside: this part travels over the socket
                return region.view[offset : offset + nbytes]
        heads: list[bytes] = []  # heads of parts already in the client's memory, sent a layer at a time
        layer = request.layer_begin
        async for head, payload in get_parts(self.store, request, target):
            in_region = region is not None and payload is not None and isinstance(payload, memoryview) \
                and payload.obj is region.mapping
            if heads and (not in_region or head.layer_begin != layer):
                await connection.send(b"".join(heads))
                heads.clear()
            layer = head.layer_begin
            if in_region:  # the bytes are already in the client's memory: only the head travels
                self.metrics.region_bytes.inc(head.payload_bytes)
                head.in_region = True
                head.region_offset = self._place(request, region, head.index, head.layer_begin,
                                                 head.payload_bytes)[0]
                heads.append(wire.frame(wire.PART, head.SerializeToString()))
                continue
            await connection.send(wire.frame(wire.PART, head.SerializeToString()))
            if payload is not None:
                await connection.send(payload)
        heads.append(wire.frame(wire.DONE))
        await connection.send(b"".join(heads))
        self.metrics.rpc_latency.labels(method="data.Get").observe(time.perf_counter() - started)

    @staticmethod
    def _place(request: pb.GetRequest, region: Region, index: int, layer_begin: int, nbytes: int) -> tuple[int, int]:
        """Where a part of key `index` starting at `layer_begin` goes in the region, and how much fits there.

        Layer-major parts hold one layer each, block-major parts start at the requested first layer."""
        stride = request.region_layer_stride or nbytes
        offset = request.region_offsets[index] + (layer_begin - request.layer_begin) * stride
        return offset, region.size - offset

    def _region_of(self, request: pb.GetRequest, regions: dict[int, Region]) -> Region | None:
        if not request.region_id:
            return None
        region = regions.get(request.region_id)
        if region is None:
            raise RequestError(f"region {request.region_id} is not registered on this connection")
        if len(request.region_offsets) != len(request.keys) or max(request.region_offsets, default=0) >= region.size:
            raise RequestError(f"region_offsets must give one offset per key inside the {region.size}-byte region")
        return region

    async def _register(self, connection: Connection, head: bytes, regions: dict[int, Region]) -> None:
        peer = connection.peer
        if not peer.local:
            raise PermissionDenied("shared memory is offered only on the daemon's Unix socket (Info.data_socket), "
                                   "to clients on its host; over TCP, Get without a region")
        request = parse(pb.RegisterRegion, head)
        if request.SerializeToString() != head:
            raise RequestError("REGISTER names no object: its head holds only the size, and the memory's "
                               "descriptor follows in a message of its own")
        if len(regions) >= MAX_REGIONS_PER_CONNECTION:
            raise RequestError(f"at most {MAX_REGIONS_PER_CONNECTION} regions per connection", exhausted=True)
        if not 0 < request.size <= self.config.max_region_bytes:
            raise RequestError(f"region of {request.size} bytes; the limit is {self.config.max_region_bytes}",
                               exhausted=request.size > 0)
        fd = await connection.receive_fd()
        try:
            region = Region.adopt(fd, request.size, peer)
        finally:
            os.close(fd)
        region_id = max(regions, default=0) + 1
        regions[region_id] = region
        log.debug("data channel: region %d of %d bytes lent by pid %d (uid %d)", region_id, request.size,
                  peer.pid, peer.uid)
        await connection.send(wire.frame(wire.REGISTERED, pb.RegionRegistered(region_id=region_id).SerializeToString()))

    # -- Put ----------------------------------------------------------------------------------------

    async def _puts(self, connection: Connection, first: pb.PutHead) -> None:
        """Receive records until PUT_END, then answer with each one's status.

        A record is stored as soon as it has arrived and verified; if a later frame breaks the protocol,
        the records before it are still stored (unacknowledged, as after a crash), never cut off half-way.
        """
        started = time.perf_counter()
        tasks: list[asyncio.Task] = []
        put_head: pb.PutHead | None = first
        while put_head is not None:
            tasks.append(await self._receive_record(connection, put_head.record_bytes, reuse_hint(put_head)))
            kind, head_len = wire.parse_prefix(await connection.read(wire.PREFIX.size))
            head = await connection.read(head_len)
            if kind == wire.PUT:
                put_head = parse(pb.PutHead, head)
            elif kind == wire.PUT_END:
                put_head = None
            else:
                raise RequestError(f"expected PUT or PUT_END, got frame kind {kind}")
        results = await asyncio.gather(*tasks)
        await connection.send(wire.frame(wire.PUT_RESULT, pb.PutResponse(results=results).SerializeToString()))
        self.metrics.rpc_latency.labels(method="data.Put").observe(time.perf_counter() - started)

    async def _receive_record(self, connection: Connection, declared: int, hint: ReuseHint | None) -> asyncio.Task:
        check_put_head(declared, self.config)
        await self.put_budget.acquire(declared)
        try:
            fixed = await connection.read(min(FIXED_HEADER_BYTES, declared))
            header_len = int.from_bytes(fixed[8:12], "little") if len(fixed) == FIXED_HEADER_BYTES else 0
            if not FIXED_HEADER_BYTES <= header_len <= declared:
                raise RequestError(f"record header length {header_len} does not fit a {declared}-byte record")
            header_bytes = fixed + await connection.read(header_len - FIXED_HEADER_BYTES)
            header = parse_record_header(header_bytes, declared, list(self.config.classes))
            payload, charged_whole = self._payload_buffer(connection, header.payload_len)
            await connection.read_into(memoryview(payload), charge=not charged_whole)
            check_payload(header, [payload])
        except BaseException:
            await self.put_budget.release(declared)
            raise
        connection.release()  # arrived whole: from here the put budget accounts for it
        return asyncio.ensure_future(self._store(header, header_bytes, payload, declared, hint))

    def _payload_buffer(self, connection: Connection, nbytes: int) -> tuple[bytearray | mmap.mmap, bool]:
        """Where a record's payload lands (it becomes the DRAM tier's copy), and whether it is charged to
        the frame budget whole now rather than as bytes arrive.

        A buffer the DRAM tier recycled is memory already held and faulted in. Else a small payload gets a
        plain buffer, and a large one an anonymous mapping: its pages exist once bytes are written into
        them, and go back to the OS when it is freed (whatever the allocator keeps)."""
        recycled = self.store.hot.reuse(nbytes)
        if recycled is not None:
            return recycled, False
        if nbytes > READ_STEP:
            try:
                return mmap.mmap(-1, nbytes), False
            except OSError:  # out of mappings (vm.max_map_count): take plain memory
                pass
        connection.hold(nbytes)
        return bytearray(nbytes), True

    async def _store(self, header, header_bytes: bytes, payload: bytearray | mmap.mmap, declared: int,
                     hint: ReuseHint | None) -> int:
        try:
            return await self.store.put(header, header_bytes, [payload], hint)
        finally:
            await self.put_budget.release(declared)

    # -- errors -------------------------------------------------------------------------------------

    async def _error(self, connection: Connection, code: str, message: str) -> None:
        self.metrics.rpc_errors.labels(method="data", code=code).inc()
        try:
            frame = wire.frame(wire.ERROR, pb.DataError(code=code, message=message).SerializeToString())
            await asyncio.wait_for(connection.send(frame), ERROR_SEND_TIMEOUT_S)
        except (OSError, _Closed, asyncio.TimeoutError):
            pass
