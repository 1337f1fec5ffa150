"""The client of a kvstore cluster: longest-prefix lookup, verified gets, layer-pipelined loads, chunked
puts and write-behind saves over the daemons.

Contract for callers on an engine's path: a dead, slow or misbehaving daemon never raises here; its
blocks are misses, counted in `stats`, and the daemon is retried after a backoff. Only a caller's own
mistake (mixed namespaces, a payload that does not fit the layout) raises ValueError.

The daemons are a static list or are discovered (DNS, etcd: kvstore/client/membership.py); a client made
on a running event loop follows them as they join and leave, without a restart.

AsyncKVClient puts the parts together and hands each what it needs, no more: the daemons and which to
ask (cluster.py), each daemon's calls and transport (shard.py, transport.py), the one Get path
(get_pipeline.py), loads (loader.py), copies of hot blocks (copier.py), reports of corrupt blocks to the
daemons that sent them (reports.py), write-behind (write_behind.py), prefetches into the host tier
(prefetch.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvstore.block import Block, same_namespace
from kvstore.client.assembly import BlockData, Buffer, Deferred, GetAssembly, Payload, layer_major
from kvstore.client.cluster import Cluster
from kvstore.client.config import ClientConfig
from kvstore.client.copier import Copier, CopyOrders
from kvstore.client.cost import BandwidthMeter, blocks_worth_loading
from kvstore.client.dataplane import SharedBuffer, TransportError
from kvstore.client.get_pipeline import GetPipeline
from kvstore.client.host_tier import HostTier
from kvstore.client.loader import Loader
from kvstore.client.loading import KVDestination, LoadHandle
from kvstore.client.membership import Follower, Members, MembershipError
from kvstore.client.prefetch import Prefetcher
from kvstore.client.replicas import Replicas
from kvstore.client.reports import CorruptionReports
from kvstore.client.shard import Shard
from kvstore.client.stats import ClientStats, PutSummary
from kvstore.client.write_behind import Then, WriteBehind
from kvstore.eviction import ReuseHint
from kvstore.proto import pb
from kvstore.record import build_record, decode_header
from kvstore.stats import Stats

log = logging.getLogger(__name__)


def _records(items: Sequence[tuple[Block, Payload]], num_layers: int,
             traffic_class: str) -> list[tuple[bytes, bytes]]:
    """The records of `items` (given in prefix order), leaf first: so that in the daemons' recency order a
    parent is never older than its children."""
    same_namespace([block for block, _ in items])
    return [build_record(block, layer_major(payload), num_layers, traffic_class) for block, payload in reversed(items)]


class AsyncKVClient:
    """The client on an asyncio event loop. I/O calls are coroutines; the calls that never wait on a daemon
    (save, start_load, prefetch, cancel_prefetch, block_sources, tokens_worth_loading, last_errors) are plain,
    from any thread."""

    def __init__(self, config: ClientConfig | Sequence[str] | str) -> None:
        self.config = config if isinstance(config, ClientConfig) else ClientConfig(servers=tuple(
            config.split(",") if isinstance(config, str) else config))
        # The client's one thread pool: every blocking call (data-channel sockets, load workers, the
        # write-behind queue) runs on it; KVClient makes it its event loop's default executor too.
        self.executor = ThreadPoolExecutor(max_workers=self.config.pool_threads, thread_name_prefix="kvstore-worker")
        self.stats = ClientStats()
        members = self.config.members()
        try:
            known = members.resolve()
        except MembershipError as exc:  # no daemons yet: every block a miss until the follower learns them
            log.warning("no daemons known yet: %s", exc)
            known = ()
        self.replicas = Replicas()
        self.cluster = Cluster(known, self.config, self.stats, self.executor, self.replicas)
        self.host = HostTier(self.config.host_tier_bytes, self.config.host_block_bytes, self.config.host_tier_pinned,
                             stats=self.stats) if self.config.host_tier_bytes else None
        self.bandwidth = BandwidthMeter()
        try:  # the loop the gRPC channels live on: loads, blocking gets and write-behind puts run there
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        copies = CopyOrders(self.cluster, self.replicas, self.stats, self.loop)
        self.reports = CorruptionReports(self.stats, self.loop)

        def after_get(shard: Shard, assembly: GetAssembly, delivered: Container[int]) -> None:
            copies.after_get(shard, assembly, delivered)
            self.reports.after_get(shard, assembly)

        self.gets = GetPipeline(self.stats, self.bandwidth, self.host, self.cluster.reader, self.executor,
                                after_get, self.loop)
        self.copier = Copier(copies, self.cluster, self.gets, self.replicas, self.stats)
        self.loader = Loader(self.gets, self.host, self.stats, self.bandwidth, self.cluster.reader, self.executor)
        self.prefetcher = Prefetcher(self.gets, self.host, self.stats, self.config.prefetch_bytes, self.loop)
        self._write_behind: WriteBehind | None = None
        self._follower: Follower | None = None
        if members.follows:
            if self.loop is None:
                log.warning("a client made outside an event loop keeps the daemons it found at start: %s",
                            ", ".join(self.shards) or "none")
            else:
                self._follower = Follower(members, known, self._follow(self.loop))

    def _follow(self, loop: asyncio.AbstractEventLoop) -> Callable[[Members], None]:
        def changed(members: Members) -> None:  # on the follower's thread
            loop.call_soon_threadsafe(self.cluster.change, members)
        return changed

    @property
    def shards(self) -> dict[str, Shard]:
        """Member name -> its shard, as of now (replaced whole when the members change)."""
        return self.cluster.shards

    async def close(self) -> None:
        if self._write_behind is not None and not self._write_behind.closed:
            await asyncio.to_thread(self.stop_saving)  # its puts wait on this loop: flushed off it
        if self._follower is not None:
            self._follower.stop()  # wakes its thread (a watch is cut), which then ends at once
        await self.prefetcher.close()
        await self.copier.close()
        await self.reports.close()  # before the channels close
        await self.cluster.close()
        for shared in self.gets.shared_buffers:
            shared.close()
        self.executor.shutdown(wait=False)  # idle workers exit; nothing here waits on a worker

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- lookup -----------------------------------------------------------------------------------

    async def lookup(self, blocks: Sequence[Block], promote: bool = False) -> int:
        """How many leading blocks of a prefix are stored (one round, all shards in parallel).

        With `promote` (the caller is about to read the hit), each daemon starts promoting the leading run
        it holds of its blocks from SSD into its DRAM tier, in the background (docs/design.md section 5)."""
        same_namespace(blocks)
        self.stats.lookups += 1
        in_host = self.host.leading_hits([b.key for b in blocks]) if self.host is not None else 0
        if in_host == len(blocks):
            return in_host
        return in_host + await self._lookup_daemons(blocks[in_host:], promote)

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
            found = await shard.present([blocks[i].key for i in wanted])
            for i, stored in zip(wanted, found, strict=True):
                out[i] = stored

        await asyncio.gather(*(ask(shard, positions) for shard, positions in self._group(blocks).items()))
        if self.cluster.changed_lately:
            await self._present_on_previous_owners(blocks, out, in_host)
        return [held or stored for held, stored in zip(in_host, out, strict=True)]

    async def _present_on_previous_owners(self, blocks: Sequence[Block], out: list[bool], in_host: list[bool]) -> None:
        """Shortly after a daemon joined: look for the moved blocks its owner lacks on their previous owners
        (one more round), and remember where they were found, for the get that follows."""
        live = self.cluster.live()
        asked: dict[Shard, list[int]] = {}
        for i, block in enumerate(blocks):
            if out[i] or in_host[i] or (previous := self.cluster.previous_owner(block.key, live)) is None:
                continue
            if (shard := self.cluster.member(previous)) is not None:
                asked.setdefault(shard, []).append(i)

        async def ask(shard: Shard, positions: list[int]) -> None:
            found = await shard.present([blocks[i].key for i in positions])
            for i, stored in zip(positions, found, strict=True):
                if stored:
                    out[i] = True
                    self.replicas.found_moved(blocks[i].key, shard.name)

        await asyncio.gather(*(ask(shard, positions) for shard, positions in asked.items()))

    async def _lookup_daemons(self, blocks: Sequence[Block], promote: bool = False) -> int:
        if self.cluster.changed_lately:  # moved blocks count where they still are (and are not promoted)
            found = await self.present(blocks)
            return found.index(False) if False in found else len(found)

        async def first_missing(shard: Shard | None, positions: list[int]) -> int:
            if shard is None:
                return positions[0]
            hits = await shard.lookup([blocks[i].key for i in positions], promote)
            return positions[hits] if hits < len(positions) else len(blocks)

        ends = await asyncio.gather(*(first_missing(shard, positions)
                                      for shard, positions in self._group(blocks).items()))
        return min(ends)

    def _group(self, blocks: Sequence[Block]) -> dict[Shard | None, list[int]]:
        return self.cluster.group([b.key for b in blocks])

    # -- get and load -----------------------------------------------------------------------------

    async def get(self, blocks: Sequence[Block], layer_begin: int = 0, layer_end: int | None = None,
                  layer_major: bool = False, into: Sequence[Buffer] | None = None) -> list[BlockData]:
        """The leading run of `blocks` that could be read and verified, layers [layer_begin, layer_end).

        With `into`, block i's layers land in into[i] (layer-major, at least (end - begin) * layer_bytes
        long) and BlockData.payload is a view of it; reused, pre-touched buffers avoid page faults.
        """
        return await self.gets.get(blocks, layer_begin, layer_end, layer_major, into)

    def get_blocking(self, blocks: Sequence[Block], layer_begin: int = 0, layer_end: int | None = None,
                     layer_major: bool = False, into: Sequence[Buffer] | None = None) -> list[BlockData]:
        """As `get`, from any thread but the event loop's (KVClient.get): where every daemon involved has a
        known data channel, its sockets are driven from the calling thread."""
        return self.gets.get_blocking(blocks, layer_begin, layer_end, layer_major, into)

    async def load(self, blocks: Sequence[Block], destination: KVDestination,
                   hit_blocks: int | None = None) -> LoadHandle:
        """Start loading the cached prefix of `blocks` into `destination`, layer 0 of every block first.

        Returns once started (after a lookup, unless `hit_blocks` says how many blocks to load). The engine
        calls `handle.wait_layer(l)` before attention layer l and recomputes from `handle.hit_tokens`.
        """
        if not blocks:
            raise ValueError("load needs at least one block")
        hit = await self.lookup(blocks) if hit_blocks is None else hit_blocks
        return self.start_load(blocks, destination, hit)

    def start_load(self, blocks: Sequence[Block], destination: KVDestination, hit_blocks: int) -> LoadHandle:
        """As `load` with the hit known, from any thread; returns at once."""
        if not blocks:
            raise ValueError("load needs at least one block")
        if self.loop is None:
            raise RuntimeError("loads need a client made on an event loop")
        return self.loader.start(blocks, destination, hit_blocks, len(blocks[0].tokens), self.loop)

    def prefetch(self, blocks: Sequence[Block]) -> int:
        """Fetch the blocks of `blocks` the host tier lacks into it in the background, for a read expected
        soon; returns at once, from any thread: how many were queued (prefetch.py). Past `prefetch_bytes`
        queued or in flight blocks are refused; without a host tier, or on a client made outside an event
        loop, nothing is queued. A daemon that fails is a miss, counted in `stats`, never an exception."""
        return self.prefetcher.prefetch(blocks)

    def cancel_prefetch(self, blocks: Sequence[Block]) -> int:
        """Stop prefetching `blocks`: queued ones are taken back, ones being fetched are not kept; how many
        were stopped. From any thread; returns at once."""
        return self.prefetcher.cancel(blocks)

    def block_sources(self, blocks: Sequence[Block]) -> list[str]:
        """Where each block would be read from now: "host", or the owning daemon's address."""
        in_host = self.host.leading_hits([b.key for b in blocks]) if self.host is not None else 0
        owners = [self.cluster.owner(b.key) for b in blocks[in_host:]]
        return ["host"] * in_host + [owner.name if owner else "none" for owner in owners]

    def tokens_worth_loading(self, blocks: Sequence[Block], hit_blocks: int, block_bytes: int, total_tokens: int,
                             compute_s: Callable[[int, int], float], pipelined: bool = True) -> int:
        """Of a hit of `hit_blocks` leading blocks, how many tokens are faster loaded than recomputed.

        `compute_s(a, b)` is the engine's estimate of computing tokens [a, b) with [0, a) cached;
        bandwidth comes from what each source (host tier, each daemon) delivered so far.
        """
        sources = self.block_sources(blocks[:hit_blocks])
        block_tokens = len(blocks[0].tokens) if blocks else 0
        worth = blocks_worth_loading(sources, block_bytes, block_tokens, total_tokens, compute_s,
                                     self.bandwidth, pipelined)
        return worth * block_tokens

    async def shared_buffer(self, nbytes: int) -> memoryview:
        """Memory the daemons on this host write into directly: Get into views of it costs no copy here.

        Lent to every same-host daemon (on each pooled data connection); elsewhere it is plain memory.
        It is unmapped when the client closes: no view of it (a tensor from torch.frombuffer included)
        may be used after close().
        """
        shared = SharedBuffer(nbytes)
        for shard in self.shards.values():
            try:
                transport = await shard.transport()
                await transport.lend(shared)
            except (grpc.RpcError, TransportError) as exc:
                shard.failed(exc)
        self.gets.shared_buffers.append(shared)
        return shared.view

    # -- put and save -----------------------------------------------------------------------------

    async def put(self, items: Sequence[tuple[Block, Payload]], num_layers: int, traffic_class: str = "chat",
                  hint: ReuseHint | None = None) -> PutSummary:
        """Store blocks with their layer-major payloads; failures are counted, never raised.

        Records go out leaf first (the reverse of `items`, given in prefix order), so that in the daemons'
        recency order a parent is never older than its children. `hint`: of the prompt these blocks come
        from, how many full blocks were cached and how many it has (for the daemons' eviction policy)."""
        # encoding takes about a millisecond per layer-megabyte: on the pool, so the event loop keeps serving
        if items and (items[0][0].codec is not None or any(isinstance(p, Deferred) for _, p in items)):
            records = await asyncio.get_running_loop().run_in_executor(
                self.executor, _records, items, num_layers, traffic_class)
        else:
            records = _records(items, num_layers, traffic_class)
        return await self._put_records(records, hint)

    async def _put_records(self, records: Sequence[tuple[bytes, bytes]], hint: ReuseHint | None) -> PutSummary:
        """Store built records (leaf first)."""
        summary = PutSummary()
        headers = [decode_header(header) for header, _ in records]
        if self.host is not None:  # the next turn of this session is likely to want them; leaf first
            for header, (_, payload) in zip(headers, records):
                self.host.put(header, payload)

        async def put_to(shard: Shard | None, positions: list[int]) -> None:
            results = None if shard is None else await shard.put([records[i] for i in positions], hint)
            if results is None:
                summary.failed += len(positions)
                return
            summary.stored += sum(1 for r in results if r == pb.STORED)
            summary.existed += sum(1 for r in results if r == pb.EXISTS)

        groups = self.cluster.group([header.key for header in headers])
        await asyncio.gather(*(put_to(shard, positions) for shard, positions in groups.items()))
        return summary

    def save(self, items: Sequence[tuple[Block, Payload]], num_layers: int, traffic_class: str = "chat",
             hint: ReuseHint | None = None, then: Then | None = None) -> bool:
        """Queue newly computed blocks to be stored in the background; never waits on the store.

        False when the bounded queue has no room: the blocks are dropped and counted. `then`, if given, is
        called in the background with the put's PutSummary (None if it failed) once it is done.
        """
        return self.write_behind.save(items, num_layers, traffic_class, hint, then)

    @property
    def write_behind(self) -> WriteBehind:
        """The queue of `save`: its puts run on the client's pool, each waiting on the event loop."""
        if self._write_behind is None:
            self._write_behind = WriteBehind(self._put_blocking, self.config.write_behind_bytes, self.executor)
        return self._write_behind

    def stop_saving(self) -> None:
        """Store what `save` queued, then drop later saves; from any thread but the event loop's (the queued
        puts wait on it)."""
        if self._write_behind is not None:
            self._write_behind.close()

    def _put_blocking(self, items: Sequence[tuple[Block, Payload]], num_layers: int, traffic_class: str,
                      hint: ReuseHint | None) -> PutSummary:
        if self.loop is None:
            raise RuntimeError("write-behind needs a client made on an event loop")
        records = _records(items, num_layers, traffic_class)  # encoded here, on the write-behind's own thread
        return asyncio.run_coroutine_threadsafe(self._put_records(records, hint), self.loop).result()

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
            return 0 if shard is None else await call(shard, [blocks[i].key for i in positions])
        return sum(await asyncio.gather(*(one(s, p) for s, p in self._group(blocks).items())))

    def last_errors(self) -> dict[str, str]:
        """The last error of each daemon that has failed a call."""
        return {name: shard.last_error for name, shard in self.shards.items() if shard.last_error}

    async def server_stats(self) -> dict[str, Stats | None]:
        """Each daemon's Stats (its samples, kvstore.stats); None for a daemon that did not answer."""
        shards = self.shards
        values = await asyncio.gather(*(shard.server_stats() for shard in shards.values()))
        return dict(zip(shards, values))
