"""SIEVE: Zhang et al., "SIEVE is simpler than LRU", NSDI 2024.

One FIFO queue and a "visited" bit per object; a hand sweeps from the oldest object towards the
newest, clearing visited bits, and evicts the first unvisited object it meets, staying where it was.
New objects enter at the head; hits only set the bit, so nothing moves on a hit.
"""

from __future__ import annotations

from kvstore.eviction.base import ReuseHint, SizedPolicy


class SIEVE(SizedPolicy):
    def __init__(self) -> None:
        super().__init__()
        self._newer: dict = {}  # key -> the next newer key (None at the head)
        self._older: dict = {}
        self._visited: dict = {}
        self._head = None  # newest
        self._tail = None  # oldest
        self._hand = None

    def insert(self, key, size: int, parent=None, hint: ReuseHint | None = None) -> None:
        if key in self._size:
            self.access(key)
            return
        self._track(key, size)
        self._visited[key] = False
        self._older[key], self._newer[key] = self._head, None
        if self._head is not None:
            self._newer[self._head] = key
        self._head = key
        if self._tail is None:
            self._tail = key

    def access(self, key) -> None:
        if key in self._visited:
            self._visited[key] = True

    def remove(self, key) -> None:
        if key not in self._size:
            return
        if self._hand == key:
            self._hand = self._newer[key]
        older, newer = self._older.pop(key), self._newer.pop(key)
        if older is not None:
            self._newer[older] = newer
        else:
            self._tail = newer
        if newer is not None:
            self._older[newer] = older
        else:
            self._head = older
        self._untrack(key)
        del self._visited[key]

    def pop_victim(self):
        if not self._size:
            return None
        hand = self._hand if self._hand is not None else self._tail
        while self._visited[hand]:
            self._visited[hand] = False
            hand = self._newer[hand] if self._newer[hand] is not None else self._tail
        self._hand = hand
        self.remove(hand)  # the hand moves on to the next newer object (None: back to the oldest)
        return hand
