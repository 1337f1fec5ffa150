"""The scrub: every record the index points at, read back into the daemon's own memory and checked, in turn.

A Get catches a corrupt record when it reads it (the daemon, for reads into its own memory; the client, for
reads into its shared region, which it then reports). A block nobody reads for weeks would hold its damage
all that time, and a power loss under durability "os" may damage sealed files no read has touched since;
the scrub finds such damage before a read does, and drops the block as a Get's read would (counted).

It walks the index, not the segment files: a record whose header is damaged is still found (a scan of the
file skips it to the next valid header), and dead bytes are never read. The index is read a batch at a time
in key order, and each batch in file order; each record is read on an I/O thread (store.run_io) into one
small private buffer, holding its segment against deletion only for that read. The pace is
`scrub_bytes_per_s` on average; a pass ends, the scrub rests `scrub_pause_s`, and the next pass starts
(also `scrub_pause_s` after start-up, whose reads come first). Cancelling the task stops it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvstore.server.block_reader import CopyCheck
from kvstore.server.index import Entry
from kvstore.server.pace import TokenBucket

if TYPE_CHECKING:
    from kvstore.server.config import ServerConfig
    from kvstore.server.metrics import Metrics

log = logging.getLogger(__name__)

BATCH_KEYS = 256  # index entries read at a time


class Scrubbed(Protocol):
    """What the scrub asks of the store it checks (BlockStore implements it)."""

    async def index_batch(self, start: bytes, limit: int) -> list[tuple[bytes, Entry]]: ...
    async def check_stored(self, key: bytes, entry: Entry) -> CopyCheck: ...


class Scrubber:
    def __init__(self, store: Scrubbed, config: ServerConfig, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.bytes_per_s = config.scrub_bytes_per_s
        self.pause_s = config.scrub_pause_s
        self.metrics = metrics
        self.clock = clock
        self._pace: TokenBucket | None = None  # set per pass; saves nothing up, so a pass never bursts

    async def run(self) -> None:
        """Background loop: rest, a pass, rest, a pass...; never raises but CancelledError. Returns at once
        where the scrub is off (scrub_bytes_per_s = 0)."""
        if not self.bytes_per_s:
            return
        while True:
            await asyncio.sleep(self.pause_s)
            try:
                await self.scrub_pass()
            except Exception:  # the scrub must never take the daemon down
                log.exception("scrub pass failed; the next one starts after scrub_pause_s")

    async def scrub_pass(self) -> None:
        """Check every record the index points at, once, at the configured pace."""
        start = b""
        self._pace = TokenBucket(self.bytes_per_s, burst=0, clock=self.clock)
        while batch := await self.store.index_batch(start, BATCH_KEYS):
            start = batch[-1][0] + b"\0"  # the least key after the batch's last
            for key, entry in sorted(batch, key=lambda item: (item[1].segment, item[1].offset)):
                await self._keep_pace()
                outcome = await self.store.check_stored(key, entry)
                if outcome == "absent":  # removed or moved since the batch was read: nothing was read
                    continue
                self._spent(entry.record_len)
                if outcome != "unreadable":
                    self.metrics.scrub_bytes.inc(entry.record_len)
                if outcome == "corrupt":
                    self.metrics.scrub_corrupt.inc()
        self.metrics.scrub_passes.inc()

    async def _keep_pace(self) -> None:
        assert self._pace is not None
        delay = self._pace.wait_s()
        if delay > 0:
            await asyncio.sleep(delay)

    def _spent(self, nbytes: int) -> None:
        """`nbytes` were read: the next read waits the time they take at `bytes_per_s`. Time spent idle
        earlier is not saved up for a burst."""
        assert self._pace is not None
        self._pace.spend(nbytes)
