"""The one Get path, shared by every face of the client (AsyncKVClient.get, KVClient.get, the loader).

    from_host      the leading blocks held in this process's host tier, copied out
    plan           the rest, grouped by the daemon to read each from: one ShardGet (request + assembly) each
    fetch          a daemon's share over the transport its shard chose (kvstore/client/transport.py):
                   `fetch` from the event loop, `fetch_blocking` from any other thread; a failure is
                   counted (the daemon marked down, and the miss cause of one that broke the protocol),
                   never raised, and what a daemon delivered is measured for the load-or-recompute estimates
    finish         the verified leading run, counted and kept in the host tier

`get` runs them from the event loop; `get_blocking` from an engine thread, driving the data channels'
sockets from that thread (and the pool, for every extra daemon) when every daemon involved has a known
one, which skips two thread hops. Each daemon's share, once done, is told to `after_get` (the copies of
hot blocks, kvstore/client/copier.py). `fetch_ahead` is plan and fetch alone, for prefetches
(prefetch.py): whole blocks from the daemons, neither counted as hits nor kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Container, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc

from kvstore.block import Block, same_namespace
from kvstore.client.assembly import BlockData, Buffer, GetAssembly, kv_bytes
from kvstore.client.cost import BandwidthMeter
from kvstore.client.dataplane import SharedBuffer, SharedPlacement, TransportError
from kvstore.client.host_tier import HostTier
from kvstore.client.shard import Shard
from kvstore.client.stats import ClientStats
from kvstore.client.transport import Offload, Transport
from kvstore.proto import pb
from kvstore.record import CorruptRecord


@dataclass(slots=True)
class ShardGet:
    shard: Shard
    request: pb.GetRequest
    assembly: GetAssembly
    shared: SharedPlacement | None = None  # where the destinations lie in a shared buffer


# told each daemon's share of a get or load and the positions it delivered, once it is done
AfterGet = Callable[[Shard, GetAssembly, Container[int]], None]


class GetPipeline:
    def __init__(self, stats: ClientStats, bandwidth: BandwidthMeter, host: HostTier | None,
                 reader: Callable[[bytes], Shard | None], executor: Executor, after_get: AfterGet | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.stats, self.bandwidth, self.host = stats, bandwidth, host
        self.reader = reader  # key -> the live daemon to read it from (its owner or a copy's holder), or None
        self.after_get = after_get
        self.executor = executor
        self.loop = loop  # the event loop get_blocking hands a get to when not every data channel is known
        self.shared_buffers: list[SharedBuffer] = []  # memory lent to same-host daemons (shared_buffer)

    # -- the whole get ------------------------------------------------------------------------------

    async def get(self, blocks: Sequence[Block], layer_begin: int = 0, layer_end: int | None = None,
                  layer_major: bool = False, into: Sequence[Buffer] | None = None) -> list[BlockData]:
        """The leading run of `blocks` that could be read and verified, from the event loop."""
        from_host, plans = self._host_then_plans(blocks, layer_begin, layer_end, layer_major, into)
        if plans is None:
            return from_host
        await self._fetch_all(plans)
        return from_host + self.finish(plans)

    def get_blocking(self, blocks: Sequence[Block], layer_begin: int = 0, layer_end: int | None = None,
                     layer_major: bool = False, into: Sequence[Buffer] | None = None) -> list[BlockData]:
        """As `get`, from a thread other than the event loop's."""
        from_host, plans = self._host_then_plans(blocks, layer_begin, layer_end, layer_major, into)
        if plans is None:
            return from_host
        transports = [plan.shard.known_transport() for plan in plans]
        known = [transport for transport in transports if transport is not None]
        if len(known) < len(plans):
            if self.loop is None:
                raise RuntimeError("a blocking get needs the event loop the client was made on")
            asyncio.run_coroutine_threadsafe(self._fetch_all(plans), self.loop).result()
        elif plans:
            extra = [self.executor.submit(self.fetch_blocking, plan, transport)
                     for plan, transport in zip(plans[1:], known[1:])]
            self.fetch_blocking(plans[0], known[0])
            for future in extra:
                future.result()
        return from_host + self.finish(plans)

    def _host_then_plans(self, blocks: Sequence[Block], layer_begin: int, layer_end: int | None, layer_major: bool,
                         into: Sequence[Buffer] | None) -> tuple[list[BlockData], list[ShardGet] | None]:
        """What the host tier holds of the leading blocks, and each daemon's share of the rest (None: nothing
        is left to read)."""
        if into is not None and blocks and blocks[0].codec is not None:
            raise ValueError("a Get into caller's buffers takes raw blocks; read encoded ones without `into` "
                             "and decode them with BlockData.kv()")
        from_host = self.from_host(blocks, layer_begin, layer_end, into)
        rest = len(from_host)
        if rest == len(blocks):
            return from_host, None
        return from_host, self.plan(blocks[rest:], layer_begin, layer_end, layer_major, into[rest:] if into else None)

    async def fetch_ahead(self, blocks: Sequence[Block]) -> dict[int, BlockData]:
        """Whole blocks of `blocks` from the daemons (each daemon's share up to its first miss), by position,
        from the event loop: a read ahead of the engine's, so neither the host tier is consulted nor what
        arrives counted as a hit or kept; a failure is counted as for any Get, never raised."""
        plans = self.plan(blocks, 0, None, False, None)
        await self._fetch_all(plans)
        return self._delivered(plans)

    async def _fetch_all(self, plans: Sequence[ShardGet]) -> None:
        await asyncio.gather(*(self.fetch(plan.shard, plan.request, plan.assembly, plan.shared) for plan in plans))

    # -- the host tier ------------------------------------------------------------------------------

    def from_host(self, blocks: Sequence[Block], layer_begin: int, layer_end: int | None,
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
        self.bandwidth.record("host", sum(kv_bytes(d.header, d.block.codec) for d in out),
                              time.perf_counter() - started)
        return out

    # -- planning -----------------------------------------------------------------------------------

    def plan(self, blocks: Sequence[Block], layer_begin: int, layer_end: int | None, layer_major: bool,
             into: Sequence[Buffer] | None) -> list[ShardGet]:
        """One ShardGet per live daemon owning some of `blocks` (blocks no daemon is up for are left out)."""
        same_namespace(blocks)
        if into is not None and len(into) < len(blocks):
            raise ValueError(f"`into` has {len(into)} buffers for {len(blocks)} blocks")
        groups: dict[Shard, list[int]] = {}
        for i, block in enumerate(blocks):
            shard = self.reader(block.key)
            if shard is not None:
                groups.setdefault(shard, []).append(i)
        plans = []
        for shard, positions in groups.items():
            request = pb.GetRequest(keys=[blocks[i].key for i in positions], layer_begin=layer_begin,
                                    layer_end=layer_end or 0, stop_at_miss=True,
                                    order=pb.LAYER_MAJOR if layer_major else pb.BLOCK_MAJOR)
            plans.append(ShardGet(shard, request, GetAssembly(blocks, positions, layer_begin, layer_end, into,
                                                              self.stats.miss_causes),
                                  self.placement([into[i] for i in positions]) if into else None))
        return plans

    def placement(self, buffers: Sequence[Buffer], layer_stride: int = 0) -> SharedPlacement | None:
        """Where `buffers` lie in one of the shared buffers; None if they do not all lie in one."""
        for shared in self.shared_buffers:
            offsets = [offset for b in buffers if (offset := shared.offset_of(b)) is not None]
            if len(offsets) == len(buffers):
                return SharedPlacement(shared, offsets, layer_stride)
        return None

    # -- one daemon's share --------------------------------------------------------------------------

    async def fetch(self, shard: Shard, request: pb.GetRequest, parts: GetAssembly,
                    shared: SharedPlacement | None = None, offload: Offload | None = None) -> bool:
        """One daemon's share, from the event loop, over the transport its shard chose; `offload`: where its
        blocking socket work runs (default: the client's pool). Whether it ended without failing."""
        started = time.perf_counter()
        try:
            transport = await shard.transport()
            await transport.get(request, parts, shared, offload)
        except (grpc.RpcError, TransportError, CorruptRecord) as exc:
            self.get_failed(shard, exc)
            return False
        self._succeeded(shard, parts, time.perf_counter() - started)
        return True

    def fetch_blocking(self, plan: ShardGet, transport: Transport) -> None:
        """One daemon's share over a transport already known, from a thread other than the event loop's."""
        started = time.perf_counter()
        try:
            transport.get_blocking(plan.request, plan.assembly, plan.shared)
        except (grpc.RpcError, TransportError, CorruptRecord) as exc:
            self.get_failed(plan.shard, exc)
        else:
            self._succeeded(plan.shard, plan.assembly, time.perf_counter() - started)

    def get_failed(self, shard: Shard, error: Exception) -> None:
        """A daemon failed a Get: counted and perhaps marked down (Shard.failed), and a daemon that broke the
        protocol counts a miss cause."""
        if isinstance(error, CorruptRecord):
            self.stats.miss_causes[error.cause] += 1
        shard.failed(error)

    def _succeeded(self, shard: Shard, parts: GetAssembly, seconds: float) -> None:
        """What a daemon delivered in `seconds`, for the load-or-recompute estimates."""
        shard.succeeded()
        self.bandwidth.record(shard.address, parts.kv_bytes_received, seconds)

    # -- finishing ----------------------------------------------------------------------------------

    def finish(self, plans: Sequence[ShardGet]) -> list[BlockData]:
        """The leading run of verified blocks the plans delivered; counted, and kept in the host tier."""
        results = self._delivered(plans)
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

    def _delivered(self, plans: Sequence[ShardGet]) -> dict[int, BlockData]:
        """The verified blocks the plans delivered, by position; each plan told to `after_get`."""
        results: dict[int, BlockData] = {}
        for plan in plans:
            delivered = plan.assembly.results()
            results.update(delivered)
            if self.after_get is not None:
                self.after_get(plan.shard, plan.assembly, delivered)
        return results
