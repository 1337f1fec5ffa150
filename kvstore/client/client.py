"""The client of a kvstore cluster: longest-prefix lookup, verified gets and chunked puts over shards.

Contract for callers on an engine's path: a dead, slow or misbehaving daemon never raises here; its
blocks are misses, counted in `stats`, and the daemon is retried after a backoff. Only a caller's own
mistake (mixed namespaces, a payload that does not fit the layout) raises ValueError.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Iterator, Sequence, TypeVar

import grpc

from kvstore.block import Block, same_namespace
from kvstore.client.config import ClientConfig
from kvstore.client.dataplane import DataChannel, TransportError
from kvstore.client.placement import place
from kvstore.client.shard import Shard
from kvstore.proto import pb
from kvstore.record import CorruptRecord, RecordHeader, build_record, decode_header

T = TypeVar("T")
VERIFY_CHUNK_BYTES = 256 * 1024  # verify a part in chunks of about this size while the rest arrives
Buffer = bytes | bytearray | memoryview


@dataclass(slots=True)
class BlockData:
    """A verified block as read: layers [layer_begin, layer_end) of its layer-major payload."""

    block: Block
    header: RecordHeader
    layer_begin: int
    layer_end: int
    payload: Buffer  # (layer_end - layer_begin) * header.layer_bytes bytes, layer-major

    def layer(self, layer: int) -> memoryview:
        size = self.header.layer_bytes
        start = (layer - self.layer_begin) * size
        return memoryview(self.payload)[start : start + size]


@dataclass(slots=True)
class PutSummary:
    stored: int = 0
    existed: int = 0
    failed: int = 0


@dataclass(slots=True)
class ClientStats:
    lookups: int = 0
    hit_blocks: int = 0
    miss_causes: Counter = field(default_factory=Counter)  # verified-miss and error causes
    shard_errors: Counter = field(default_factory=Counter)  # address -> failed calls
    bytes_read: int = 0
    bytes_written: int = 0


class AsyncKVClient:
    def __init__(self, config: ClientConfig | Sequence[str] | str) -> None:
        self.config = config if isinstance(config, ClientConfig) else ClientConfig(servers=tuple(
            config.split(",") if isinstance(config, str) else config))
        self.shards = {address: Shard(address, self.config) for address in self.config.servers}
        self.stats = ClientStats()

    async def close(self) -> None:
        await asyncio.gather(*(shard.close() for shard in self.shards.values()))

    async def __aenter__(self) -> "AsyncKVClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- placement --------------------------------------------------------------------------------

    def owner(self, key: bytes) -> Shard | None:
        """The live daemon that owns `key` (rendezvous over the members currently up)."""
        live = [address for address, shard in self.shards.items() if shard.up]
        return self.shards[place(key, live)] if live else None

    def _group(self, blocks: Sequence[Block]) -> dict[Shard | None, list[int]]:
        groups: dict[Shard | None, list[int]] = {}
        for i, block in enumerate(blocks):
            groups.setdefault(self.owner(block.key), []).append(i)
        return groups

    def _failed(self, shard: Shard, error: Exception) -> None:
        shard.failed(error)
        self.stats.shard_errors[shard.address] += 1

    # -- lookup -----------------------------------------------------------------------------------

    async def lookup(self, blocks: Sequence[Block]) -> int:
        """How many leading blocks of a prefix are stored (one round, all shards in parallel)."""
        same_namespace(blocks)
        self.stats.lookups += 1
        if not blocks:
            return 0
        groups = self._group(blocks)

        async def first_missing(shard: Shard | None, positions: list[int]) -> int:
            if shard is None:
                return positions[0]
            try:
                hits = await shard.lookup([blocks[i].key for i in positions])
            except grpc.RpcError as exc:
                self._failed(shard, exc)
                return positions[0]
            shard.succeeded()
            return positions[hits] if hits < len(positions) else len(blocks)

        ends = await asyncio.gather(*(first_missing(shard, positions) for shard, positions in groups.items()))
        return min(ends)

    # -- get --------------------------------------------------------------------------------------

    async def get(self, blocks: Sequence[Block], layer_begin: int = 0, layer_end: int | None = None,
                  layer_major: bool = False, into: Sequence[Buffer] | None = None) -> list[BlockData]:
        """The leading run of `blocks` that could be read and verified, layers [layer_begin, layer_end).

        With `into`, block i's layers land in into[i] (layer-major, at least (end - begin) * layer_bytes
        long) and BlockData.payload is a view of it; reused, pre-touched buffers avoid page faults.
        """
        plans = self._plan_get(blocks, layer_begin, layer_end, layer_major, into)

        async def run(plan: _ShardGet) -> None:
            try:
                channel = await plan.shard.data_channel()
                if channel is not None:
                    await asyncio.to_thread(self._get_over_channel, channel, plan)
                else:
                    await self._get_grpc(plan.shard, plan.request, plan.assembly)
            except (grpc.RpcError, TransportError, CorruptRecord) as exc:
                self._get_failed(plan, exc)
            else:
                plan.shard.succeeded()

        await asyncio.gather(*(run(plan) for plan in plans))
        return self._finish_get(plans)

    def _plan_get(self, blocks: Sequence[Block], layer_begin: int, layer_end: int | None, layer_major: bool,
                  into: Sequence[Buffer] | None) -> list["_ShardGet"]:
        same_namespace(blocks)
        if into is not None and len(into) < len(blocks):
            raise ValueError(f"`into` has {len(into)} buffers for {len(blocks)} blocks")
        plans = []
        for shard, positions in self._group(blocks).items():
            if shard is None:
                continue
            request = pb.GetRequest(keys=[blocks[i].key for i in positions], layer_begin=layer_begin,
                                    layer_end=layer_end or 0, stop_at_miss=True,
                                    order=pb.LAYER_MAJOR if layer_major else pb.BLOCK_MAJOR)
            plans.append(_ShardGet(shard, request,
                                   _Assembly(blocks, positions, layer_begin, layer_end, into, self.stats)))
        return plans

    def _get_over_channel(self, channel: DataChannel, plan: "_ShardGet") -> None:
        channel.get(plan.request, plan.assembly.sink, plan.assembly.received, self.config.timeout_s)

    def _get_failed(self, plan: "_ShardGet", exc: Exception) -> None:
        if isinstance(exc, CorruptRecord):  # a daemon that breaks the protocol
            self.stats.miss_causes[exc.cause] += 1
        self._failed(plan.shard, exc)

    def _finish_get(self, plans: list["_ShardGet"]) -> list[BlockData]:
        results: dict[int, BlockData] = {}
        for plan in plans:
            results.update(plan.assembly.results())
        prefix: list[BlockData] = []
        while len(prefix) in results:
            prefix.append(results[len(prefix)])
        self.stats.hit_blocks += len(prefix)
        self.stats.bytes_read += sum(len(d.payload) for d in prefix)
        return prefix

    @staticmethod
    async def _get_grpc(shard: Shard, request: pb.GetRequest, assembly: "_Assembly") -> None:
        pending: pb.GetPartHead | None = None
        async for message in shard.get(request):
            if pending is None:
                head = pb.GetPartHead.FromString(message)
                if assembly.accept(head) or (head.status == pb.OK and head.payload_bytes):
                    pending = head  # its payload is the next message, wanted or not
                continue
            head, pending = pending, None
            assembly.received_message(head, message)

    # -- put --------------------------------------------------------------------------------------

    async def put(self, items: Sequence[tuple[Block, bytes]], num_layers: int, traffic_class: str = "chat") -> PutSummary:
        """Store blocks with their layer-major payloads; failures are counted, never raised."""
        same_namespace([block for block, _ in items])
        records = [build_record(block, payload, num_layers, traffic_class) for block, payload in items]
        summary = PutSummary()

        async def put_to(shard: Shard | None, positions: list[int]) -> None:
            if shard is None:
                summary.failed += len(positions)
                return
            mine = [records[i] for i in positions]
            try:
                channel = await shard.data_channel()
                if channel is not None:
                    results = await asyncio.to_thread(channel.put, mine, self.config.timeout_s)
                else:
                    results = await shard.put(self._put_messages(mine))
            except (grpc.RpcError, TransportError) as exc:
                self._failed(shard, exc)
                summary.failed += len(positions)
                return
            shard.succeeded()
            summary.stored += sum(1 for r in results if r == pb.STORED)
            summary.existed += sum(1 for r in results if r == pb.EXISTS)
            self.stats.bytes_written += sum(len(h) + len(p) for (h, p), r in zip(mine, results) if r == pb.STORED)

        await asyncio.gather(*(put_to(shard, positions)
                               for shard, positions in self._group([b for b, _ in items]).items()))
        return summary

    def _put_messages(self, records: Sequence[tuple[bytes, bytes]]) -> Iterator[bytes]:
        chunk = self.config.put_chunk_bytes
        for header, payload in records:
            yield pb.PutHead(record_bytes=len(header) + len(payload)).SerializeToString()
            yield header
            if len(payload) <= chunk:
                yield payload
            else:
                view = memoryview(payload)
                for start in range(0, len(payload), chunk):
                    yield bytes(view[start : start + chunk])

    # -- retention and admin ----------------------------------------------------------------------

    async def touch(self, blocks: Sequence[Block], traffic_class: str = "") -> int:
        return await self._per_shard(blocks, lambda shard, keys: shard.touch(keys, traffic_class))

    async def delete(self, blocks: Sequence[Block]) -> int:
        return await self._per_shard(blocks, lambda shard, keys: shard.delete(keys))

    async def _per_shard(self, blocks: Sequence[Block], call) -> int:
        async def one(shard: Shard | None, positions: list[int]) -> int:
            if shard is None:
                return 0
            try:
                count = await call(shard, [blocks[i].key for i in positions])
            except grpc.RpcError as exc:
                self._failed(shard, exc)
                return 0
            shard.succeeded()
            return count
        return sum(await asyncio.gather(*(one(s, p) for s, p in self._group(blocks).items())))

    def last_errors(self) -> dict[str, str]:
        """The last error of each daemon that has failed a call."""
        return {address: shard.last_error for address, shard in self.shards.items() if shard.last_error}

    async def server_stats(self) -> dict[str, dict[str, float] | None]:
        """Each daemon's Stats; None for a daemon that did not answer."""
        async def one(shard: Shard) -> dict[str, float] | None:
            try:
                return await shard.stats()
            except grpc.RpcError as exc:
                self._failed(shard, exc)
                return None
        values = await asyncio.gather(*(one(shard) for shard in self.shards.values()))
        return dict(zip(self.shards, values))


