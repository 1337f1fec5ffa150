"""Starts layer-pipelined loads: one worker for the host tier, one per daemon (see loading.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from kvstore.block import Block, same_namespace
from kvstore.client.assembly import GetAssembly
from kvstore.client.dataplane import SharedPlacement, TransportError, address_of
from kvstore.client.loading import KVDestination, LoadCancelled, LoadHandle, LoadProgress
from kvstore.proto import pb
from kvstore.record import CorruptRecord

if TYPE_CHECKING:
    from kvstore.client.client import AsyncKVClient
    from kvstore.client.shard import Shard


class LoadAssembly(GetAssembly):
    """A layer-major Get whose parts land straight in the engine's buffers and advance a LoadProgress."""

    def __init__(self, blocks: Sequence[Block], positions: list[int], progress: LoadProgress,
                 destination: KVDestination, miss_causes) -> None:
        super().__init__(blocks, positions, 0, destination.num_layers, None, miss_causes)
        self.progress, self.target = progress, destination

    def _miss(self, local: int, cause: str) -> None:
        super()._miss(local, cause)
        self.progress.shrink(self.positions[local], cause)

    def accept(self, head: pb.GetPartHead) -> bool:
        wanted = super().accept(head)
        header = self.headers.get(head.index)
        if header is not None and head.header and (header.layer_bytes != self.target.layer_bytes
                                                   or header.n_layers < self.target.num_layers):
            self._miss(head.index, "layout_mismatch")
            return False
        return wanted

    def destination(self, head: pb.GetPartHead) -> memoryview:
        if self.progress.cancelled:
            raise LoadCancelled()
        if head.layer_end != head.layer_begin + 1:
            raise CorruptRecord("protocol", "a layer-major part must hold exactly one layer")
        return self.target.layer_view(head.layer_begin, self.positions[head.index])

    def received(self, head: pb.GetPartHead, offset: int, data) -> None:
        before = len(self.broken)
        super().received(head, offset, data)
        if len(self.broken) == before:
            position = self.positions[head.index]
            self.target.layer_written(head.layer_begin, position)
            self.progress.mark(head.layer_begin, position)


