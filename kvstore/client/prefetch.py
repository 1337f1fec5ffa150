"""Prefetches into the host tier: blocks the engine expects to read soon, fetched from the daemons in the
background so that its read finds them in this process (AsyncKVClient.prefetch).

`prefetch` is a plain call from any thread that returns at once: it holds the blocks the host tier has
(`HostTier.hold`: kept there until read), queues those it lacks and wakes one worker task on the client's
event loop, which fetches everything queued in one Get per daemon (GetPipeline.fetch_ahead) and puts
what arrives in the host tier flagged as prefetched (host_tier.py: a flagged block evicts neither a
pinned block nor another unread prefetch, plain puts pass it over, and its first pin counts as used).

Bounded: at most `prefetch_bytes` of blocks are queued or being fetched, each counted as a host slot;
blocks past it are refused. `cancel_prefetch` takes queued blocks back, and drops the ones being fetched
when they arrive. A daemon that fails is a miss, counted, never an exception (the client's contract).
Counted in ClientStats: prefetched, prefetch_used, prefetch_wasted, prefetch_refused, prefetch_cancelled,
prefetch_missed, prefetch_too_large.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvstore.block import Block, same_namespace
from kvstore.client.assembly import BlockData
from kvstore.client.get_pipeline import GetPipeline
from kvstore.client.host_tier import HostTier
from kvstore.client.stats import ClientStats

log = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, gets: GetPipeline, host: HostTier | None, stats: ClientStats, budget_bytes: int,
                 loop: asyncio.AbstractEventLoop | None) -> None:
        self._gets, self._host, self._stats = gets, host, stats
        self._budget_bytes = budget_bytes
        self._loop = loop  # where the worker runs: the loop the client's channels live on
        self._lock = threading.Lock()  # prefetch and cancel_prefetch come from any thread
        self._queued: OrderedDict[bytes, Block] = OrderedDict()  # key -> block, waiting for the worker
        self._fetching: set[bytes] = set()  # keys of the Get in flight
        self._dropped: set[bytes] = set()  # of them, cancelled: not kept when they arrive
        self._charged_bytes = 0  # a host slot for each block queued or being fetched
        self._too_large: set[bytes] = set()  # namespaces whose blocks are larger than a host slot
        self._worker: asyncio.Task | None = None
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self._host is not None and self._budget_bytes > 0 and self._loop is not None and not self._closed

    @property
    def pending(self) -> int:
        """Blocks queued or being fetched."""
        with self._lock:
            return len(self._queued) + len(self._fetching)

    def prefetch(self, blocks: Sequence[Block]) -> int:
        """Queue the blocks of `blocks` the host tier lacks (in their order) to be fetched in the background;
        how many were queued. Returns at once, from any thread; 0 without a host tier or a loop."""
        same_namespace(blocks)
        host, loop = self._host, self._loop
        if not blocks or not self.enabled or host is None or loop is None:
            return 0
        keys = [block.key for block in blocks]
        host.hold(keys)  # those here already stay for the read to come
        held = host.present(keys)
        queued = 0
        with self._lock:
            if blocks[0].namespace in self._too_large:
                self._stats.prefetch_too_large += len(blocks)
                return 0
            for block, in_host in zip(blocks, held, strict=True):
                if in_host or block.key in self._queued or block.key in self._fetching:
                    continue
                if self._charged_bytes + host.slot_bytes > self._budget_bytes:
                    self._stats.prefetch_refused += 1
                    continue
                self._queued[block.key] = block
                self._charged_bytes += host.slot_bytes
                queued += 1
            if queued:
                try:
                    loop.call_soon_threadsafe(self._wake)
                except RuntimeError:  # the loop is closed: the client is gone
                    self._release(list(self._queued))
                    self._queued.clear()
                    return 0
        return queued

    def cancel(self, blocks: Sequence[Block]) -> int:
        """Stop prefetching `blocks`: queued ones are taken back, ones being fetched are not kept when they
        arrive; how many were stopped."""
        with self._lock:
            taken_back, dropped = [], 0
            for block in blocks:
                if self._queued.pop(block.key, None) is not None:
                    taken_back.append(block.key)
                elif block.key in self._fetching and block.key not in self._dropped:
                    self._dropped.add(block.key)  # counted, and released, when its Get ends
                    dropped += 1
            self._release(taken_back)
            self._stats.prefetch_cancelled += len(taken_back)
            return len(taken_back) + dropped

    def _release(self, keys: Sequence[bytes]) -> None:
        if self._host is not None:
            self._charged_bytes -= self._host.slot_bytes * len(keys)

    def _wake(self) -> None:
        """On the loop: start the worker unless it runs."""
        if self._worker is None and not self._closed:
            self._worker = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queued or self._closed:
                    self._worker = None
                    return
                batch = list(self._queued.values())
                self._queued.clear()
                self._fetching = {block.key for block in batch}
            delivered: dict[int, BlockData] = {}
            try:
                delivered = await self._gets.fetch_ahead(batch)
            except asyncio.CancelledError:
                self._landed(batch, {})
                raise
            except Exception:  # noqa: BLE001 - a prefetch never fails the engine; its blocks are misses
                log.exception("a prefetch failed")
            self._landed(batch, delivered)

    def _landed(self, batch: Sequence[Block], delivered: dict[int, BlockData]) -> None:
        """Keep what arrived of a batch in the host tier, flagged, and count the rest."""
        host = self._host
        assert host is not None
        with self._lock:
            for position in reversed(range(len(batch))):  # leaf first, so parents stay the most recent
                block, data = batch[position], delivered.get(position)
                if block.key in self._dropped:
                    self._stats.prefetch_cancelled += 1
                elif data is None:
                    self._stats.prefetch_missed += 1
                elif len(data.payload) > host.slot_bytes:
                    self._stats.prefetch_too_large += 1
                    self._too_large.add(block.namespace)
                elif block.key in host:  # a read put it there meanwhile
                    continue
                elif host.put(data.header, data.payload, prefetched=True):
                    self._stats.prefetched += 1
                else:  # every slot is pinned or holds an unread prefetch
                    self._stats.prefetch_refused += 1
            self._release([block.key for block in batch])
            self._fetching.clear()
            self._dropped.clear()

    async def close(self) -> None:
        """On the loop: stop the worker; what was queued is dropped."""
        with self._lock:
            self._closed = True
            self._release(list(self._queued))
            self._queued.clear()
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            try:
                await worker
            except asyncio.CancelledError:
                pass
