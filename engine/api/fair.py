"""Fair admission of tenants' requests to the engines (docs/api.md, "Fairness").

The engines admit first come, first served, so before this one tenant's flood of streams took every
decode slot and another tenant's first token waited for them all. Now requests pass a gate in the API
server: at most `slots` are in the engines at once (the engines' `max_running`, so none waits inside
them), and

* one tenant holds at most `slots - reserve` of them, even alone: the reserve is always there for a
  tenant that is not flooding, so its request is admitted at once rather than after a flood's replies
  end (the engines cannot preempt a running request for it). A lone tenant gives up `reserve` slots of
  batch for that;
* a free slot goes to the waiting tenant that holds the fewest slots (ties: the one that has waited
  longest), which is round-robin between tenants that all wait.

Waiting is cancelled with the request (its client went away): its place is given up, nothing leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter, deque
from collections.abc import AsyncIterator


class FairGate:
    def __init__(self, slots: int, reserve: int) -> None:
        if not 0 <= reserve < slots:
            raise ValueError(f"FairGate: need 0 <= reserve < slots, got reserve {reserve} of {slots}")
        self.slots, self.reserve = slots, reserve
        self.held: Counter[str] = Counter()  # tenant -> slots it holds
        self._waiting: dict[str, deque[tuple[int, asyncio.Future]]] = {}  # tenant -> (arrival, future), oldest first
        self._arrivals = itertools.count()

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of the engines' slots for `tenant` while inside."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append((next(self._arrivals), future))
        self._grant()  # at once, if a slot is free for us
        try:
            await future  # the slot is counted as ours when the future is set
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release(tenant)  # granted as we were cancelled: pass it on
            else:
                self._forget(tenant, future)
            raise
        try:
            yield
        finally:
            self._release(tenant)

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def _allowed(self, tenant: str) -> bool:
        return self.held[tenant] < self.slots - self.reserve

    def _release(self, tenant: str) -> None:
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]
        self._grant()

    def _grant(self) -> None:
        """Hand free slots to waiting tenants: fewest held first, then the longest waiting."""
        while self._waiting and sum(self.held.values()) < self.slots:
            candidates = [t for t in self._waiting if self._allowed(t)]
            if not candidates:
                return
            tenant = min(candidates, key=lambda t: (self.held[t], self._waiting[t][0][0]))
            _, future = self._waiting[tenant].popleft()
            if not self._waiting[tenant]:
                del self._waiting[tenant]
            if future.done():  # its task was cancelled and has not yet run its clean-up: skip it
                continue
            self.held[tenant] += 1
            future.set_result(None)

    def _forget(self, tenant: str, future: asyncio.Future) -> None:
        queue = self._waiting.get(tenant)
        if queue is None:
            return
        for item in list(queue):
            if item[1] is future:
                queue.remove(item)
        if not queue:
            del self._waiting[tenant]
        self._grant()
