"""The client's background copies: hot blocks to the next members in rendezvous order, and moved blocks
to their new owner (kvstore/client/replicas.py says why and which).

A copy is a Lookup of the targets, then, where it is missing, a get of the block (from any holder: every
copy is whole and verified) and a put of the same record. Copies run as tasks on the client's event loop,
one per block at a time, and are cancelled when the client closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Container
from typing import TYPE_CHECKING

from kvstore.block import Block
from kvstore.client.assembly import GetAssembly
from kvstore.client.placement import ranked
from kvstore.proto import pb
from kvstore.record import build_record

if TYPE_CHECKING:
    from kvstore.client.client import AsyncKVClient
    from kvstore.client.shard import Shard


class Copier:
    def __init__(self, client: AsyncKVClient, loop: asyncio.AbstractEventLoop | None) -> None:
        self.client, self.loop = client, loop  # no loop: no copies (a client made outside an event loop)
        self.replicas = client.replicas
        self._copying: set[bytes] = set()  # blocks whose copies are being made ...
        self._tasks: set[asyncio.Task] = set()  # ... by these tasks

    def after_get(self, shard: Shard, assembly: GetAssembly, delivered: Container[int]) -> None:
        """A daemon's share of a get or load is done (any thread): make the copies of hot blocks it asked
        for; copy a moved block read from its previous owner to the new one; forget a holder that no longer
        had its copy."""
        client, name = self.client, shard.name
        for local, position in enumerate(assembly.positions):
            block = assembly.blocks[position]
            if position not in delivered:
                self.replicas.missed(block.key, name)
                continue
            owner = client.owner_name(block.key)
            if name == owner:
                self.replicas.moved.pop(block.key, None)
            else:
                client.stats.copy_reads += 1
            if self.replicas.moved.get(block.key) == name and owner is not None:
                self.start(block, [owner], handoff=True)
            elif factor := assembly.hot.get(local):
                self.start(block, factor)

    def start(self, block: Block, where: int | list[str], handoff: bool = False) -> None:
        """From any thread: copy `block` to the members `where` lists, or so that `where` members hold it
        (the owner and the next ones in rendezvous order)."""
        if block.key in self._copying or self.loop is None:
            return
        self._copying.add(block.key)

        def start() -> None:
            task = asyncio.ensure_future(self._copy(block, where, handoff))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self.loop.call_soon_threadsafe(start)

    async def _copy(self, block: Block, where: int | list[str], handoff: bool) -> None:
        client = self.client
        try:
            shards = client.shards
            targets = where if isinstance(where, list) else \
                ranked(block.key, [n for n, s in shards.items() if s.up], where)[1:]
            targets = [t for t in targets if t in shards]
            held = await client.present_on([shards[t] for t in targets], block)
            holders = {t for t, has in zip(targets, held) if has}
            missing = [t for t in targets if t not in holders]
            data = await client.get([block]) if missing else None
            if data:
                header = data[0].header
                record = build_record(block, data[0].payload, header.n_layers, header.traffic_class)
                for target in missing:
                    results = await client.put_records(shards[target], [record], None)
                    if results and results[0] in (pb.STORED, pb.EXISTS):
                        holders.add(target)
                        if results[0] == pb.STORED:
                            client.stats.handed_off += handoff
                            client.stats.copies_made += not handoff
            if not handoff:
                self.replicas.held(block.key, frozenset(holders))
            elif holders:  # the new owner has it: read it there from now on
                self.replicas.moved.pop(block.key, None)
        finally:
            self._copying.discard(block.key)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
