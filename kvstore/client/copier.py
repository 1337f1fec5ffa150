"""The client's background copies: hot blocks to the next members in rendezvous order, and moved blocks
to their new owner (kvstore/client/replicas.py says why and which).

Two parts, so that neither holds the other: `CopyOrders` hears what each daemon's share of a get or load
delivered (the Get pipeline tells it, from any thread), keeps `Replicas` up to date and queues the copies
wanted; the `Copier` takes them from that queue and makes each one with the Get pipeline and the target's
shard. A copy is a Lookup of the targets, then, where it is missing, a get of the block (from any holder:
every copy is whole and verified) and a put of the same record. Copies run as tasks on the client's event
loop, one per block at a time, and are cancelled when the client closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Container
from dataclasses import dataclass

from kvstore.block import Block
from kvstore.client.assembly import GetAssembly, layer_major
from kvstore.client.cluster import Cluster
from kvstore.client.get_pipeline import GetPipeline
from kvstore.client.placement import ranked
from kvstore.client.replicas import Replicas
from kvstore.client.shard import Shard
from kvstore.client.stats import ClientStats
from kvstore.proto import pb
from kvstore.record import build_record


@dataclass(frozen=True, slots=True)
class CopyOrder:
    block: Block
    where: int | tuple[str, ...]  # this many members should hold it (the owner and the next), or these members
    handoff: bool = False  # a moved block, to its new owner


class CopyOrders:
    """What gets and loads found out about copies, and the copies they call for, queued for the Copier."""

    def __init__(self, cluster: Cluster, replicas: Replicas, stats: ClientStats,
                 loop: asyncio.AbstractEventLoop | None) -> None:
        self.cluster, self.replicas, self.stats = cluster, replicas, stats
        self.loop = loop  # no loop: no copies (a client made outside an event loop)
        self._copying: set[bytes] = set()  # blocks whose copies are queued or being made
        self._queue: asyncio.Queue[CopyOrder] = asyncio.Queue()

    def after_get(self, shard: Shard, assembly: GetAssembly, delivered: Container[int]) -> None:
        """A daemon's share of a get or load is done (any thread): order the copies of hot blocks it asked
        for; copy a moved block read from its previous owner to the new one; forget a holder that no longer
        had its copy."""
        name = shard.name
        for local, position in enumerate(assembly.positions):
            block = assembly.blocks[position]
            if position not in delivered:
                self.replicas.missed(block.key, name)
                continue
            owner = self.cluster.owner_name(block.key)
            if name == owner:
                self.replicas.moved.pop(block.key, None)
            else:
                self.stats.copy_reads += 1
            if self.replicas.moved.get(block.key) == name and owner is not None:
                self.order(CopyOrder(block, (owner,), handoff=True))
            elif factor := assembly.hot.get(local):
                self.order(CopyOrder(block, factor))

    def order(self, order: CopyOrder) -> None:
        """From any thread: queue a copy, unless one of that block is queued or being made."""
        if order.block.key in self._copying or self.loop is None:
            return
        self._copying.add(order.block.key)
        self.loop.call_soon_threadsafe(self._queue.put_nowait, order)

    async def next(self) -> CopyOrder:
        return await self._queue.get()

    def done(self, order: CopyOrder) -> None:
        self._copying.discard(order.block.key)


class Copier:
    """Makes the copies `orders` queues, each as a task on the event loop it is started on."""

    def __init__(self, orders: CopyOrders, cluster: Cluster, gets: GetPipeline, replicas: Replicas,
                 stats: ClientStats) -> None:
        self.orders, self.cluster, self.gets = orders, cluster, gets
        self.replicas, self.stats = replicas, stats
        self._tasks: set[asyncio.Task] = set()  # the copies being made, and the task that starts them
        if orders.loop is not None:
            self._keep(orders.loop.create_task(self._take()))

    def _keep(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _take(self) -> None:
        while True:
            order = await self.orders.next()
            self._keep(asyncio.ensure_future(self._copy(order)))

    async def _copy(self, order: CopyOrder) -> None:
        block = order.block
        try:
            shards = self.cluster.shards
            targets = list(order.where) if isinstance(order.where, tuple) else \
                ranked(block.key, self.cluster.live(), order.where)[1:]
            targets = [t for t in targets if t in shards]
            held = await asyncio.gather(*(shards[t].present([block.key]) for t in targets))
            holders = {t for t, has in zip(targets, held) if has[0]}
            missing = [t for t in targets if t not in holders]
            data = await self.gets.get([block]) if missing else None
            if data:
                header = data[0].header
                record = build_record(block, layer_major(data[0].payload), header.n_layers, header.traffic_class,
                                      encoded=True)
                for target in missing:
                    results = await shards[target].put([record], None)
                    if results and results[0] in (pb.STORED, pb.EXISTS):
                        holders.add(target)
                        if results[0] == pb.STORED:
                            self.stats.handed_off += order.handoff
                            self.stats.copies_made += not order.handoff
            if not order.handoff:
                self.replicas.held(block.key, frozenset(holders))
            elif holders:  # the new owner has it: read it there from now on
                self.replicas.moved.pop(block.key, None)
        finally:
            self.orders.done(order)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
