"""The blocking face of AsyncKVClient, for scripts and engine worker threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvstore.block import Block
from kvstore.client.assembly import BlockData, Buffer
from kvstore.client.client import AsyncKVClient
from kvstore.client.config import ClientConfig
from kvstore.client.cost import blocks_worth_loading
from kvstore.client.loader import Loader
from kvstore.client.loading import KVDestination, LoadHandle
from kvstore.client.stats import ClientStats, PutSummary
from kvstore.client.write_behind import Then, WriteBehind
from kvstore.eviction import ReuseHint
from kvstore.stats import Stats

T = TypeVar("T")


class KVClient:
    """Runs an AsyncKVClient on its own event loop thread; every method blocks until done.

    Threads: that one event loop thread, and the AsyncKVClient's one bounded pool (`executor`,
    ClientConfig.worker_threads), which is also the loop's default executor; gets, loads and saves
    start no threads of their own."""

    def __init__(self, config: ClientConfig | Sequence[str] | str) -> None:
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client", daemon=True)
        self._thread.start()
        self._async = self._run(_make_async(config))
        self._loader = Loader(self._async, self._loop)
        self._write_behind: WriteBehind | None = None

    @property
    def stats(self) -> ClientStats:
        return self._async.stats

    @property
    def host(self):
        return self._async.host

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The client's one thread pool (ClientConfig.worker_threads threads at most)."""
        return self._async.executor

    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def lookup(self, blocks: Sequence[Block]) -> int:
        return self._run(self._async.lookup(blocks))

    def present(self, blocks: Sequence[Block]) -> list[bool]:
        return self._run(self._async.present(blocks))

    def get(self, blocks: Sequence[Block], layer_begin: int = 0, layer_end: int | None = None,
            layer_major: bool = False, into: Sequence[Buffer] | None = None) -> list[BlockData]:
        """As AsyncKVClient.get. When every daemon involved has a known data channel, the sockets are
        driven from this thread (and the client's pool for every extra daemon), skipping two thread hops."""
        gets = self._async.gets
        from_host = gets.from_host(blocks, layer_begin, layer_end, into)
        rest = len(from_host)
        if rest == len(blocks):
            return from_host
        plans = gets.plan(blocks[rest:], layer_begin, layer_end, layer_major, into[rest:] if into else None)
        channels = [plan.shard.known_data_channel() for plan in plans]
        if not plans or any(channel is None for channel in channels):
            return from_host + self._run(self._async.get(blocks[rest:], layer_begin, layer_end, layer_major,
                                                         into[rest:] if into else None))
        extra = [self.executor.submit(gets.fetch_plan_over_channel, plan, channel)
                 for plan, channel in zip(plans[1:], channels[1:])]
        gets.fetch_plan_over_channel(plans[0], channels[0])
        for future in extra:
            future.result()
        return from_host + gets.finish(plans)

    def block_sources(self, blocks: Sequence[Block]) -> list[str]:
        """Where each block would be read from now: "host" (this process), or the owning daemon's address."""
        return self._async.block_sources(blocks)

    def tokens_worth_loading(self, blocks: Sequence[Block], hit_blocks: int, block_bytes: int, total_tokens: int,
                             compute_s: Callable[[int, int], float], pipelined: bool = True) -> int:
        """Of a hit of `hit_blocks` leading blocks, how many tokens are faster loaded than recomputed.

        `compute_s(a, b)` is the engine's estimate of computing tokens [a, b) with [0, a) cached;
        bandwidth comes from what each source (host tier, each daemon) delivered so far.
        """
        sources = self.block_sources(blocks[:hit_blocks])
        block_tokens = len(blocks[0].tokens) if blocks else 0
        worth = blocks_worth_loading(sources, block_bytes, block_tokens, total_tokens, compute_s,
                                     self._async.bandwidth, pipelined)
        return worth * block_tokens

    def save(self, items: Sequence[tuple[Block, bytes]], num_layers: int, traffic_class: str = "chat",
             hint: ReuseHint | None = None, then: Then | None = None) -> bool:
        """Queue newly computed blocks to be stored in the background; never blocks on the store.

        False when the bounded queue has no room: the blocks are dropped and counted. `then`, if given, is
        called in the background with the put's PutSummary (None if it failed) once it is done.
        """
        return self.write_behind.save(items, num_layers, traffic_class, hint, then)

    @property
    def write_behind(self) -> WriteBehind:
        if self._write_behind is None:
            self._write_behind = WriteBehind(self.put, self._async.config.write_behind_bytes, self.executor)
        return self._write_behind

    def load(self, blocks: Sequence[Block], destination: KVDestination, hit_blocks: int | None = None) -> LoadHandle:
        """Start loading the cached prefix of `blocks` into `destination`, layer 0 of every block first.

        Returns at once (after a lookup, unless `hit_blocks` says how many blocks to load). The engine
        calls `handle.wait_layer(l)` before attention layer l and recomputes from `handle.hit_tokens`.
        """
        if not blocks:
            raise ValueError("load needs at least one block")
        hit = self.lookup(blocks) if hit_blocks is None else hit_blocks
        return self._loader.start(blocks, destination, hit, len(blocks[0].tokens))

    def put(self, items: Sequence[tuple[Block, bytes]], num_layers: int, traffic_class: str = "chat",
            hint: ReuseHint | None = None) -> PutSummary:
        return self._run(self._async.put(items, num_layers, traffic_class, hint))

    def touch(self, blocks: Sequence[Block], traffic_class: str = "") -> int:
        return self._run(self._async.touch(blocks, traffic_class))

    def advise(self, blocks: Sequence[Block], continues: bool) -> int:
        return self._run(self._async.advise(blocks, continues))

    def delete(self, blocks: Sequence[Block]) -> int:
        return self._run(self._async.delete(blocks))

    def shared_buffer(self, nbytes: int) -> memoryview:
        """See AsyncKVClient.shared_buffer: memory same-host daemons write into directly."""
        return self._run(self._async.shared_buffer(nbytes))

    def server_stats(self) -> dict[str, Stats | None]:
        return self._run(self._async.server_stats())

    def last_errors(self) -> dict[str, str]:
        return self._async.last_errors()

    def close(self) -> None:
        if self._write_behind is not None:
            self._write_behind.close()  # shutdown flushes what is queued
        self.executor.shutdown(wait=True)
        if self._loop.is_running():
            self._run(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _make_async(config) -> AsyncKVClient:
    client = AsyncKVClient(config)  # created on the loop thread, where its channels live
    # The loop's own blocking calls (asyncio.to_thread) share the client's pool instead of a pool of their own.
    asyncio.get_running_loop().set_default_executor(client.executor)
    return client


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
