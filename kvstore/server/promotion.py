"""Promotion: blocks an engine will read soon, copied from the segment files into the DRAM tier before a
Get asks for them (docs/design.md section 5).

Two requests queue keys: Advise(continues=True), once a reply ended in a tool call whose answer will
come back as the next turn's prompt (reason "advice"), and Lookup(promote=True), from a caller about to
read the hit (reason "lookup"). Only keys the store holds for the caller (in its scope, not expired)
are queued, in the order given, which is prefix order. A worker task on the daemon's event loop
promotes them one at a time: it reads the whole record from its segment file, verified as a Get's read
is (block_reader.py), and keeps it in the DRAM tier flagged as prefetched until its first read. A key
already in the DRAM tier is flagged there (`HotTier.hold`), within the same budget: plain traffic passes
flagged entries over, so the read they are kept for still finds them.

* Reads come first: the worker starts a block only while no Get is making progress (`GetsInFlight`,
  counted around every Get on both transports) and otherwise waits on an event, never on a timer. A Get
  waiting for its client to take bytes (the data channel's socket full, a gRPC write not yet taken) is not
  making progress: it reads nothing meanwhile, and one client that opens a Get and never reads it would
  otherwise stop everyone's promotions. While every Get waits on its client the worker may start one
  block; a Get that goes on meets at most that one read.
* Bounded: the queue holds at most `promote_queue_keys` keys (more are dropped); the DRAM tier holds at
  most `promote_bytes` of promoted blocks not read yet, and a promotion evicts only entries no reader
  pins and that are not unread promotions themselves, or is refused (HotTier.put_prefetched).
* Shared: each tenant (the block's) holding unread promotions may hold an equal part of `promote_bytes`,
  and a promotion unread for `promote_max_age_s` stops being held (HotTier), so one caller promoting its
  own blocks and never reading them cannot keep everyone else's out.
* Cancellable: Advise(continues=False) and Delete take their keys out of the queue.
* Counted (metrics.py): promoted blocks and bytes by reason, used (read while flagged) and wasted (left
  the tier unread), dropped by cause, already in the DRAM tier, cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal, Protocol

from prometheus_client import Gauge

from kvstore.record import RecordBytes
from kvstore.server.hot_tier import HotTier
from kvstore.server.metrics import Metrics

log = logging.getLogger(__name__)

Reason = Literal["advice", "lookup"]


class GetsInFlight:
    """The Gets being served now: `with gets:` around serving one, and `with gets.waiting_on_client():` around
    each wait for its client to take bytes. Promotion waits until no Get is making progress: a Get waiting on
    its client reads nothing meanwhile, and a client that never reads must not hold everyone's promotions
    back for as long as it keeps its Get open."""

    def __init__(self, gauge: Gauge | None = None, waiting_gauge: Gauge | None = None) -> None:
        self.count = 0  # Gets being served
        self.waiting = 0  # of those, Gets waiting for their client to take bytes
        self._gauge = gauge
        self._waiting_gauge = waiting_gauge
        self._none = asyncio.Event()  # set while no Get is making progress
        self._none.set()

    @property
    def progressing(self) -> int:
        """Gets being served and not waiting on their client."""
        return self.count - self.waiting

    def __enter__(self) -> GetsInFlight:
        self.count += 1
        if self._gauge is not None:
            self._gauge.inc()
        self._changed()
        return self

    def __exit__(self, *exc) -> None:
        self.count -= 1
        if self._gauge is not None:
            self._gauge.dec()
        self._changed()

    @contextmanager
    def waiting_on_client(self) -> Iterator[None]:
        """Around a wait of a Get being served for its client to take bytes (a full socket or HTTP/2 window)."""
        self.waiting += 1
        if self._waiting_gauge is not None:
            self._waiting_gauge.inc()
        self._changed()
        try:
            yield
        finally:
            self.waiting -= 1
            if self._waiting_gauge is not None:
                self._waiting_gauge.dec()
            self._changed()

    def _changed(self) -> None:
        if self.progressing:
            self._none.clear()
        else:
            self._none.set()

    async def none(self) -> None:
        """Return once no Get is making progress (at once if none is)."""
        while self.progressing:  # a Get may go on again between the event and this task running
            await self._none.wait()


class PromotionSource(Protocol):
    """What promotion reads through (the BlockStore)."""

    def record_bytes(self, key: bytes) -> int | None:
        """The size of the indexed record of `key`; None if it is gone or expired."""
        ...

    def tenant_of(self, key: bytes) -> int:
        """The tenant (index id) whose share of the promotion budget a promotion of `key` counts against."""
        ...

    async def read_for_promotion(self, key: bytes) -> tuple[bytes, RecordBytes] | Literal["gone", "unreadable"]:
        """The whole record of `key` from its segment file, verified (header bytes, payload in a buffer the
        DRAM tier can keep); else why not. Not a use of the block: nothing is counted as read or retained."""
        ...


class Promoter:
    def __init__(self, source: PromotionSource, hot: HotTier, gets: GetsInFlight, metrics: Metrics,
                 queue_keys: int) -> None:
        self._source = source
        self._hot = hot
        self._gets = gets
        self._metrics = metrics
        self._queue_keys = queue_keys
        self._queue: OrderedDict[bytes, Reason] = OrderedDict()  # key -> why, in the order to promote
        self._queued = asyncio.Event()  # set while the queue holds keys

    @property
    def enabled(self) -> bool:
        return self._hot.prefetch_bytes > 0

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, key: object) -> bool:
        return key in self._queue

    def enqueue(self, keys: Iterable[bytes], reason: Reason) -> int:
        """Queue held keys (in prefix order) for promotion; how many were queued. A key queued already keeps
        its place; one in the DRAM tier already is counted and not queued; past the bound keys are dropped."""
        if not self.enabled:
            return 0
        queued = 0
        for key in keys:
            if key in self._queue:
                continue
            if key in self._hot:  # held there until read instead, within the budget
                self._hot.hold(key, self._source.tenant_of(key))
                self._metrics.promotion_in_dram.inc()
            elif len(self._queue) >= self._queue_keys:
                self._metrics.promotion_dropped.labels(cause="queue_full").inc()
            else:
                self._queue[key] = reason
                queued += 1
        if self._queue:
            self._queued.set()
        return queued

    def cancel(self, keys: Iterable[bytes]) -> int:
        """Take `keys` out of the queue (a block being promoted now is not stopped); how many were queued."""
        cancelled = sum(1 for key in keys if self._queue.pop(key, None) is not None)
        self._metrics.promotion_cancelled.inc(cancelled)
        if not self._queue:
            self._queued.clear()
        return cancelled

    async def run(self) -> None:
        """The worker: promote queued keys, each once no Get is being served; runs until cancelled."""
        while True:
            await self._queued.wait()
            await self._gets.none()
            if not self._queue:  # cancelled while waiting for the Gets
                self._queued.clear()
                continue
            key, reason = self._queue.popitem(last=False)
            if not self._queue:
                self._queued.clear()
            try:
                await self.promote(key, reason)
            except Exception:  # noqa: BLE001 - one block not promoted must not end promotion
                log.exception("promoting a block failed")

    async def promote(self, key: bytes, reason: Reason) -> bool:
        """Bring one block into the DRAM tier, flagged as prefetched; whether it was (the rest is counted)."""
        size = self._source.record_bytes(key)
        if size is None:
            return self._dropped("gone")
        owner = self._source.tenant_of(key)
        refusal = self._hot.prefetch_refusal(key, size, owner)  # checked before the read, which may be for nothing
        if refusal is None:
            record = await self._source.read_for_promotion(key)
            if isinstance(record, str):
                return self._dropped(record)
            header, payload = record
            refusal = self._hot.put_prefetched(key, header, payload, owner)  # Gets or deletes ran during the read
        if refusal == "in_dram":
            self._hot.hold(key, owner)
            self._metrics.promotion_in_dram.inc()
            return False
        if refusal is not None:
            return self._dropped(refusal)
        self._metrics.promoted_blocks.labels(reason=reason).inc()
        self._metrics.promoted_bytes.labels(reason=reason).inc(size)
        return True

    def _dropped(self, cause: str) -> bool:
        self._metrics.promotion_dropped.labels(cause=cause).inc()
        return False

