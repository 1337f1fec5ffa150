"""The client of a kvstore cluster: longest-prefix lookup, verified gets and chunked puts over shards.

Contract for callers on an engine's path: a dead, slow or misbehaving daemon never raises here; its
blocks are misses, counted in `stats`, and the daemon is retried after a backoff. Only a caller's own
mistake (mixed namespaces, a payload that does not fit the layout) raises ValueError.

The daemons are a static list or are discovered (DNS, etcd: kvstore/client/membership.py); a client made
on a running event loop follows them as they join and leave, without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvstore.block import Block, same_namespace
from kvstore.client.assembly import BlockData, Buffer
from kvstore.client.config import ClientConfig
from kvstore.client.copier import Copier
from kvstore.client.cost import BandwidthMeter
from kvstore.client.dataplane import SharedBuffer, TransportError, put_head
from kvstore.client.get_pipeline import GetPipeline
from kvstore.client.host_tier import HostTier
from kvstore.client.membership import Follower, Members, MembershipError
from kvstore.client.placement import place
from kvstore.client.replicas import Replicas
from kvstore.client.shard import Shard
from kvstore.client.stats import ClientStats, PutSummary
from kvstore.eviction import ReuseHint
from kvstore.proto import pb
from kvstore.record import build_record, decode_header
from kvstore.stats import Stats

log = logging.getLogger(__name__)


class AsyncKVClient:
    def __init__(self, config: ClientConfig | Sequence[str] | str) -> None:
        self.config = config if isinstance(config, ClientConfig) else ClientConfig(servers=tuple(
            config.split(",") if isinstance(config, str) else config))
        # The client's one thread pool: every blocking call (data-channel sockets, load workers, the
        # write-behind queue) runs on it; KVClient makes it its event loop's default executor too.
        self.executor = ThreadPoolExecutor(max_workers=self.config.pool_threads, thread_name_prefix="kvstore-worker")
        self.stats = ClientStats()
        # member name -> its shard; replaced whole, never changed in place, so that threads planning a get
        # (KVClient.get) always see one consistent set while the follower applies a change
        self.shards: dict[str, Shard] = {}
        members = self.config.members()
        try:
            known = members.resolve()
        except MembershipError as exc:  # no daemons yet: every block a miss until the follower learns them
            log.warning("no daemons known yet: %s", exc)
            known = ()
        self._set_members(known)
        self._previous: tuple[str, ...] = ()  # the members before the last change ...
        self._previous_until = 0.0  # ... looked at for moved keys until then (time.monotonic)
        # daemons that left, kept open for the handoff: one that left cleanly serves for its leave_drain_s
        self._departed: dict[str, Shard] = {}
        self.host = HostTier(self.config.host_tier_bytes, self.config.host_block_bytes,
                             self.config.host_tier_pinned) if self.config.host_tier_bytes else None
        self.bandwidth = BandwidthMeter()
        try:  # where gRPC fallbacks of data-channel calls made on worker threads run
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self.replicas = Replicas()
        self.copier = Copier(self, loop)
        self.gets = GetPipeline(self.stats, self.bandwidth, self.host, self.reader, self.executor,
                                self.config.timeout_s, loop)
        self.gets.after_get = self.copier.after_get
        self._follower: Follower | None = None
        self._leaving: set[asyncio.Task] = set()  # closes of shards whose daemons left
        if members.follows:
            if loop is None:
                log.warning("a client made outside an event loop keeps the daemons it found at start: %s",
                            ", ".join(self.shards) or "none")
            else:
                self._follower = Follower(members, known, lambda new: loop.call_soon_threadsafe(self._changed, new))

    def _set_members(self, members: Members) -> list[Shard]:
        """Make `members` the shards (keeping those that stay); returns the shards that left."""
        old, new = self.shards, {}
        for member in members:
            kept = old.get(member.name)
            new[member.name] = kept if kept is not None and kept.address == member.address else \
                Shard(member.address, self.config, self.executor, name=member.name)
        self.shards = new
        return [shard for name, shard in old.items() if new.get(name) is not shard]

    def _changed(self, members: Members) -> None:
        """On the event loop: the follower saw another set of daemons. Only the keys of daemons that joined
        or left change owner (rendezvous); calls in flight to a leaving daemon end as misses."""
        before = tuple(self.shards)
        left = self._set_members(members)
        self.stats.membership_changes += 1
        # The keys that changed owner are still on their old owners: a member that stays, or one that left
        # and still serves while it drains. For handoff_s they are looked for there.
        self._previous, self._previous_until = before, time.monotonic() + self.config.handoff_s
        log.info("daemons now: %s", ", ".join(self.shards) or "none")
        for shard in self._departed.values():
            self._close_later(shard, 0)
        self._departed = {shard.name: shard for shard in left if shard.name not in self.shards}
        for shard in left:
            self._close_later(shard, self.config.handoff_s if shard.name in self._departed else 0)

    def _close_later(self, shard: Shard, delay_s: float) -> None:
        def close() -> None:
            if self._departed.get(shard.name) is shard and delay_s:
                del self._departed[shard.name]
            task = asyncio.ensure_future(shard.close())
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
        if delay_s:
            asyncio.get_running_loop().call_later(delay_s, close)
        else:
            close()

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.stop()  # wakes its thread (a watch is cut), which then ends at once
        await self.copier.close()
        await asyncio.gather(*(shard.close() for shard in (*self.shards.values(), *self._departed.values())),
                             *self._leaving)
        for shared in self.gets.shared_buffers:
            shared.close()
        self.executor.shutdown(wait=False)  # idle workers exit; nothing here waits on a worker

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- placement --------------------------------------------------------------------------------

    def owner(self, key: bytes) -> Shard | None:
        """The live daemon that owns `key` (rendezvous over the members currently up)."""
        shards = self.shards
        live = [name for name, shard in shards.items() if shard.up]
        return shards[place(key, live)] if live else None

    def reader(self, key: bytes) -> Shard | None:
        """The live daemon to read `key` from: its owner, or for a hot block the least loaded holder of a copy."""
        shards = self.shards
        previous = self.replicas.moved.get(key)
        if previous is not None and (shard := self._member(previous)) is not None and shard.up:
            return shard  # a moved block not yet copied to its new owner
        live = [name for name, shard in shards.items() if shard.up]
        if not live:
            return None
        return shards[self.replicas.reader(key, live)]

    def _member(self, name: str) -> Shard | None:
        """A member's shard, or that of one that left and is kept open for the handoff."""
        return self.shards.get(name) or self._departed.get(name)

    def previous_owner(self, key: bytes, live: Sequence[str]) -> str | None:
        """Shortly after the daemons changed: the member that owned `key` before, if another and still up."""
        if not self._previous or time.monotonic() > self._previous_until:
            return None
        before = [name for name in self._previous if (shard := self._member(name)) is not None and shard.up]
        if not before or not live:
            return None
        previous = place(key, before)
        return previous if previous != place(key, live) else None

    def owner_name(self, key: bytes) -> str | None:
        shard = self.owner(key)
        return shard.name if shard else None

    async def present_on(self, shards: Sequence[Shard], block: Block) -> list[bool]:
        """Whether each of `shards` holds `block` (a failed daemon: no)."""
        answers = await asyncio.gather(*(self._present_keys(shard, [block]) for shard in shards))
        return [answer[0] for answer in answers]

    async def _present_keys(self, shard: Shard, blocks: Sequence[Block]) -> list[bool]:
        """Whether `shard` holds each of `blocks` (a failed daemon: none)."""
        try:
            found = await shard.present([b.key for b in blocks])
        except grpc.RpcError as exc:
            self._failed(shard, exc)
            return [False] * len(blocks)
        shard.succeeded()
        return found

    def _group(self, blocks: Sequence[Block]) -> dict[Shard | None, list[int]]:
        groups: dict[Shard | None, list[int]] = {}
        for i, block in enumerate(blocks):
            groups.setdefault(self.owner(block.key), []).append(i)
        return groups

    def _failed(self, shard: Shard, error: Exception) -> None:
        self.gets.shard_failed(shard, error)

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
        if self._previous:
            await self._present_on_previous_owners(blocks, out, in_host)
        return [held or stored for held, stored in zip(in_host, out, strict=True)]

    async def _present_on_previous_owners(self, blocks: Sequence[Block], out: list[bool], in_host: list[bool]) -> None:
        """Shortly after a daemon joined: look for the moved blocks its owner lacks on their previous owners
        (one more round), and remember where they were found, for the get that follows."""
        shards = self.shards
        live = [name for name, shard in shards.items() if shard.up]
        asked: dict[str, list[int]] = {}
        for i, block in enumerate(blocks):
            if not out[i] and not in_host[i] and (previous := self.previous_owner(block.key, live)) is not None:
                asked.setdefault(previous, []).append(i)

        async def ask(name: str, positions: list[int]) -> None:
            found = await self._present_keys(self._member(name), [blocks[i] for i in positions])
            for i, stored in zip(positions, found, strict=True):
                if stored:
                    out[i] = True
                    self.replicas.found_moved(blocks[i].key, name)

        await asyncio.gather(*(ask(name, positions) for name, positions in asked.items()))

    async def _lookup_daemons(self, blocks: Sequence[Block]) -> int:
        if self._previous and time.monotonic() <= self._previous_until:  # moved blocks count where they still are
            found = await self.present(blocks)
            return found.index(False) if False in found else len(found)
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
        from_host = self.gets.from_host(blocks, layer_begin, layer_end, into)
        if len(from_host) == len(blocks):
            return from_host
        rest = len(from_host)
        plans = self.gets.plan(blocks[rest:], layer_begin, layer_end, layer_major, into[rest:] if into else None)
        await asyncio.gather(*(self.gets.fetch(plan) for plan in plans))
        return from_host + self.gets.finish(plans)

    def block_sources(self, blocks: Sequence[Block]) -> list[str]:
        """Where each block would be read from now: "host", or the owning daemon's address."""
        in_host = self.host.leading_hits([b.key for b in blocks]) if self.host is not None else 0
        owners = [self.owner(b.key) for b in blocks[in_host:]]
        return ["host"] * in_host + [owner.name if owner else "none" for owner in owners]

    async def shared_buffer(self, nbytes: int) -> memoryview:
        """Memory the daemons on this host write into directly: Get into views of it costs no copy here.

        Lent to every same-host daemon (on each pooled data connection); elsewhere it is plain memory.
        It is unmapped when the client closes: no view of it (a tensor from torch.frombuffer included)
        may be used after close().
        """
        shared = SharedBuffer(nbytes)
        loop = asyncio.get_running_loop()
        for shard in self.shards.values():
            try:
                channel = await shard.data_channel()
                if channel is not None and channel.same_host:
                    await loop.run_in_executor(self.executor, channel.adopt, shared, self.config.timeout_s)
            except (grpc.RpcError, TransportError) as exc:
                self._failed(shard, exc)
        self.gets.shared_buffers.append(shared)
        return shared.view

    def _fell_back(self, shard: Shard, error: TransportError) -> None:
        self.gets.fell_back(shard, error)

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
            mine = [records[i] for i in positions]
            results = None if shard is None else await self.put_records(shard, mine, hint)
            if results is None:
                summary.failed += len(positions)
                return
            summary.stored += sum(1 for r in results if r == pb.STORED)
            summary.existed += sum(1 for r in results if r == pb.EXISTS)

        await asyncio.gather(*(put_to(shard, positions)
                               for shard, positions in self._group([b for b, _ in items]).items()))
        return summary

    async def put_records(self, shard: Shard, records: Sequence[tuple[bytes, bytes]],
                           hint: ReuseHint | None) -> list[int] | None:
        """Put records on one daemon: its data channel, or gRPC; each record's result, or None if it failed."""
        try:
            channel = await shard.data_channel()
            results = None
            if channel is not None:
                try:
                    results = await asyncio.get_running_loop().run_in_executor(
                        self.executor, channel.put, records, self.config.timeout_s, hint)
                except TransportError as exc:  # refused before anything was stored: gRPC carries it
                    if not exc.refused:
                        raise
                    self._fell_back(shard, exc)
            if results is None:
                results = await shard.put(self._put_messages(records, hint))
        except (grpc.RpcError, TransportError) as exc:
            self._failed(shard, exc)
            return None
        shard.succeeded()
        self.stats.bytes_written += sum(len(h) + len(p) for (h, p), r in zip(records, results) if r == pb.STORED)
        return results

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
        return {name: shard.last_error for name, shard in self.shards.items() if shard.last_error}

    async def server_stats(self) -> dict[str, Stats | None]:
        """Each daemon's Stats (its samples, kvstore.stats); None for a daemon that did not answer."""
        async def one(shard: Shard) -> Stats | None:
            try:
                return await shard.stats()
            except grpc.RpcError as exc:
                self._failed(shard, exc)
                return None
        shards = self.shards
        values = await asyncio.gather(*(one(shard) for shard in shards.values()))
        return dict(zip(shards, values))
