"""The daemon's bulk data channel: Get and Put in raw frames (kvstore/wire.py), on TCP and on a Unix socket.

One request at a time per connection; clients keep a few connections open. The same validation,
limits and store calls as the gRPC service; a protocol violation is answered with an ERROR frame
naming a gRPC status code, and the connection is closed.

No client can wedge or exhaust the daemon through it (docs/design.md section 10, invariant 6):
* connections are limited in total and per peer (an address on TCP, a user on the Unix socket); the
  excess is answered RESOURCE_EXHAUSTED and closed;
* a connection silent between frames for `data_idle_timeout_s`, or stalled inside one (or in taking
  what it asked for) for `data_frame_timeout_s`, is closed;
* a record's reservation in the put budget comes out of its principal's share (its token, or its peer
  without tokens), and a record that has not arrived whole `put_record_timeout_s` after its PUT frame
  gives it back and ends the connection;
* memory is held only for bytes that arrived, and bounded daemon-wide for frames still arriving
  (`max_unfinished_frame_bytes`): heads grow as they arrive, and a large record payload lands in a
  mapping whose pages exist only once bytes are written into them and go back to the OS when freed.

Shared memory is offered only on the Unix socket, that is to peers on this host: the client passes the
descriptor of a memfd sealed against shrinking, so a region is memory the peer holds (never an object
named by path) and no truncation can pull pages from under the daemon's mapping.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import mmap
import os
import socket
import stat
import time
from pathlib import Path

from kvstore import wire
from kvstore.proto import pb
from kvstore.record import FIXED_HEADER_BYTES
from kvstore.server.arriving import ArrivingRecord
from kvstore.server.auth import Authenticator, Principal
from kvstore.server.config import ServerConfig
from kvstore.server.data_connection import (
    POPULATE_STEP,
    READ_STEP,
    Closed,
    Connection,
    FrameBudget,
    Peer,
    TlsConnection,
    populate,
)
from kvstore.server.limits import ByteBudget, principal_key
from kvstore.server.put_stream import Arrived, PutStream
from kvstore.server.reads import get_parts
from kvstore.server.regions import Region
from kvstore.server.requests import (
    PermissionDenied,
    RequestError,
    check_get,
    parse,
)
from kvstore.server.security import Security
from kvstore.server.store import BlockStore, DiskFull, Scope

log = logging.getLogger(__name__)


class Unauthenticated(RequestError):
    @property
    def code(self) -> str:
        return "UNAUTHENTICATED"


MAX_REGIONS_PER_CONNECTION = 4
RECEIVE_STEP = 1024 * 1024  # a record written as it arrives is verified (and written) this often at most
MAX_AUTH_HEAD_BYTES = 4096  # a DataAuth: what a client that has not shown a token can make the daemon hold
REFUSED_LINGER_S = 1.0  # a refused connection stays open this long, so its ERROR frame is not lost to a reset
MAX_LINGERING = 64
ERROR_SEND_TIMEOUT_S = 5.0


class DataPlaneServer:
    def __init__(self, store: BlockStore, config: ServerConfig, put_budget: ByteBudget,
                 security: Security | None = None) -> None:
        self.store = store
        self.config = config
        self.put_budget = put_budget
        self.security = security or Security(None, None, None)
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

    async def start_unix(self, where: Path) -> str:
        """Serve on a Unix socket at `where` (a stale one left by a daemon that died is replaced); its
        absolute path."""
        path = os.path.abspath(where)
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
            task.add_done_callback(functools.partial(self._gone, peer_key=peer.key))

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
        limits = (peer, self.frame_budget, self.config.data_frame_timeout_s, self.config.data_idle_timeout_s)
        tls = self.security.data_tls if not peer.local else None  # the Unix socket is this host's own
        try:
            connection = await TlsConnection.accept(sock, tls, *limits) if tls else Connection(sock, *limits)
        except Closed:
            return
        regions: dict[int, Region] = {}  # lent by this connection's client; gone with the connection
        principal: Principal | None = None  # who the AUTH frame proved the client to be
        authenticator = self.security.authenticator
        try:
            while True:
                connection.release()
                gate = authenticator if principal is None else None  # what the client must still pass, if any
                try:  # a client that must prove itself first gets no idle time to hold a connection with
                    prefix = await connection.read(wire.PREFIX.size, idle=gate is None)
                except Closed:
                    return
                try:
                    kind, head_len = wire.parse_prefix(prefix)
                    if gate is not None:  # before the token, nothing but a small AUTH frame is read
                        if kind != wire.AUTH or head_len > MAX_AUTH_HEAD_BYTES:
                            raise Unauthenticated("this daemon checks tokens: the first frame must be AUTH "
                                                  f"(DataAuth, at most {MAX_AUTH_HEAD_BYTES} bytes)")
                        principal = await self._authenticate(gate, connection, await connection.read(head_len))
                        continue
                    head = await connection.read(head_len)
                    scope = principal.tenants if principal is not None else None
                    if kind == wire.GET:
                        self._allow(principal, "read")
                        await self._get(connection, parse(pb.GetRequest, head), regions, scope)
                    elif kind == wire.REGISTER:
                        self._allow(principal, "read")
                        await self._register(connection, head, regions)
                    elif kind == wire.PUT:
                        self._allow(principal, "write")
                        await self._puts(connection, parse(pb.PutHead, head), scope,
                                         principal_key(principal, peer.key))
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
        except (Closed, OSError):  # the peer went away or stalled
            return
        finally:
            connection.close()
            for region in regions.values():
                region.close()

    # -- who may do what -----------------------------------------------------------------------------

    @staticmethod
    async def _authenticate(authenticator: Authenticator, connection: Connection, head: bytes) -> Principal:
        """The principal of the token in an AUTH frame's head; Unauthenticated for an unknown one."""
        principal = authenticator.authenticate(parse(pb.DataAuth, head).token)
        if principal is None:
            raise Unauthenticated("unknown token")
        await connection.send(wire.frame(wire.AUTHED))
        return principal

    @staticmethod
    def _allow(principal: Principal | None, verb: str) -> None:
        if principal is not None and not principal.may(verb):
            raise PermissionDenied(f"token {principal.name!r} may not {verb}")

    # -- Get ----------------------------------------------------------------------------------------

    async def _get(self, connection: Connection, request: pb.GetRequest, regions: dict[int, Region],
                   scope: Scope = None) -> None:
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
        heads: list[bytes] = []  # heads of layer-major parts already in the client's memory, sent a layer at a time
        layer = request.layer_begin
        # promotion waits while any Get is served and not waiting for its client to take bytes
        send = functools.partial(connection.send, while_blocked=self.store.gets_in_flight.waiting_on_client)
        with self.store.gets_in_flight:
            async for head, payload in get_parts(self.store, request, target, scope):
                in_region = region is not None and isinstance(payload, memoryview) and payload.obj is region.mapping
                if heads and (not in_region or head.layer_begin != layer):
                    await send(b"".join(heads))
                    heads.clear()
                layer = head.layer_begin
                if in_region:  # the bytes are already in the client's memory: only the head travels
                    assert region is not None
                    self.metrics.region_bytes.inc(head.payload_bytes)
                    head.in_region = True
                    head.region_offset = self._place(request, region, head.index, head.layer_begin,
                                                     head.payload_bytes)[0]
                    heads.append(wire.frame(wire.PART, head.SerializeToString()))
                    if request.order != pb.LAYER_MAJOR:  # a whole block: checked by the client as later ones are read
                        await send(heads.pop())
                    continue
                await send(wire.frame(wire.PART, head.SerializeToString()))
                if payload is not None:
                    await send(payload)
            heads.append(wire.frame(wire.DONE))
            await send(b"".join(heads))
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

    async def _puts(self, connection: Connection, first: pb.PutHead, scope: Scope = None, who: str = "") -> None:
        """Receive records until PUT_END, then answer with each one's status (put_stream.py)."""
        started = time.perf_counter()
        stream = PutStream(self.store, self.config, self.put_budget, who, scope)

        async def arrive(declared: int, verify_header) -> Arrived:
            """A record as bytes: its header, whose fixed part gives its length, then the payload, received
            straight into the buffer that becomes the DRAM tier's copy. A large record is verified and
            written to its segment layer by layer as it lands (arriving.py)."""
            fixed = await connection.read(min(FIXED_HEADER_BYTES, declared))
            header_len = int.from_bytes(fixed[8:12], "little") if len(fixed) == FIXED_HEADER_BYTES else 0
            if not FIXED_HEADER_BYTES <= header_len <= declared:
                raise RequestError(f"record header length {header_len} does not fit a {declared}-byte record")
            header_bytes = fixed + await connection.read(header_len - FIXED_HEADER_BYTES)
            header = verify_header(header_bytes)
            payload, charged_whole, fresh = self._payload_buffer(connection, header.payload_len)
            fresh_mapping = payload if fresh and isinstance(payload, mmap.mmap) else None
            view = memoryview(payload)
            placed = await self.store.place(header)
            arriving = ArrivingRecord(self.store, placed, header, view) if placed is not None else None
            step = RECEIVE_STEP if arriving is not None else POPULATE_STEP if fresh_mapping is not None else len(view)
            try:
                for start in range(0, len(view), step):
                    if fresh_mapping is not None and start % POPULATE_STEP == 0:  # fault in ahead of the bytes
                        populate(fresh_mapping, start, POPULATE_STEP)
                    await connection.read_into(view[start : start + step], charge=not charged_whole)
                    if arriving is not None:
                        arriving.arrived(min(start + step, len(view)))
            except BaseException:
                if arriving is not None:
                    arriving.give_up()
                raise
            connection.release()  # arrived whole: from here the put budget accounts for it
            return Arrived(header, header_bytes, [payload], arriving)

        put_head: pb.PutHead | None = first
        try:
            while put_head is not None:
                await stream.receive(put_head, arrive)
                kind, head_len = wire.parse_prefix(await connection.read(wire.PREFIX.size))
                head = await connection.read(head_len)
                if kind == wire.PUT:
                    put_head = parse(pb.PutHead, head)
                elif kind == wire.PUT_END:
                    put_head = None
                else:
                    raise RequestError(f"expected PUT or PUT_END, got frame kind {kind}")
            response = await stream.results()
        except Exception:  # the ERROR frame follows once what arrived whole is stored
            await stream.settle()
            raise
        await connection.send(wire.frame(wire.PUT_RESULT, response.SerializeToString()))
        self.metrics.rpc_latency.labels(method="data.Put").observe(time.perf_counter() - started)

    def _payload_buffer(self, connection: Connection, nbytes: int) -> tuple[bytearray | mmap.mmap, bool, bool]:
        """Where a record's payload lands (it becomes the DRAM tier's copy), and whether it is charged to
        the frame budget whole now rather than as bytes arrive, and whether it is a fresh mapping.

        A buffer the DRAM tier recycled is memory already held and faulted in. Else a small payload gets a
        plain buffer, and a large one an anonymous mapping: its pages exist once bytes arrive into them
        (a record declared and never sent costs nothing), and go back to the OS when it is freed."""
        recycled = self.store.hot.reuse(nbytes)
        if recycled is not None:
            return recycled, False, False
        if nbytes > READ_STEP:
            try:
                return mmap.mmap(-1, nbytes), False, True
            except OSError:  # out of mappings (vm.max_map_count): take plain memory
                pass
        connection.hold(nbytes)
        return bytearray(nbytes), True, False

    # -- errors -------------------------------------------------------------------------------------

    async def _error(self, connection: Connection, code: str, message: str) -> None:
        self.metrics.rpc_errors.labels(method="data", code=code).inc()
        try:
            frame = wire.frame(wire.ERROR, pb.DataError(code=code, message=message).SerializeToString())
            await asyncio.wait_for(connection.send(frame), ERROR_SEND_TIMEOUT_S)
        except (TimeoutError, OSError, Closed):
            pass
