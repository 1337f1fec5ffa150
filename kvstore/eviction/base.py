"""The eviction policy interface shared by the daemon's SSD store, its DRAM tier and the client's host tier.

A policy only orders keys; the owner of the bytes removes them. Calls come from one thread.
Prefix-awareness contract: owners report the blocks of one prefix *leaf first* (`access` in reverse
prefix order), so a policy that favours recent keys keeps a parent at least as long as its children.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple


class ReuseHint(NamedTuple):
    """What the engine knew of the request that produced a block: how many of its prompt's full blocks
    were already cached, how many it had, and how many earlier turns of its conversation the prompt
    holds (the assistant messages of a chat prompt; 0 for a first turn or when unknown). A policy may
    use it to guess whether the block will be used again (a prompt mostly cached, or deep into a
    conversation, is a conversation that goes on); all may ignore it.

    `continues` is what the engine learned once the reply was done, sent with `advise`: True when the
    conversation will go on (the reply ended in a tool call its agent will answer), False when it ended
    (the session was closed); None when it cannot tell."""

    hit_blocks: int
    blocks: int
    turn: int = 0
    continues: bool | None = None


class EvictionPolicy(ABC):
    @abstractmethod
    def insert(self, key, size: int, parent=None, hint: ReuseHint | None = None) -> None:
        """Start tracking `key` of `size` bytes, whose prefix parent is `parent` (None for a first block).

        Re-inserting a tracked key counts as an access. Keys are any hashable (bytes in the store)."""

    @abstractmethod
    def access(self, key: bytes) -> None:
        """`key` was read; a no-op for an untracked key."""

    def advise(self, key: bytes, hint: ReuseHint) -> None:
        """The engine knows more about the conversation whose prompt holds `key` (`hint.continues`); not
        a use of it.

        A no-op for an untracked key, and for policies that take no advice."""

    # -- what survives a restart: the owner keeps a class (0-255) with each block and a snapshot ------

    def classify(self, hint: ReuseHint | None) -> int:
        """The class a block put with `hint` gets, for the owner to keep with it; 0 if none."""
        return 0

    def class_of(self, key: bytes) -> int:
        """The class `key` has now (advice may change it), for the owner to keep with it; 0 if none."""
        return 0

    def restore(self, key: bytes, size: int, parent, klass: int) -> None:
        """Track `key` again after a restart, in the class kept for it; owners restore oldest first.
        Not a use: what the policy learned comes back with `load`."""
        self.insert(key, size, parent)

    def snapshot(self) -> dict | None:
        """What the policy has learned, JSON-able, for the owner to keep; None if nothing."""
        return None

    def load(self, snapshot: dict) -> None:
        """Take back a `snapshot` (before any restore); ValueError if it is not one of this policy's."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Stop tracking `key` (deleted or expired); a no-op for an untracked key."""

    @abstractmethod
    def pop_victim(self) -> bytes | None:
        """Choose the next key to evict and stop tracking it; None when nothing is tracked."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @property
    @abstractmethod
    def tracked_bytes(self) -> int:
        """Sum of the sizes of tracked keys."""


class SizedPolicy(EvictionPolicy):
    """A policy that keeps the size of each key it tracks itself (in `_size`, summed in `_bytes`)."""

    def __init__(self) -> None:
        self._size: dict = {}
        self._bytes = 0

    def _track(self, key, size: int) -> None:
        self._size[key] = size
        self._bytes += size

    def _untrack(self, key) -> None:
        self._bytes -= self._size.pop(key)

    def __len__(self) -> int:
        return len(self._size)

    def __contains__(self, key: object) -> bool:
        return key in self._size

    @property
    def tracked_bytes(self) -> int:
        return self._bytes
