"""The client of a kvstore cluster: longest-prefix lookup, verified gets and chunked puts over shards.

Contract for callers on an engine's path: a dead, slow or misbehaving daemon never raises here; its
blocks are misses, counted in `stats`, and the daemon is retried after a backoff. Only a caller's own
mistake (mixed namespaces, a payload that does not fit the layout) raises ValueError.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Iterator, Sequence, TypeVar

import grpc

from kvstore.block import Block, same_namespace
from kvstore.client.config import ClientConfig
from kvstore.client.placement import place
from kvstore.client.shard import Shard
from kvstore.proto import pb
from kvstore.record import CorruptRecord, RecordHeader, build_record, decode_header

T = TypeVar("T")


@dataclass(slots=True)
class BlockData:
    """A verified block as read: layers [layer_begin, layer_end) of its layer-major payload."""

    block: Block
    header: RecordHeader
    layer_begin: int
    layer_end: int
    payload: bytes  # (layer_end - layer_begin) * header.layer_bytes bytes, layer-major

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
                  layer_major: bool = False) -> list[BlockData]:
        """The leading run of `blocks` that could be read and verified, layers [layer_begin, layer_end)."""
        same_namespace(blocks)
        if not blocks:
            return []
        results: list[BlockData | None] = [None] * len(blocks)
        groups = self._group(blocks)
        await asyncio.gather(*(self._get_from(shard, blocks, positions, results, layer_begin, layer_end or 0,
                                              layer_major)
                               for shard, positions in groups.items() if shard is not None))
        prefix: list[BlockData] = []
        for data in results:
            if data is None:
                break
            prefix.append(data)
        self.stats.hit_blocks += len(prefix)
        self.stats.bytes_read += sum(len(d.payload) for d in prefix)
        return prefix

    async def _get_from(self, shard: Shard, blocks: Sequence[Block], positions: list[int],
                        results: list[BlockData | None], layer_begin: int, layer_end: int, layer_major: bool) -> None:
        request = pb.GetRequest(keys=[blocks[i].key for i in positions], layer_begin=layer_begin,
                                layer_end=layer_end, order=pb.LAYER_MAJOR if layer_major else pb.BLOCK_MAJOR,
                                stop_at_miss=True)
        headers: dict[int, RecordHeader] = {}
        parts: dict[int, list[bytes]] = {}
        broken: set[int] = set()
        pending: pb.GetPartHead | None = None
        try:
            async for message in shard.get(request):
                if pending is None:
                    head = pb.GetPartHead.FromString(message)
                    if head.index >= len(positions):
                        raise CorruptRecord("protocol", f"part index {head.index} out of range")
                    if head.status != pb.OK:
                        self.stats.miss_causes[head.cause or pb.PartStatus.Name(head.status).lower()] += 1
                        broken.add(head.index)
                        continue
                    if head.header:
                        try:
                            header = decode_header(head.header)
                            header.check_expected(blocks[positions[head.index]])
                            headers[head.index] = header
                        except CorruptRecord as exc:  # a collision or a substituted block: a miss
                            self.stats.miss_causes[exc.cause] += 1
                            broken.add(head.index)
                    if head.payload_bytes:
                        pending = head
                    continue
                head, pending = pending, None
                if head.index in broken:
                    continue
                header = headers.get(head.index)
                if header is None or len(message) != head.payload_bytes:
                    raise CorruptRecord("protocol", "payload without a verified header")
                try:
                    header.check_layers(message, head.layer_begin)
                except CorruptRecord as exc:
                    self.stats.miss_causes[exc.cause] += 1
                    broken.add(head.index)
                    continue
                parts.setdefault(head.index, []).append(message)
        except grpc.RpcError as exc:
            self._failed(shard, exc)
        except CorruptRecord as exc:  # a daemon that breaks the protocol or serves foreign blocks
            self.stats.miss_causes[exc.cause] += 1
            self._failed(shard, exc)
        else:
            shard.succeeded()
        for local, header in headers.items():
            if local in broken or local not in parts:
                continue
            end = layer_end or header.n_layers
            pieces = parts[local]
            payload = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            if len(payload) != (end - layer_begin) * header.layer_bytes:
                continue  # the stream ended early: not all layers arrived
            results[positions[local]] = BlockData(blocks[positions[local]], header, layer_begin, end, payload)

    # -- put --------------------------------------------------------------------------------------

    async def put(self, items: Sequence[tuple[Block, bytes]], num_layers: int, traffic_class: str = "chat") -> PutSummary:
        """Store blocks with their layer-major payloads; failures are counted, never raised."""
        same_namespace([block for block, _ in items])
        records = [build_record(block, payload, num_layers, traffic_class) for block, payload in items]
        summary = PutSummary()
        groups = self._group([block for block, _ in items])

        async def put_to(shard: Shard | None, positions: list[int]) -> None:
            if shard is None:
                summary.failed += len(positions)
                return
            try:
                results = await shard.put(self._put_messages([records[i] for i in positions]))
            except grpc.RpcError as exc:
                self._failed(shard, exc)
                summary.failed += len(positions)
                return
            shard.succeeded()
            summary.stored += sum(1 for r in results if r == pb.STORED)
            summary.existed += sum(1 for r in results if r == pb.EXISTS)
            self.stats.bytes_written += sum(len(records[i][0]) + len(records[i][1])
                                            for i, r in zip(positions, results) if r == pb.STORED)

        await asyncio.gather(*(put_to(shard, positions) for shard, positions in groups.items()))
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


class KVClient:
    """The blocking face of AsyncKVClient, for scripts and threads; runs its own event loop thread."""

    def __init__(self, config: ClientConfig | Sequence[str] | str) -> None:
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client", daemon=True)
        self._thread.start()
        self._async = self._run(_make_async(config))

    @property
    def stats(self) -> ClientStats:
        return self._async.stats

    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def lookup(self, blocks: Sequence[Block]) -> int:
        return self._run(self._async.lookup(blocks))

    def get(self, blocks: Sequence[Block], layer_begin: int = 0, layer_end: int | None = None,
            layer_major: bool = False) -> list[BlockData]:
        return self._run(self._async.get(blocks, layer_begin, layer_end, layer_major))

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
