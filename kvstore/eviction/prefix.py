"""PrefixLFU: our policy, built on what a KV-prefix cache knows and a generic cache does not.

* A block is reachable only through its parent, so a parent is worth at least as much as any child:
  only *leaves* of the cached prefix tree are ever evicted; a parent becomes a candidate once its
  last cached child is gone.
* Blocks near the root are shared by many requests: every request through a block counts towards it,
  so shared prefixes accumulate frequency without any notion of depth.
* Recency still matters (a conversation's next turn comes soon; a finished one never): frequency ages
  dynamically, as in LFU-DA / GDSF (Arlitt et al., 2000; Cherkasova, 1998) with uniform size and cost:
  a block's priority is L + frequency, where L is the priority of the last block evicted.

No parameter is tuned to a trace. Retention per traffic class comes from the TTLs, applied before any
policy (expired first).
"""

from __future__ import annotations

import heapq
import itertools

from kvstore.eviction.base import ReuseHint, SizedPolicy
from kvstore.eviction.tree import PrefixTree


class PrefixLFU(SizedPolicy):
    def __init__(self) -> None:
        super().__init__()
        self._freq: dict = {}
        self._priority: dict = {}
        self._tree = PrefixTree()
        self._heap: list = []  # (priority, order, key) of leaves; stale entries are skipped
        self._order = itertools.count()
        self._inflation = 0.0

    def insert(self, key, size: int, parent=None, hint: ReuseHint | None = None) -> None:
        if key in self._size:
            self.access(key)
            return
        self._track(key, size)
        self._freq[key] = 1
        self._tree.add(key, parent)
        self._prioritise(key)

    def access(self, key) -> None:
        if key in self._size:
            self._freq[key] += 1
            self._prioritise(key)

    def _prioritise(self, key) -> None:
        self._priority[key] = self._inflation + self._freq[key]
        if self._tree.is_leaf(key):
            heapq.heappush(self._heap, (self._priority[key], next(self._order), key))

    def remove(self, key) -> None:
        if key not in self._size:
            return
        self._untrack(key)
        del self._freq[key], self._priority[key]
        parent = self._tree.remove(key)
        if parent is not None:  # the parent is a leaf now: a candidate
            heapq.heappush(self._heap, (self._priority[parent], next(self._order), parent))

    def pop_victim(self):
        while self._heap:
            priority, _, key = heapq.heappop(self._heap)
            if key in self._size and self._tree.is_leaf(key) and self._priority[key] == priority:
                self._inflation = priority
                self.remove(key)
                return key
        if self._size:  # only reachable if the tree has a cycle, which chained keys cannot form
            key = next(iter(self._size))
            self.remove(key)
            return key
        return None