@dataclass(slots=True)
class _ShardGet:
    shard: Shard
    request: pb.GetRequest
    assembly: "_Assembly"


class _Assembly:
    """One shard's share of a Get: checks every part and gathers verified blocks.

    Runs on the data channel's worker thread or on the event loop, never on both at once.
    """

    def __init__(self, blocks: Sequence[Block], positions: list[int], layer_begin: int, layer_end: int | None,
                 into: Sequence[Buffer] | None, stats: ClientStats) -> None:
        self.blocks, self.positions = blocks, positions
        self.layer_begin, self.layer_end = layer_begin, layer_end
        self.into, self.stats = into, stats
        self.headers: dict[int, RecordHeader] = {}
        self.payloads: dict[int, Buffer] = {}
        self.received_bytes: dict[int, int] = {}
        self.broken: set[int] = set()

    def _miss(self, local: int, cause: str) -> None:
        self.stats.miss_causes[cause] += 1
        self.broken.add(local)

    def accept(self, head: pb.GetPartHead) -> bool:
        """Check a part's head; True when its payload is wanted."""
        if head.index >= len(self.positions):
            raise CorruptRecord("protocol", f"part index {head.index} out of range")
        local = head.index
        if head.status != pb.OK:
            self._miss(local, head.cause or pb.PartStatus.Name(head.status).lower())
            return False
        if head.header:
            try:
                header = decode_header(head.header)
                header.check_expected(self.blocks[self.positions[local]])
                self.headers[local] = header
            except CorruptRecord as exc:  # a collision or a substituted block: a miss
                self._miss(local, exc.cause)
        return bool(head.payload_bytes) and local not in self.broken and local in self.headers

    def destination(self, head: pb.GetPartHead) -> memoryview:
        """Where this part's payload belongs in its block's buffer."""
        local = head.index
        header = self.headers[local]
        end = self.layer_end or header.n_layers
        size = (end - self.layer_begin) * header.layer_bytes
        if local not in self.payloads:
            if self.into is not None:
                target = memoryview(self.into[self.positions[local]]).cast("B")
                if len(target) < size:
                    raise ValueError(f"into[{self.positions[local]}] has {len(target)} bytes; the block needs {size}")
                self.payloads[local] = target[:size]
            else:
                self.payloads[local] = memoryview(bytearray(size))
        start = (head.layer_begin - self.layer_begin) * header.layer_bytes
        if head.layer_begin < self.layer_begin or start + head.payload_bytes > size:
            raise CorruptRecord("protocol", "part outside the requested layer range")
        return self.payloads[local][start : start + head.payload_bytes]

    def sink(self, head: pb.GetPartHead) -> tuple[memoryview, int] | None:
        if not self.accept(head):
            return None
        layer_bytes = self.headers[head.index].layer_bytes
        return self.destination(head), layer_bytes * max(1, VERIFY_CHUNK_BYTES // layer_bytes)

    def received(self, head: pb.GetPartHead, offset: int, data: memoryview | bytes) -> None:
        """Layers [offset, offset + len(data)) of a part have arrived: verify them."""
        local = head.index
        if local in self.broken:
            return
        header = self.headers[local]
        try:
            header.check_layers(data, head.layer_begin + offset // header.layer_bytes)
        except CorruptRecord as exc:
            self._miss(local, exc.cause)
            return
        self.received_bytes[local] = self.received_bytes.get(local, 0) + len(data)

    def received_message(self, head: pb.GetPartHead, message: bytes) -> None:
        """A gRPC payload, which arrives as its own bytes: keep it when it is the whole block."""
        local = head.index
        if local in self.broken or local not in self.headers:
            return
        header = self.headers[local]
        whole = (head.layer_begin == self.layer_begin
                 and head.layer_end == (self.layer_end or header.n_layers))
        if whole and self.into is None:
            self.payloads[local] = message
            self.received(head, 0, message)
            return
        target = self.destination(head)
        target[:] = message
        self.received(head, 0, target)

    def results(self) -> dict[int, BlockData]:
        out = {}
        for local, header in self.headers.items():
            payload = self.payloads.get(local)
            if local in self.broken or payload is None or self.received_bytes.get(local, 0) != len(payload):
                continue  # missed, or the stream ended before all its layers arrived
            end = self.layer_end or header.n_layers
            out[self.positions[local]] = BlockData(self.blocks[self.positions[local]], header,
                                                   self.layer_begin, end, payload)
        return out


class KVClient:
    """The blocking face of AsyncKVClient, for scripts and threads; runs its own event loop thread."""

    def __init__(self, config: ClientConfig | Sequence[str] | str) -> None:
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client", daemon=True)
        self._thread.start()
        self._async = self._run(_make_async(config))
        self._pool = ThreadPoolExecutor(max_workers=len(self._async.shards), thread_name_prefix="kvstore-get")

    @property
    def stats(self) -> ClientStats:
        return self._async.stats

    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def lookup(self, blocks: Sequence[Block]) -> int:
        return self._run(self._async.lookup(blocks))

    def get(self, blocks: Sequence[Block], layer_begin: int = 0, layer_end: int | None = None,
            layer_major: bool = False, into: Sequence[Buffer] | None = None) -> list[BlockData]:
        """As AsyncKVClient.get. When every daemon involved has a known data channel, the sockets are
        driven from this thread (and a pool thread per extra daemon), skipping two thread hops."""
        client = self._async
        plans = client._plan_get(blocks, layer_begin, layer_end, layer_major, into)
        channels = [plan.shard.known_data_channel() for plan in plans]
        if not plans or any(channel is None for channel in channels):
            return self._run(client.get(blocks, layer_begin, layer_end, layer_major, into))

        def run(plan, channel) -> None:
            try:
                client._get_over_channel(channel, plan)
            except (TransportError, CorruptRecord) as exc:
                client._get_failed(plan, exc)
            else:
                plan.shard.succeeded()

        extra = [self._pool.submit(run, plan, channel) for plan, channel in zip(plans[1:], channels[1:])]
        run(plans[0], channels[0])
        for future in extra:
            future.result()
        return client._finish_get(plans)

    def put(self, items: Sequence[tuple[Block, bytes]], num_layers: int, traffic_class: str = "chat") -> PutSummary:
        return self._run(self._async.put(items, num_layers, traffic_class))

    def touch(self, blocks: Sequence[Block], traffic_class: str = "") -> int:
        return self._run(self._async.touch(blocks, traffic_class))

    def delete(self, blocks: Sequence[Block]) -> int:
        return self._run(self._async.delete(blocks))

    def server_stats(self) -> dict[str, dict[str, float] | None]:
        return self._run(self._async.server_stats())

    def last_errors(self) -> dict[str, str]:
        return self._async.last_errors()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._loop.is_running():
            self._run(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _make_async(config) -> AsyncKVClient:
    return AsyncKVClient(config)  # created on the loop thread, where its channels live


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
