"""Write-behind saves: newly computed blocks go to the store without blocking a forward pass.

`save` only enqueues; while anything is queued, one drain task stores it through `put` (KVClient.put),
on the executor given (the client's one thread pool; without one, a thread of its own). The queue is
bounded in bytes: a save that does not fit is dropped and counted (the blocks are simply not cached),
never waited on. `flush` waits until everything queued is stored; `close` flushes and stops. `mark` and
`wait_for` let a caller wait for the saves queued before a point only (a resumption for the record its
preemption saved), not for everything queued since.

A save may carry `then`, called on the drain thread with the put's summary (None where the put raised)
once it is done: what must follow the save and depend on its outcome (deleting the record it supersedes,
if the daemon stored this one rather than answering EXISTS) runs after it, in queue order, and never on
the caller's thread.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor

from kvstore.block import Block
from kvstore.client.assembly import Payload, payload_bytes
from kvstore.client.stats import PutSummary
from kvstore.eviction import ReuseHint

# (items, num_layers, traffic_class, hint) -> what the put did
Put = Callable[[Sequence[tuple[Block, Payload]], int, str, ReuseHint | None], PutSummary]
Then = Callable[[PutSummary | None], None]  # called with the put's summary, or None where it raised


class WriteBehind:
    def __init__(self, put: Put, max_bytes: int, executor: Executor | None = None) -> None:
        if max_bytes < 1:
            raise ValueError("the write-behind queue needs a positive byte bound")
        self.put = put
        self.max_bytes = max_bytes
        self.counters: Counter = Counter()  # queued, stored, existed, failed, dropped (blocks); then_failed (saves)
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._accepted = 0  # saves queued so far: the marks
        self._settled = 0  # saves done (stored or failed) so far: in queue order, so every mark <= it is done
        self._busy = False
        self._closed = False
        self._changed = threading.Condition()
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-write-behind")
        self._draining: Future | None = None  # the drain task, while one runs

    def save(self, items: Sequence[tuple[Block, Payload]], num_layers: int, traffic_class: str = "chat",
             hint: ReuseHint | None = None, then: Then | None = None) -> bool:
        """Queue blocks for saving; False (and counted as dropped, `then` never called) if the queue has no
        room."""
        nbytes = sum(payload_bytes(payload) for _, payload in items)
        with self._changed:
            if self._closed or self._queued_bytes + nbytes > self.max_bytes or not self._drain_soon():
                self.counters["dropped"] += len(items)
                return False
            self._queue.append((list(items), num_layers, traffic_class, hint, then, nbytes))
            self._queued_bytes += nbytes
            self._accepted += 1
            self.counters["queued"] += len(items)
            self._changed.notify_all()
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending_bytes(self) -> int:
        """Payload bytes queued or being stored."""
        return self._queued_bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save has been stored (or failed); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and not self._busy, timeout)

    def mark(self) -> int:
        """A mark of the saves queued so far, for `wait_for`."""
        with self._changed:
            return self._accepted

    def wait_for(self, mark: int, timeout: float | None = None) -> bool:
        """Wait until every save queued before `mark` was taken has been stored (or failed), not those queued
        since; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._settled >= mark, timeout)

    def close(self, timeout: float | None = None) -> None:
        self.flush(timeout)
        with self._changed:
            self._closed = True
            draining = self._draining
        if draining is not None:
            try:
                draining.result(timeout)
            except TimeoutError:
                pass
        if self._own_executor:
            self._executor.shutdown(wait=False)

    def _drain_soon(self) -> bool:
        """Make sure a drain task runs (called holding the lock); False if none can be started."""
        if self._draining is None:
            try:
                self._draining = self._executor.submit(self._drain)
            except RuntimeError:  # the pool is shut down: the client is closing
                return False
        return True

    def _drain(self) -> None:
        while True:
            with self._changed:
                if not self._queue:
                    self._draining = None  # a later save starts another
                    return
                items, num_layers, traffic_class, hint, then, nbytes = self._queue.popleft()
                self._busy = True
            try:
                summary: PutSummary | None = None
                try:
                    summary = self.put(items, num_layers, traffic_class, hint)
                    self.counters["stored"] += summary.stored
                    self.counters["existed"] += summary.existed
                    self.counters["failed"] += summary.failed
                except Exception:  # noqa: BLE001 - a save must never take the engine down
                    self.counters["failed"] += len(items)
                if then is not None:
                    try:
                        then(summary)
                    except Exception:  # noqa: BLE001 - nor what follows it
                        self.counters["then_failed"] += 1
            finally:
                with self._changed:
                    self._queued_bytes -= nbytes
                    self._settled += 1
                    self._busy = False
                    self._changed.notify_all()