class Loader:
    def __init__(self, client: AsyncKVClient, loop: asyncio.AbstractEventLoop) -> None:
        self.client, self.loop = client, loop

    def start(self, blocks: Sequence[Block], destination: KVDestination, hit_blocks: int,
              block_tokens: int) -> LoadHandle:
        same_namespace(blocks)
        hit = max(0, min(hit_blocks, len(blocks)))
        progress = LoadProgress(destination.num_layers, hit, destination)
        keys = [b.key for b in blocks[:hit]]
        host = self.client.host
        pinned = host.pin(keys) if host is not None else []
        workers = [threading.Thread(target=self._from_host, args=(pinned, progress, destination),
                                    name="kvstore-load-host", daemon=True)]
        for shard, positions in self._daemon_groups(blocks, len(pinned), hit).items():
            workers.append(threading.Thread(target=self._from_daemon,
                                            args=(shard, blocks, positions, progress, destination),
                                            name=f"kvstore-load-{shard.address}", daemon=True))
        for worker in workers:
            worker.start()
        finisher = threading.Thread(target=self._finish, args=(workers, progress), name="kvstore-load-finish",
                                    daemon=True)
        finisher.start()
        return LoadHandle(progress, block_tokens, workers + [finisher])

    def _daemon_groups(self, blocks: Sequence[Block], start: int, end: int) -> dict[Shard, list[int]]:
        groups: dict = {}
        for position in range(start, end):
            groups.setdefault(self.client.owner(blocks[position].key), []).append(position)
        return groups

    def _from_host(self, pinned, progress: LoadProgress, destination: KVDestination) -> None:
        host = self.client.host
        started = time.perf_counter()
        try:
            for position, block in enumerate(pinned):
                header = block.header
                if header.layer_bytes != destination.layer_bytes or header.n_layers < destination.num_layers:
                    progress.shrink(position, "layout_mismatch")
                    return
            for layer in range(destination.num_layers):  # layer by layer, like the daemons
                for position, block in enumerate(pinned):
                    if progress.cancelled:
                        return
                    size = block.header.layer_bytes
                    destination.layer_view(layer, position)[:] = host.slot_view(block.slot, block.header.payload_len)[
                        layer * size : (layer + 1) * size]
                    destination.layer_written(layer, position)
                    progress.mark(layer, position)
            self.client.stats.tier_hits["host"] += len(pinned)
            self.client.bandwidth.record("host", sum(b.header.payload_len for b in pinned),
                                         time.perf_counter() - started)
        except LoadCancelled:
            return
        finally:
            if host is not None:
                host.unpin(pinned)

    def _from_daemon(self, shard: Shard | None, blocks: Sequence[Block], positions: list[int],
                     progress: LoadProgress, destination: KVDestination) -> None:
        if shard is None:  # no daemon is up
            progress.shrink(positions[0], "unavailable")
            return
        assembly = LoadAssembly(blocks, positions, progress, destination, self.client.stats.miss_causes)
        request = pb.GetRequest(keys=[blocks[p].key for p in positions], layer_begin=0,
                                layer_end=destination.num_layers, order=pb.LAYER_MAJOR, stop_at_miss=True)
        started = time.perf_counter()
        try:
            channel = asyncio.run_coroutine_threadsafe(shard.data_channel(), self.loop).result()
            if channel is not None:
                self.client._channel_get(channel, shard, request, assembly, self._placement(destination, positions))
            else:
                asyncio.run_coroutine_threadsafe(
                    self.client._get_grpc(shard, request, assembly), self.loop).result()
            shard.succeeded()
        except LoadCancelled:
            return
        except (TransportError, CorruptRecord, grpc.RpcError) as exc:  # a shorter hit, never an error
            self.client._failed(shard, exc)
        # Blocks of this daemon that did not arrive in every layer end the hit.
        incomplete = [p for p in positions if not progress.done[:, p].all()]
        if incomplete:
            progress.shrink(incomplete[0], "incomplete")
        else:
            self.client.stats.tier_hits["daemon"] += len(positions)
            self.client.bandwidth.record(shard.address, assembly.bytes_received, time.perf_counter() - started)
        self._keep_in_host(destination, assembly, [p for p in positions if p not in incomplete])

    def _keep_in_host(self, destination: KVDestination, assembly: LoadAssembly, positions: list[int]) -> None:
        """Copy blocks that arrived whole into the host tier, leaf first, when the destination is host
        memory that stays put (not CUDA staging)."""
        host = self.client.host
        if host is None or not getattr(destination, "host_resident", False):
            return
        local = {position: i for i, position in enumerate(assembly.positions)}
        for position in reversed(positions):
            header = assembly.headers.get(local[position])
            if header is None or header.n_layers != destination.num_layers or assembly.progress.cancelled:
                continue
            host.put(header, b"".join(destination.layer_view(layer, position) for layer in range(header.n_layers)))

    def _placement(self, destination: KVDestination, positions: list[int]) -> SharedPlacement | None:
        """If the destination's (layer, block) views lie in a shared buffer at a fixed step between layers
        (paged KV allocated from `shared_buffer`), the daemon can write every layer straight into place."""
        if not self.client._shared or destination.num_layers < 2:
            return self.client._in_shared_buffer([destination.layer_view(0, p) for p in positions])
        first = [destination.layer_view(0, p) for p in positions]
        placement = self.client._in_shared_buffer(first)
        if placement is None:
            return None
        step = address_of(destination.layer_view(1, positions[0])) - address_of(first[0])
        last = destination.num_layers - 1
        for position, view in zip(positions, first):
            if address_of(destination.layer_view(last, position)) - address_of(view) != last * step or step < 0:
                return None
        return SharedPlacement(placement.buffer, placement.offsets, step)

    @staticmethod
    def _finish(workers: Sequence[threading.Thread], progress: LoadProgress) -> None:
        for worker in workers:
            worker.join()
        progress.finish()
