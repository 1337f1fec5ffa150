"""KVClient, the blocking face of AsyncKVClient, for scripts and engine threads: the same calls, each
returning once done (the plain ones, such as save and load, return at once either way)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kvstore.block import Block
from kvstore.client.assembly import BlockData, Buffer, Payload
from kvstore.client.client import AsyncKVClient
from kvstore.client.config import ClientConfig
from kvstore.client.face import StoreClient
from kvstore.client.host_tier import HostTier
from kvstore.client.loading import KVDestination, LoadHandle
from kvstore.client.shard import Shard
from kvstore.client.stats import ClientStats, PutSummary
from kvstore.client.write_behind import Then, WriteBehind
from kvstore.eviction import ReuseHint
from kvstore.stats import Stats

T = TypeVar("T")


class KVClient:
    """Runs an AsyncKVClient on its own event loop thread; every call that waits on a daemon blocks until done.

    Threads: that one event loop thread, and the AsyncKVClient's one bounded pool (`executor`,
    ClientConfig.worker_threads), which is also the loop's default executor; gets, loads and saves
    start no threads of their own."""

    def __init__(self, config: ClientConfig | Sequence[str] | str) -> None:
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client", daemon=True)
        self._thread.start()
        self._async = self._run(_make_async(config))

    @property
    def stats(self) -> ClientStats:
        return self._async.stats

    @property
    def host(self) -> HostTier | None:
        """This process's host tier, if the config gives it memory."""
        return self._async.host

    @property
    def shards(self) -> dict[str, Shard]:
        """Member name -> its shard, as of now (AsyncKVClient.shards)."""
        return self._async.shards

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The client's one thread pool (ClientConfig.worker_threads threads at most)."""
        return self._async.executor

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def lookup(self, blocks: Sequence[Block], promote: bool = False) -> int:
        """As AsyncKVClient.lookup; with `promote`, the daemons start promoting the hit into DRAM."""
        return self._run(self._async.lookup(blocks, promote))

    def present(self, blocks: Sequence[Block]) -> list[bool]:
        return self._run(self._async.present(blocks))

    def get(self, blocks: Sequence[Block], layer_begin: int = 0, layer_end: int | None = None,
            layer_major: bool = False, into: Sequence[Buffer] | None = None) -> list[BlockData]:
        """As AsyncKVClient.get. When every daemon involved has a known data channel, the sockets are
        driven from this thread (and the client's pool for every extra daemon), skipping two thread hops."""
        return self._async.get_blocking(blocks, layer_begin, layer_end, layer_major, into)

    def block_sources(self, blocks: Sequence[Block]) -> list[str]:
        """Where each block would be read from now: "host" (this process), or the owning daemon's address."""
        return self._async.block_sources(blocks)

    def tokens_worth_loading(self, blocks: Sequence[Block], hit_blocks: int, block_bytes: int, total_tokens: int,
                             compute_s: Callable[[int, int], float], pipelined: bool = True) -> int:
        """As AsyncKVClient.tokens_worth_loading: of a hit, how many tokens are faster loaded than recomputed."""
        return self._async.tokens_worth_loading(blocks, hit_blocks, block_bytes, total_tokens, compute_s, pipelined)

    def save(self, items: Sequence[tuple[Block, Payload]], num_layers: int, traffic_class: str = "chat",
             hint: ReuseHint | None = None, then: Then | None = None) -> bool:
        """As AsyncKVClient.save: queued, stored in the background; never blocks on the store."""
        return self._async.save(items, num_layers, traffic_class, hint, then)

    @property
    def write_behind(self) -> WriteBehind:
        return self._async.write_behind

    def prefetch(self, blocks: Sequence[Block]) -> int:
        """As AsyncKVClient.prefetch: queued, fetched into the host tier in the background; never blocks."""
        return self._async.prefetch(blocks)

    def cancel_prefetch(self, blocks: Sequence[Block]) -> int:
        """As AsyncKVClient.cancel_prefetch: queued prefetches of `blocks` stop; never blocks."""
        return self._async.cancel_prefetch(blocks)

    def load(self, blocks: Sequence[Block], destination: KVDestination, hit_blocks: int | None = None) -> LoadHandle:
        """As AsyncKVClient.load; returns at once (after a lookup, unless `hit_blocks` says how many blocks
        to load), and the blocks arrive layer by layer while the caller computes."""
        if not blocks:
            raise ValueError("load needs at least one block")
        hit = self.lookup(blocks) if hit_blocks is None else hit_blocks
        return self._async.start_load(blocks, destination, hit)

    def put(self, items: Sequence[tuple[Block, Payload]], num_layers: int, traffic_class: str = "chat",
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
        self._async.stop_saving()  # flushes what is queued, here: its puts wait on the loop
        if self._loop.is_running():  # before the pool goes: a prefetch in flight may still hand it work
            self._run(self._async.prefetcher.close())
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


async def _make_async(config: ClientConfig | Sequence[str] | str) -> AsyncKVClient:
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


if TYPE_CHECKING:  # mypy checks that KVClient has every call of the face engines and plug-ins take
    _serves_the_face: type[StoreClient] = KVClient
