"""Starts layer-pipelined loads (loading.py) on the client's one thread pool; no thread is made per load.

A load runs in pieces at once: the host tier's blocks, copied layer by layer on a pool thread, and each
daemon's blocks, one layer-major Get streamed straight into the destination through the Get pipeline's
`fetch` (over its data channel on a pool thread, or over gRPC on the event loop). Every piece marks the
(layer, block) pairs it wrote, so layer l is complete, and `wait_layer(l)` returns, while later layers
are still arriving. A daemon's piece starts on the event loop (its transport is chosen there) and hands
only the blocking socket work to the pool, so no pool thread ever waits for another one: a bounded pool
cannot deadlock, it can only queue. The last piece to end finishes the load.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor

from kvstore.block import Block, same_namespace
from kvstore.client.assembly import GetAssembly, kv_bytes
from kvstore.client.cost import BandwidthMeter
from kvstore.client.dataplane import SharedPlacement, address_of
from kvstore.client.get_pipeline import GetPipeline
from kvstore.client.host_tier import HostBlock, HostTier
from kvstore.client.loading import KVDestination, LoadCancelled, LoadHandle, LoadProgress
from kvstore.client.shard import Shard
from kvstore.client.stats import ClientStats
from kvstore.codec import BlockCodec, CorruptLayer
from kvstore.proto import pb
from kvstore.record import CorruptRecord, RecordHeader

log = logging.getLogger(__name__)


def fits(header: RecordHeader, codec: BlockCodec | None, destination: KVDestination) -> bool:
    """Whether a record's layers go into `destination`'s views: as they are, or decoded by `codec`."""
    if header.n_layers < destination.num_layers:
        return False
    if codec is None:
        return header.layer_bytes == destination.layer_bytes
    return codec.geometry.raw_bytes == destination.layer_bytes and header.layer_bytes <= codec.max_slot_bytes


class LoadAssembly(GetAssembly):
    """A layer-major Get whose parts land straight in the engine's buffers and advance a LoadProgress.

    Encoded blocks (a codec in their namespace) land in a staging buffer of their stored size instead, and
    each layer is decoded into the engine's view as soon as its checksum holds: on the thread that received
    it, while later layers arrive and the engine computes the layers before it."""

    def __init__(self, blocks: Sequence[Block], positions: list[int], progress: LoadProgress,
                 destination: KVDestination, miss_causes) -> None:
        super().__init__(blocks, positions, 0, destination.num_layers, None, miss_causes)
        self.progress, self.target = progress, destination
        self.codec = blocks[0].codec if blocks else None

    def _miss(self, local: int, cause: str) -> None:
        super()._miss(local, cause)
        self.progress.shrink(self.positions[local], cause)

    def accept(self, head: pb.GetPartHead) -> bool:
        wanted = super().accept(head)
        header = self.headers.get(head.index)
        if header is not None and head.header and not fits(header, self.codec, self.target):
            self._miss(head.index, "layout_mismatch")
            return False
        return wanted

    def destination(self, head: pb.GetPartHead) -> memoryview:
        if self.progress.cancelled:
            raise LoadCancelled()
        if head.layer_end != head.layer_begin + 1:
            raise CorruptRecord("protocol", "a layer-major part must hold exactly one layer")
        if self.codec is not None:  # the staging buffer of the block's stored layers
            return super().destination(head)
        return self.target.layer_view(head.layer_begin, self.positions[head.index])

    def received(self, head: pb.GetPartHead, offset: int, data) -> None:
        before = len(self.broken)
        super().received(head, offset, data)
        if len(self.broken) != before:
            return
        position = self.positions[head.index]
        if self.codec is not None:
            try:
                self.codec.decode(data, self.target.layer_view(head.layer_begin, position))
            except CorruptLayer:  # a record whose checksums hold but whose bytes no codec wrote
                self._miss(head.index, "codec")
                return
        self.target.layer_written(head.layer_begin, position)
        self.progress.mark(head.layer_begin, position)


class LoadWork:
    """The pieces of one load in flight, and the thread each runs on. The last piece to end finishes the
    load's progress; `join` (what LoadHandle.cancel waits on) returns once every piece has ended, but for
    one running on the calling thread (a destination that cancels its own load)."""

    def __init__(self, progress: LoadProgress, pieces: int) -> None:
        self._progress = progress
        self._threads: dict[int, int | None] = dict.fromkeys(range(pieces))  # piece -> its thread, if running
        self._changed = threading.Condition()
        if not pieces:
            progress.finish()

    def run(self, piece: int, work: Callable[..., None], *args) -> None:
        """Run a piece here (a pool thread)."""
        self._on_this_thread(piece)
        try:
            work(*args)
        except LoadCancelled:
            pass
        except Exception:  # noqa: BLE001 - its blocks are simply not loaded (finish drops them)
            log.exception("a load piece failed")
        finally:
            self._ended(piece)

    async def run_async(self, piece: int, work: Coroutine) -> None:
        """Run a piece on the event loop."""
        self._on_this_thread(piece)
        try:
            await work
        except LoadCancelled:
            pass
        except Exception:  # noqa: BLE001 - as in run
            log.exception("a load piece failed")
        finally:
            self._ended(piece)

    async def in_pool(self, piece: int, executor: Executor, step: Callable[..., None], *args) -> None:
        """A blocking step of a piece run on the event loop: on a pool thread, which the piece is on meanwhile."""
        def on_pool() -> None:
            self._on_this_thread(piece)
            step(*args)

        with self._changed:
            self._threads[piece] = None
        try:
            await asyncio.get_running_loop().run_in_executor(executor, on_pool)
        finally:
            self._on_this_thread(piece)  # back on the loop

    def join(self) -> None:
        me = threading.get_ident()
        with self._changed:
            self._changed.wait_for(lambda: all(thread == me for thread in self._threads.values()))

    def _on_this_thread(self, piece: int) -> None:
        with self._changed:
            self._threads[piece] = threading.get_ident()

    def _ended(self, piece: int) -> None:
        with self._changed:
            if len(self._threads) == 1:
                self._progress.finish()
            del self._threads[piece]
            self._changed.notify_all()


class Loader:
    """Starts loads; it reads through `gets` (the daemons) and `host` (this process's host tier)."""

    def __init__(self, gets: GetPipeline, host: HostTier | None, stats: ClientStats, bandwidth: BandwidthMeter,
                 reader: Callable[[bytes], Shard | None], executor: Executor) -> None:
        self.gets, self.host, self.stats, self.bandwidth = gets, host, stats, bandwidth
        self.reader = reader  # key -> the live daemon to read it from (its owner or a copy's holder), or None
        self.executor = executor

    def start(self, blocks: Sequence[Block], destination: KVDestination, hit_blocks: int, block_tokens: int,
              loop: asyncio.AbstractEventLoop) -> LoadHandle:
        """From any thread; the daemons' pieces run on `loop`, the event loop the client's channels live on."""
        same_namespace(blocks)
        hit = max(0, min(hit_blocks, len(blocks)))
        progress = LoadProgress(destination.num_layers, hit, destination)
        keys = [b.key for b in blocks[:hit]]
        host = self.host
        pinned = host.pin(keys) if host is not None else []
        groups = self._daemon_groups(blocks, len(pinned), hit)
        first = 1 if pinned else 0  # piece 0: the host tier's blocks, if it holds any
        work = LoadWork(progress, first + len(groups))
        if host is not None and pinned:
            try:
                self.executor.submit(work.run, 0, self._from_host, host, pinned, progress, destination,
                                     blocks[0].codec)
            except BaseException:  # the pool is shut down: the client is closing
                host.unpin(pinned)
                raise
        for piece, (shard, positions) in enumerate(groups.items(), start=first):
            asyncio.run_coroutine_threadsafe(
                work.run_async(piece, self._from_daemon(work, piece, shard, blocks, positions, progress, destination)),
                loop)
        return LoadHandle(progress, block_tokens, [work])

    def _daemon_groups(self, blocks: Sequence[Block], start: int, end: int) -> dict[Shard | None, list[int]]:
        groups: dict[Shard | None, list[int]] = {}
        for position in range(start, end):
            groups.setdefault(self.reader(blocks[position].key), []).append(position)
        return groups

    def _from_host(self, host: HostTier, pinned: Sequence[HostBlock], progress: LoadProgress,
                   destination: KVDestination, codec: BlockCodec | None) -> None:
        started = time.perf_counter()
        try:
            for position, block in enumerate(pinned):
                if not fits(block.header, codec, destination):
                    progress.shrink(position, "layout_mismatch")
                    return
            usable = len(pinned)  # a block that does not decode ends the hit there; those before it still load
            for layer in range(destination.num_layers):  # layer by layer, like the daemons
                for position, block in enumerate(pinned[:usable]):
                    if progress.cancelled:
                        return
                    size = block.header.layer_bytes
                    stored = host.slot_view(block.slot, block.header.payload_len)[layer * size : (layer + 1) * size]
                    if codec is None:
                        destination.layer_view(layer, position)[:] = stored
                    else:
                        try:
                            codec.decode(stored, destination.layer_view(layer, position))
                        except CorruptLayer:
                            self.stats.miss_causes["codec"] += 1
                            progress.shrink(position, "codec")
                            usable = position
                            break
                    destination.layer_written(layer, position)
                    progress.mark(layer, position)
            self.stats.tier_hits["host"] += usable
            self.bandwidth.record("host", sum(kv_bytes(b.header, codec) for b in pinned[:usable]),
                                  time.perf_counter() - started)
        except LoadCancelled:
            return
        finally:
            host.unpin(pinned)

    async def _from_daemon(self, work: LoadWork, piece: int, shard: Shard | None, blocks: Sequence[Block],
                           positions: list[int], progress: LoadProgress, destination: KVDestination) -> None:
        """One daemon's blocks, on the event loop; the data channel's blocking socket work on the pool."""
        if shard is None:  # no daemon is up
            progress.shrink(positions[0], "unavailable")
            return
        if progress.cancelled:
            return
        assembly = LoadAssembly(blocks, positions, progress, destination, self.stats.miss_causes)
        request = pb.GetRequest(keys=[blocks[p].key for p in positions], layer_begin=0,
                                layer_end=destination.num_layers, order=pb.LAYER_MAJOR, stop_at_miss=True)

        async def on_pool(step: Callable[[], None]) -> None:
            await work.in_pool(piece, self.executor, step)

        try:  # a failure is a shorter hit, never an error
            await self.gets.fetch(shard, request, assembly, self._placement(destination, positions, blocks[0].codec),
                                  on_pool)
        except LoadCancelled:
            return
        # Blocks of this daemon that did not arrive in every layer end the hit.
        incomplete = [p for p in positions if not progress.done[:, p].all()]
        if incomplete:
            progress.shrink(incomplete[0], "incomplete")
        else:
            self.stats.tier_hits["daemon"] += len(positions)
        whole = [p for p in positions if p not in incomplete]
        if self.gets.after_get is not None:
            self.gets.after_get(shard, assembly, set(whole))
        if whole and self.host is not None and getattr(destination, "host_resident", False):
            await work.in_pool(piece, self.executor, self._keep_in_host, self.host, destination, assembly, whole)

    def _keep_in_host(self, host: HostTier, destination: KVDestination, assembly: LoadAssembly,
                      positions: list[int]) -> None:
        """Copy blocks that arrived whole into the host tier, leaf first (the destination is host memory
        that stays put, not CUDA staging); encoded blocks as they arrived, from their staging buffers."""
        local = {position: i for i, position in enumerate(assembly.positions)}
        for position in reversed(positions):
            header = assembly.headers.get(local[position])
            if header is None or header.n_layers != destination.num_layers or assembly.progress.cancelled:
                continue
            if assembly.codec is not None:
                host.put(header, assembly.payloads[local[position]])
            else:
                host.put(header, b"".join(destination.layer_view(layer, position) for layer in range(header.n_layers)))

    def _placement(self, destination: KVDestination, positions: list[int],
                   codec: BlockCodec | None) -> SharedPlacement | None:
        """If the destination's (layer, block) views lie in a shared buffer at a fixed step between layers
        (paged KV allocated from `shared_buffer`), the daemon can write every layer straight into place."""
        gets = self.gets
        if codec is not None:  # encoded layers land in staging, not in place
            return None
        if not gets.shared_buffers or destination.num_layers < 2:
            return gets.placement([destination.layer_view(0, p) for p in positions])
        first = [destination.layer_view(0, p) for p in positions]
        placement = gets.placement(first)
        if placement is None:
            return None
        step = address_of(destination.layer_view(1, positions[0])) - address_of(first[0])
        last = destination.num_layers - 1
        for position, view in zip(positions, first):
            if address_of(destination.layer_view(last, position)) - address_of(view) != last * step or step < 0:
                return None
        return SharedPlacement(placement.buffer, placement.offsets, step)
