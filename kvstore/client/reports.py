"""Reports of corrupt blocks: what a Get's checks found, named to the daemon that sent it (Verify).

The daemon does not check the bytes it reads from a segment file straight into a client's shared region:
the client checks every layer it receives, on every path, and one check is enough to keep wrong KV from an
engine. A block that fails here is a miss at once; the report lets the daemon check its own copies in memory
no client can write and drop a corrupt one, so that the next reader, of any transport, does not pay for it.

A report is best effort and off the caller's path: a task on the client's event loop, whatever thread the
Get ran on; one that fails is logged at debug and changes nothing else.
"""

from __future__ import annotations

import asyncio
import logging

from kvstore.client.assembly import GetAssembly
from kvstore.client.shard import Shard
from kvstore.client.stats import ClientStats

log = logging.getLogger(__name__)


class CorruptionReports:
    def __init__(self, stats: ClientStats, loop: asyncio.AbstractEventLoop | None) -> None:
        self.stats = stats
        self.loop = loop  # no loop: no reports (a client made outside an event loop)
        self._tasks: set[asyncio.Future] = set()  # the reports in flight

    def after_get(self, shard: Shard, assembly: GetAssembly) -> None:
        """A daemon's share of a get or load is done (any thread): report the blocks whose bytes failed
        their checksums here to that daemon."""
        keys = assembly.corrupt_keys
        if keys and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._start, shard, keys)

    def _start(self, shard: Shard, keys: list[bytes]) -> None:
        task = asyncio.ensure_future(self._report(shard, keys))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report(self, shard: Shard, keys: list[bytes]) -> None:
        try:
            confirmed = await shard.verify(keys)
        except Exception as exc:  # noqa: BLE001 - a report never fails anything (a channel closed meanwhile)
            log.debug("reporting %d corrupt blocks to %s failed: %s", len(keys), shard.address, exc)
            return
        if confirmed is not None:
            self.stats.corrupt_reported += len(keys)
            self.stats.corrupt_confirmed += confirmed

    async def close(self) -> None:
        """Let the reports in flight end (each within the control calls' deadline, lookup_timeout_s)."""
        await asyncio.sleep(0)  # reports a get has just handed over start first
        await asyncio.gather(*self._tasks, return_exceptions=True)
