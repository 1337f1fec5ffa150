"""The daemon's bulk data channel: Get and Put over framed raw TCP (kvstore/wire.py).

One request at a time per connection; clients keep a few connections open. The same validation,
limits and store calls as the gRPC service; a protocol violation is answered with an ERROR frame
naming a gRPC status code, and the connection is closed. A connection that stalls inside a frame
for longer than `frame_timeout_s` is dropped, so a slow or stuck client cannot pin memory.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import socket
import time

from kvstore import wire
from kvstore.hostid import host_id
from kvstore.eviction import ReuseHint
from kvstore.proto import pb
from kvstore.record import FIXED_HEADER_BYTES
from kvstore.server.config import ServerConfig
from kvstore.server.reads import get_parts
from kvstore.server.requests import (RequestError, check_get, check_payload, check_put_head, parse,
                                     parse_record_header, reuse_hint)
from kvstore.server.service import ByteBudget
from kvstore.server.store import BlockStore, DiskFull

log = logging.getLogger(__name__)


MAX_REGIONS_PER_CONNECTION = 4
SHM_DIR = "/dev/shm"


class _Closed(Exception):
    pass


class Region:
    """A client's shared-memory object, mapped for one connection. The client asks for its name to be
    unlinked with its last registration, so nothing is left behind when either side dies."""

    def __init__(self, mapping: mmap.mmap, size: int) -> None:
        self.mapping, self.size = mapping, size
        self.view = memoryview(mapping)

    @staticmethod
    def open(name: str, size: int, unlink: bool) -> "Region":
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise OSError(f"object is smaller than {size} bytes")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if unlink:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return Region(mapping, size)

    def close(self) -> None:
        self.view.release()
        self.mapping.close()


class DataPlaneServer:
    def __init__(self, store: BlockStore, config: ServerConfig, put_budget: ByteBudget) -> None:
        self.store = store
        self.config = config
        self.put_budget = put_budget
        self.frame_timeout_s = config.data_frame_timeout_s
        self.metrics = store.metrics
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(256)
        listener.setblocking(False)
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept_loop())
        return listener.getsockname()[1]

    async def stop(self, grace_s: float) -> None:
        if self._accepting:
            self._accepting.cancel()
        if self._listener:
            self._listener.close()
        if self._connections:
            _, pending = await asyncio.wait(self._connections, timeout=grace_s)
            for task in pending:
                task.cancel()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            if len(self._connections) >= self.config.max_concurrent_rpcs:
                sock.close()  # the client sees a reset and counts the daemon as busy
                continue
            sock.setblocking(False)
            wire.tune(sock)
            task = asyncio.create_task(self._serve(sock))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket) -> None:
        regions: dict[int, Region] = {}  # lent by this connection's client; gone with the connection
        try:
            while True:
                try:
                    prefix = await self._read(sock, wire.PREFIX.size, idle=True)
                except _Closed:
                    return
                try:
                    kind, head_len = wire.parse_prefix(prefix)
                    head = await self._read(sock, head_len)
                    if kind == wire.GET:
                        await self._get(sock, parse(pb.GetRequest, head), regions)
                    elif kind == wire.REGISTER:
                        await self._register(sock, parse(pb.RegisterRegion, head), regions)
                    elif kind == wire.PUT:
                        await self._puts(sock, parse(pb.PutHead, head))
                    else:
                        raise RequestError(f"unexpected frame kind {kind}")
                except (RequestError, wire.FrameError) as exc:
                    exhausted = isinstance(exc, RequestError) and exc.exhausted
                    await self._error(sock, "RESOURCE_EXHAUSTED" if exhausted else "INVALID_ARGUMENT", str(exc))
                    return
                except DiskFull as exc:
                    self.metrics.rpc_errors.labels(method="data.Put", code="RESOURCE_EXHAUSTED").inc()
                    await self._error(sock, "RESOURCE_EXHAUSTED", f"disk full: {exc}")
                    return
        except (_Closed, asyncio.TimeoutError, OSError):  # the peer went away, stalled, or an I/O error
            return
        finally:
            sock.close()
            for region in regions.values():
                region.close()

    # -- Get ----------------------------------------------------------------------------------------

    async def _get(self, sock: socket.socket, request: pb.GetRequest, regions: dict[int, Region]) -> None:
        check_get(request, self.config)
        loop = asyncio.get_running_loop()
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
                await loop.sock_sendall(sock, b"".join(heads))
                heads.clear()
            layer = head.layer_begin
            if in_region:  # the bytes are already in the client's memory: only the head travels
                self.metrics.region_bytes.inc(head.payload_bytes)
                head.in_region = True
                head.region_offset = self._place(request, region, head.index, head.layer_begin,
                                                 head.payload_bytes)[0]
                heads.append(wire.frame(wire.PART, head.SerializeToString()))
                continue
            await loop.sock_sendall(sock, wire.frame(wire.PART, head.SerializeToString()))
            if payload is not None:
                await loop.sock_sendall(sock, payload)
        heads.append(wire.frame(wire.DONE))
        await loop.sock_sendall(sock, b"".join(heads))
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

    async def _register(self, sock: socket.socket, request: pb.RegisterRegion, regions: dict[int, Region]) -> None:
        if not host_id():
            raise RequestError("this daemon does not offer shared memory")
        if len(regions) >= MAX_REGIONS_PER_CONNECTION:
            raise RequestError(f"at most {MAX_REGIONS_PER_CONNECTION} regions per connection", exhausted=True)
        if not request.name or "/" in request.name or request.name.startswith("."):
            raise RequestError(f"bad shared-memory name {request.name!r}")
        if not 0 < request.size <= self.config.max_region_bytes:
            raise RequestError(f"region of {request.size} bytes; the limit is {self.config.max_region_bytes}",
                               exhausted=request.size > 0)
        try:
            region = Region.open(request.name, request.size, request.unlink)
        except OSError as exc:
            raise RequestError(f"cannot map shared memory {request.name!r}: {exc}") from None
        region_id = max(regions, default=0) + 1
        regions[region_id] = region
        response = pb.RegionRegistered(region_id=region_id).SerializeToString()
        await asyncio.get_running_loop().sock_sendall(sock, wire.frame(wire.REGISTERED, response))

    # -- Put ----------------------------------------------------------------------------------------

    async def _puts(self, sock: socket.socket, first: pb.PutHead) -> None:
        """Receive records until PUT_END, then answer with each one's status.

        A record is stored as soon as it has arrived and verified; if a later frame breaks the protocol,
        the records before it are still stored (unacknowledged, as after a crash), never cut off half-way.
        """
        started = time.perf_counter()
        tasks: list[asyncio.Task] = []
        put_head: pb.PutHead | None = first
        while put_head is not None:
            tasks.append(await self._receive_record(sock, put_head.record_bytes, reuse_hint(put_head)))
            kind, head_len = wire.parse_prefix(await self._read(sock, wire.PREFIX.size))
            head = await self._read(sock, head_len)
            if kind == wire.PUT:
                put_head = parse(pb.PutHead, head)
            elif kind == wire.PUT_END:
                put_head = None
            else:
                raise RequestError(f"expected PUT or PUT_END, got frame kind {kind}")
        results = await asyncio.gather(*tasks)
        response = pb.PutResponse(results=results).SerializeToString()
        await asyncio.get_running_loop().sock_sendall(sock, wire.frame(wire.PUT_RESULT, response))
        self.metrics.rpc_latency.labels(method="data.Put").observe(time.perf_counter() - started)

    async def _receive_record(self, sock: socket.socket, declared: int, hint: ReuseHint | None) -> asyncio.Task:
        check_put_head(declared, self.config)
        await self.put_budget.acquire(declared)
        try:
            fixed = await self._read(sock, min(FIXED_HEADER_BYTES, declared))
            header_len = int.from_bytes(fixed[8:12], "little") if len(fixed) == FIXED_HEADER_BYTES else 0
            if not FIXED_HEADER_BYTES <= header_len <= declared:
                raise RequestError(f"record header length {header_len} does not fit a {declared}-byte record")
            header_bytes = fixed + await self._read(sock, header_len - FIXED_HEADER_BYTES)
            header = parse_record_header(header_bytes, declared, list(self.config.classes))
            payload = self.store.hot.buffer(header.payload_len)  # becomes the DRAM tier's copy
            await self._read_into(sock, memoryview(payload))
            check_payload(header, [payload])
        except BaseException:
            await self.put_budget.release(declared)
            raise
        return asyncio.ensure_future(self._store(header, header_bytes, payload, declared, hint))

    async def _store(self, header, header_bytes: bytes, payload: bytearray, declared: int,
                     hint: ReuseHint | None) -> int:
        try:
            return await self.store.put(header, header_bytes, [payload], hint)
        finally:
            await self.put_budget.release(declared)

    # -- plumbing -----------------------------------------------------------------------------------

    async def _read(self, sock: socket.socket, nbytes: int, idle: bool = False) -> bytes:
        buf = bytearray(nbytes)
        await self._read_into(sock, memoryview(buf), idle)
        return bytes(buf)

    async def _read_into(self, sock: socket.socket, view: memoryview, idle: bool = False) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if idle else time.monotonic() + self.frame_timeout_s
        while len(view):
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            received = await asyncio.wait_for(loop.sock_recv_into(sock, view), timeout)
            if received == 0:
                raise _Closed()
            view = view[received:]
            deadline = deadline or time.monotonic() + self.frame_timeout_s  # a frame has begun

    async def _error(self, sock: socket.socket, code: str, message: str) -> None:
        self.metrics.rpc_errors.labels(method="data", code=code).inc()
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(
                sock, wire.frame(wire.ERROR, pb.DataError(code=code, message=message).SerializeToString())), 5)
        except (OSError, asyncio.TimeoutError):
            pass
