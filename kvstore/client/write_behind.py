"""Write-behind saves: newly computed blocks go to the store without blocking a forward pass.

`save` only enqueues; one thread drains the queue through the client. The queue is bounded in bytes:
a save that does not fit is dropped and counted (the blocks are simply not cached), never waited on.
`flush` waits until everything queued is stored; `close` flushes and stops.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.block import Block
from kvstore.eviction import ReuseHint

if TYPE_CHECKING:
    from kvstore.client.sync import KVClient


class WriteBehind:
    def __init__(self, client: KVClient, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("the write-behind queue needs a positive byte bound")
        self.client = client
        self.max_bytes = max_bytes
        self.counters: Counter = Counter()  # queued, stored, existed, failed, dropped (blocks)
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._busy = False
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name="kvstore-write-behind", daemon=True)
        self._thread.start()

    def save(self, items: Sequence[tuple[Block, bytes]], num_layers: int, traffic_class: str = "chat",
             hint: ReuseHint | None = None) -> bool:
        """Queue blocks for saving; False (and counted as dropped) if the queue has no room."""
        nbytes = sum(len(payload) for _, payload in items)
        with self._changed:
            if self._closed or self._queued_bytes + nbytes > self.max_bytes:
                self.counters["dropped"] += len(items)
                return False
            self._queue.append((list(items), num_layers, traffic_class, hint, nbytes))
            self._queued_bytes += nbytes
            self.counters["queued"] += len(items)
            self._changed.notify_all()
        return True

    @property
    def pending_bytes(self) -> int:
        """Payload bytes queued or being stored."""
        return self._queued_bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save has been stored (or failed); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        self.flush(timeout)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout)

    def _drain(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                items, num_layers, traffic_class, hint, nbytes = self._queue.popleft()
                self._busy = True
            try:
                summary = self.client.put(items, num_layers, traffic_class, hint)
                self.counters["stored"] += summary.stored
                self.counters["existed"] += summary.existed
                self.counters["failed"] += summary.failed
            except Exception:  # noqa: BLE001 - a save must never take the engine down
                self.counters["failed"] += len(items)
            finally:
                with self._changed:
                    self._queued_bytes -= nbytes
                    self._busy = False
                    self._changed.notify_all()
