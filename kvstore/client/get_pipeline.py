"""The stages of a Get, shared by every face of the client (AsyncKVClient.get, KVClient.get, the loader).

    from_host      the leading blocks held in this process's host tier, copied out
    plan           the rest, grouped by owning daemon: one ShardGet (request + assembly) per daemon
    fetch          a daemon's share: `fetch_over_channel` on a worker thread (the data channel's blocking
                   sockets; gRPC instead when the channel refuses before any part arrived), `fetch_grpc` on
                   the event loop; `fetch` does either from the loop, `fetch_plan_over_channel` from a
                   thread that already knows the channel, each with the accounting below
    finish         the verified leading run, counted and kept in the host tier

and the accounting of each: `shard_failed` (a daemon failed a call: marked down, counted),
`get_failed` (the same, and the miss cause of a daemon that broke the protocol), `fell_back` (its data
channel refused: gRPC carries the call), `measured` (the bandwidth a daemon delivered).

Blocking stages run on the client's one thread pool (`executor`); the gRPC fallback of a data-channel
call made on a worker thread runs on `loop`, the event loop the client's gRPC channels live on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Container, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import grpc

from kvstore.block import Block, same_namespace
from kvstore.client.assembly import BlockData, Buffer, GetAssembly, ShardGet
from kvstore.client.cost import BandwidthMeter
from kvstore.client.dataplane import DataChannel, SharedBuffer, SharedPlacement, TransportError
from kvstore.client.host_tier import HostTier
from kvstore.client.stats import ClientStats
from kvstore.proto import pb
from kvstore.record import CorruptRecord

if TYPE_CHECKING:
    from kvstore.client.shard import Shard

# A Get the data channel could not serve, before any part arrived, is repeated over gRPC with these codes.
RETRY_GET_CODES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})


class GetPipeline:
    def __init__(self, stats: ClientStats, bandwidth: BandwidthMeter, host: HostTier | None,
                 owner: Callable[[bytes], Shard | None], executor: Executor, timeout_s: float,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.stats, self.bandwidth, self.host = stats, bandwidth, host
        self.owner = owner  # key -> the live daemon to read it from (its owner or a copy's holder), or None
        # told each daemon's share and the positions it delivered, once a get or load is done (hot blocks' copies)
        self.after_get: Callable[[Shard, GetAssembly, Container[int]], None] | None = None
        self.executor = executor
        self.timeout_s = timeout_s
        self.loop = loop  # where gRPC fallbacks of data-channel calls made on worker threads run
        self.shared_buffers: list[SharedBuffer] = []  # memory lent to same-host daemons (shared_buffer)

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
        self.bandwidth.record("host", sum(len(d.payload) for d in out), time.perf_counter() - started)
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
            shard = self.owner(block.key)
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
            offsets = [shared.offset_of(b) for b in buffers]
            if all(offset is not None for offset in offsets):
                return SharedPlacement(shared, offsets, layer_stride)
        return None

    # -- fetching -----------------------------------------------------------------------------------

    async def fetch(self, plan: ShardGet) -> None:
        """One daemon's share, from the event loop: its data channel on a worker thread, or gRPC here.
        A failure is counted (get_failed), never raised."""
        self.loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            channel = await plan.shard.data_channel()
            if channel is not None:
                await self.loop.run_in_executor(self.executor, self.fetch_over_channel, channel, plan.shard,
                                                plan.request, plan.assembly, plan.shared)
            else:
                await self.fetch_grpc(plan.shard, plan.request, plan.assembly)
        except (grpc.RpcError, TransportError, CorruptRecord) as exc:
            self.get_failed(plan.shard, exc)
        else:
            plan.shard.succeeded()
            self.measured(plan.shard, plan.assembly, time.perf_counter() - started)

    def fetch_plan_over_channel(self, plan: ShardGet, channel: DataChannel) -> None:
        """One daemon's share over its (known) data channel, from a thread other than the event loop's;
        as `fetch`, a failure is counted, never raised."""
        started = time.perf_counter()
        try:
            self.fetch_over_channel(channel, plan.shard, plan.request, plan.assembly, plan.shared)
        except (TransportError, CorruptRecord) as exc:
            self.get_failed(plan.shard, exc)
        else:
            plan.shard.succeeded()
            self.measured(plan.shard, plan.assembly, time.perf_counter() - started)

    def fetch_over_channel(self, channel: DataChannel, shard: Shard, request: pb.GetRequest, assembly,
                           shared: SharedPlacement | None = None) -> None:
        """A Get over the data channel, from a worker thread (never the event loop's). Refused or unavailable
        before any part arrived (the daemon's connection or memory limits, a data channel that is gone), it
        goes over gRPC instead (reads are safe to repeat): counted in stats.data_fallbacks, and the daemon is
        not marked down for it. `assembly`: a GetAssembly or the loader's LoadAssembly. Raises what failed."""
        parts = 0

        def sink(head: pb.GetPartHead):
            nonlocal parts
            parts += 1
            return assembly.sink(head)

        try:
            channel.get(request, sink, assembly.received, self.timeout_s, shared)
        except TransportError as exc:
            if parts or exc.code not in RETRY_GET_CODES or self.loop is None:
                raise
            self.fell_back(shard, exc)
            try:
                asyncio.run_coroutine_threadsafe(self.fetch_grpc(shard, request, assembly), self.loop).result()
            except grpc.RpcError as rpc:  # reported like the data channel's failures
                raise TransportError(rpc.code().name, rpc.details() or "") from rpc

    @staticmethod
    async def fetch_grpc(shard: Shard, request: pb.GetRequest, assembly) -> None:
        """A Get over gRPC, on the event loop; raises what failed."""
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

    # -- accounting ---------------------------------------------------------------------------------

    def shard_failed(self, shard: Shard, error: Exception) -> None:
        """A daemon failed a call: marked down if the failure was its own, and counted."""
        shard.failed(error)
        self.stats.shard_errors[shard.address] += 1

    def get_failed(self, shard: Shard, error: Exception) -> None:
        """A daemon failed a Get: as shard_failed, and a daemon that broke the protocol counts a miss cause."""
        if isinstance(error, CorruptRecord):
            self.stats.miss_causes[error.cause] += 1
        self.shard_failed(shard, error)

    def fell_back(self, shard: Shard, error: TransportError) -> None:
        """A daemon's data channel refused a call that gRPC carries instead: counted, the daemon is not down."""
        shard.data_refused(error)
        self.stats.data_fallbacks[shard.address] += 1

    def measured(self, shard: Shard, assembly, seconds: float) -> None:
        """What a daemon delivered in `seconds`, for the load-or-recompute estimates."""
        self.bandwidth.record(shard.address, assembly.bytes_received, seconds)

    # -- finishing ----------------------------------------------------------------------------------

    def finish(self, plans: Sequence[ShardGet]) -> list[BlockData]:
        """The leading run of verified blocks the plans delivered; counted, and kept in the host tier."""
        results: dict[int, BlockData] = {}
        for plan in plans:
            delivered = plan.assembly.results()
            results.update(delivered)
            if self.after_get is not None:
                self.after_get(plan.shard, plan.assembly, delivered)
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
