"""The client of a kvstore cluster: longest-prefix lookup, verified gets and chunked puts over shards.

Contract for callers on an engine's path: a dead, slow or misbehaving daemon never raises here; its
blocks are misses, counted in `stats`, and the daemon is retried after a backoff. Only a caller's own
mistake (mixed namespaces, a payload that does not fit the layout) raises ValueError.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvstore.block import Block, same_namespace
from kvstore.client.assembly import BlockData, Buffer, GetAssembly, ShardGet
from kvstore.client.config import ClientConfig
from kvstore.client.cost import BandwidthMeter
from kvstore.client.dataplane import DataChannel, SharedBuffer, SharedPlacement, TransportError, put_head
from kvstore.client.host_tier import HostTier
from kvstore.client.placement import place
from kvstore.client.shard import Shard
from kvstore.eviction import ReuseHint
from kvstore.proto import pb
from kvstore.record import CorruptRecord, build_record, decode_header
from kvstore.stats import Stats

# A Get the data channel could not serve, before any part arrived, is repeated over gRPC with these codes.
_RETRY_GET_CODES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})


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
    tier_hits: Counter = field(default_factory=Counter)  # blocks served by "host" (this process) or "daemon"
    shard_errors: Counter = field(default_factory=Counter)  # address -> failed calls
    data_fallbacks: Counter = field(default_factory=Counter)  # address -> calls its data channel refused, sent by gRPC
    bytes_read: int = 0
    bytes_written: int = 0


class AsyncKVClient:
    def __init__(self, config: ClientConfig | Sequence[str] | str) -> None:
        self.config = config if isinstance(config, ClientConfig) else ClientConfig(servers=tuple(
            config.split(",") if isinstance(config, str) else config))
        self.shards = {address: Shard(address, self.config) for address in self.config.servers}
        self.stats = ClientStats()
        self.host = HostTier(self.config.host_tier_bytes, self.config.host_block_bytes,
                             self.config.host_tier_pinned) if self.config.host_tier_bytes else None
        self.bandwidth = BandwidthMeter()
        self._shared: list[SharedBuffer] = []
        try:  # where gRPC fallbacks of data-channel calls made on worker threads run
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    async def close(self) -> None:
        await asyncio.gather(*(shard.close() for shard in self.shards.values()))
        for shared in self._shared:
            shared.close()

    async def __aenter__(self) -> AsyncKVClient:
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
        in_host = self.host.leading_hits([b.key for b in blocks]) if self.host is not None else 0
        if in_host == len(blocks):
            return in_host
        return in_host + await self._lookup_daemons(blocks[in_host:])

    async def present(self, blocks: Sequence[Block]) -> list[bool]:
        """Whether each block is stored, each on its own rather than as a prefix (one round: a Lookup to
        every daemon involved, at once). For state kept only at some blocks of a prefix, such as a sliding
        window's. A daemon that fails answers absent for its blocks."""
        same_namespace(blocks)
        out = [False] * len(blocks)
        in_host = self.host.present([b.key for b in blocks]) if self.host is not None else out

        async def ask(shard: Shard | None, positions: list[int]) -> None:
            wanted = [i for i in positions if not in_host[i]]
            if shard is None or not wanted:
                return
            try:
                found = await shard.present([blocks[i].key for i in wanted])
            except grpc.RpcError as exc:
                self._failed(shard, exc)
                return
            shard.succeeded()
            for i, stored in zip(wanted, found, strict=True):
                out[i] = stored

        await asyncio.gather(*(ask(shard, positions) for shard, positions in self._group(blocks).items()))
        return [held or stored for held, stored in zip(in_host, out, strict=True)]

    async def _lookup_daemons(self, blocks: Sequence[Block]) -> int:
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
        from_host = self._get_from_host(blocks, layer_begin, layer_end, into)
        if len(from_host) == len(blocks):
            return from_host
        self._loop = asyncio.get_running_loop()
        rest = len(from_host)
        plans = self._plan_get(blocks[rest:], layer_begin, layer_end, layer_major, into[rest:] if into else None)

        async def run(plan: ShardGet) -> None:
            started = time.perf_counter()
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
                self._measured(plan, time.perf_counter() - started)

        await asyncio.gather(*(run(plan) for plan in plans))
        return from_host + self._finish_get(plans)

    def _get_from_host(self, blocks: Sequence[Block], layer_begin: int, layer_end: int | None,
                       into: Sequence[Buffer] | None) -> list[BlockData]:
        """The leading blocks held in the host tier, copied out (into `into` when given)."""
        same_namespace(blocks)
        if self.host is None or not blocks:
            return []
        started = time.perf_counter()
        pinned = self.host.pin([b.key for b in blocks])
        try:
            out = []
            for i, held in enumerate(pinned):
                header = held.header
                end = layer_end or header.n_layers
                if end > header.n_layers:
                    break
                source = self.host.slot_view(held.slot, header.payload_len)[
                    layer_begin * header.layer_bytes : end * header.layer_bytes]
                if into is not None:
                    target = memoryview(into[i]).cast("B")[: len(source)]
                    if len(target) < len(source):
                        raise ValueError(f"into[{i}] has {len(target)} bytes; the block needs {len(source)}")
                    target[:] = source
                    payload: Buffer = target
                else:
                    payload = bytes(source)
                out.append(BlockData(blocks[i], header, layer_begin, end, payload))
        finally:
            self.host.unpin(pinned)
        self.stats.tier_hits["host"] += len(out)
        self.bandwidth.record("host", sum(len(d.payload) for d in out), time.perf_counter() - started)
        return out

    def block_sources(self, blocks: Sequence[Block]) -> list[str]:
        """Where each block would be read from now: "host", or the owning daemon's address."""
        in_host = self.host.leading_hits([b.key for b in blocks]) if self.host is not None else 0
        owners = [self.owner(b.key) for b in blocks[in_host:]]
        return ["host"] * in_host + [owner.address if owner else "none" for owner in owners]

    def _plan_get(self, blocks: Sequence[Block], layer_begin: int, layer_end: int | None, layer_major: bool,
                  into: Sequence[Buffer] | None) -> list[ShardGet]:
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
            plans.append(ShardGet(shard, request, GetAssembly(blocks, positions, layer_begin, layer_end, into,
                                                              self.stats.miss_causes),
                                  self._in_shared_buffer([into[i] for i in positions]) if into else None))
        return plans

    def _in_shared_buffer(self, buffers: Sequence[Buffer], layer_stride: int = 0) -> SharedPlacement | None:
        """Where `buffers` lie in one of our shared buffers; None if they do not all lie in one."""
        for shared in self._shared:
            offsets = [shared.offset_of(b) for b in buffers]
            if all(offset is not None for offset in offsets):
                return SharedPlacement(shared, offsets, layer_stride)
        return None

    async def shared_buffer(self, nbytes: int) -> memoryview:
        """Memory the daemons on this host write into directly: Get into views of it costs no copy here.

        Lent to every same-host daemon (on each pooled data connection); elsewhere it is plain memory.
        It is unmapped when the client closes: no view of it (a tensor from torch.frombuffer included)
        may be used after close().
        """
        shared = SharedBuffer(nbytes)
        for shard in self.shards.values():
            try:
                channel = await shard.data_channel()
                if channel is not None and channel.same_host:
                    await asyncio.to_thread(channel.adopt, shared, self.config.timeout_s)
            except (grpc.RpcError, TransportError) as exc:
                self._failed(shard, exc)
        self._shared.append(shared)
        return shared.view

    def _get_over_channel(self, channel: DataChannel, plan: ShardGet) -> None:
        self._channel_get(channel, plan.shard, plan.request, plan.assembly, plan.shared)

    def _channel_get(self, channel: DataChannel, shard: Shard, request: pb.GetRequest, assembly,
                     shared: SharedPlacement | None = None) -> None:
        """A Get over the data channel, from a worker thread (never the event loop's). Refused or unavailable
        before any part arrived (the daemon's connection or memory limits, a data channel that is gone), it
        goes over gRPC instead (reads are safe to repeat): counted in stats.data_fallbacks, and the daemon is
        not marked down for it. `assembly`: a GetAssembly or the loader's LoadAssembly."""
        parts = 0

        def sink(head: pb.GetPartHead):
            nonlocal parts
            parts += 1
            return assembly.sink(head)

        try:
            channel.get(request, sink, assembly.received, self.config.timeout_s, shared)
        except TransportError as exc:
            if parts or exc.code not in _RETRY_GET_CODES or self._loop is None:
                raise
            self._fell_back(shard, exc)
            try:
                asyncio.run_coroutine_threadsafe(self._get_grpc(shard, request, assembly), self._loop).result()
            except grpc.RpcError as rpc:  # reported like the data channel's failures
                raise TransportError(rpc.code().name, rpc.details() or "") from rpc

    def _fell_back(self, shard: Shard, error: TransportError) -> None:
        shard.data_refused(error)
        self.stats.data_fallbacks[shard.address] += 1

    def _measured(self, plan: ShardGet, seconds: float) -> None:
        self.bandwidth.record(plan.shard.address, plan.assembly.bytes_received, seconds)

    def _get_failed(self, plan: ShardGet, exc: Exception) -> None:
        if isinstance(exc, CorruptRecord):  # a daemon that breaks the protocol
            self.stats.miss_causes[exc.cause] += 1
        self._failed(plan.shard, exc)

    def _finish_get(self, plans: list[ShardGet]) -> list[BlockData]:
        results: dict[int, BlockData] = {}
        for plan in plans:
            results.update(plan.assembly.results())
        prefix: list[BlockData] = []
        while len(prefix) in results:
            prefix.append(results[len(prefix)])
        self.stats.hit_blocks += len(prefix)
        self.stats.tier_hits["daemon"] += len(prefix)
        self.stats.bytes_read += sum(len(d.payload) for d in prefix)
        if self.host is not None:
            for data in reversed(prefix):  # leaf first, so parents stay the most recent
                if data.layer_begin == 0 and data.layer_end == data.header.n_layers:
                    self.host.put(data.header, data.payload)
        return prefix

    @staticmethod
    async def _get_grpc(shard: Shard, request: pb.GetRequest, assembly: GetAssembly) -> None:
        pending: pb.GetPartHead | None = None
        async for message in shard.get(request):
            if pending is None:
                head = pb.GetPartHead.FromString(message)
                assembly.accept(head)
                if head.status == pb.OK and head.payload_bytes:
                    pending = head  # its payload is the next message, wanted or not
                continue
            head, pending = pending, None
            assembly.received_message(head, message)

    # -- put --------------------------------------------------------------------------------------

    async def put(self, items: Sequence[tuple[Block, bytes]], num_layers: int, traffic_class: str = "chat",
                  hint: ReuseHint | None = None) -> PutSummary:
        """Store blocks with their layer-major payloads; failures are counted, never raised.

        Records go out leaf first (the reverse of `items`, given in prefix order), so that in the daemons'
        recency order a parent is never older than its children. `hint`: of the prompt these blocks come
        from, how many full blocks were cached and how many it has (for the daemons' eviction policy)."""
        same_namespace([block for block, _ in items])
        items = list(reversed(items))
        records = [build_record(block, payload, num_layers, traffic_class) for block, payload in items]
        summary = PutSummary()
        if self.host is not None:  # the next turn of this session is likely to want them; leaf first
            for header, payload in records:
                self.host.put(decode_header(header), payload)

        async def put_to(shard: Shard | None, positions: list[int]) -> None:
            if shard is None:
                summary.failed += len(positions)
                return
            mine = [records[i] for i in positions]
            try:
                channel = await shard.data_channel()
                results = None
                if channel is not None:
                    try:
                        results = await asyncio.to_thread(channel.put, mine, self.config.timeout_s, hint)
                    except TransportError as exc:  # refused before anything was stored: gRPC carries it
                        if not exc.refused:
                            raise
                        self._fell_back(shard, exc)
                if results is None:
                    results = await shard.put(self._put_messages(mine, hint))
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

    def _put_messages(self, records: Sequence[tuple[bytes, bytes]], hint: ReuseHint | None) -> Iterator[bytes]:
        chunk = self.config.put_chunk_bytes
        for header, payload in records:
            yield put_head(len(header) + len(payload), hint)
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

    async def advise(self, blocks: Sequence[Block], continues: bool) -> int:
        """Once a reply is done: does the conversation whose prompt is `blocks` go on? (True: the reply
        ended in a tool call its agent will answer; False: the session was closed.) The daemons' prefix-
        aware eviction keeps the blocks of conversations that go on and gives up the others first; it
        leaves alone the blocks several prompts branch from (a shared system prompt). How many are held."""
        return await self._per_shard(blocks, lambda shard, keys: shard.advise(keys, continues))

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

    async def server_stats(self) -> dict[str, Stats | None]:
        """Each daemon's Stats (its samples, kvstore.stats); None for a daemon that did not answer."""
        async def one(shard: Shard) -> Stats | None:
            try:
                return await shard.stats()
            except grpc.RpcError as exc:
                self._failed(shard, exc)
                return None
        values = await asyncio.gather(*(one(shard) for shard in self.shards.values()))
        return dict(zip(self.shards, values))
