"""The cached prefix tree, as the prefix-aware policies see it: which tracked keys are leaves.

A block is reachable only through its parent, so those policies evict leaves only. Puts arrive leaf
first, so a child may be added before its parent: children are counted per parent key whether or not
the parent is tracked yet.
"""

from __future__ import annotations


class PrefixTree:
    def __init__(self) -> None:
        self._parent: dict = {}  # tracked key -> its parent (None for a first block)
        self._children: dict = {}  # key -> tracked children

    def add(self, key, parent) -> None:
        self._parent[key] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1

    def is_leaf(self, key) -> bool:
        return not self._children.get(key)

    def branches(self, key) -> int:
        """How many tracked children `key` has: more than one, and several prompts go on from it."""
        return self._children.get(key, 0)

    def remove(self, key):
        """Forget `key`; its parent if that is tracked and has just become a leaf, else None."""
        parent = self._parent.pop(key)
        if parent is None:
            return None
        self._children[parent] -= 1
        if self._children[parent]:
            return None
        del self._children[parent]
        return parent if parent in self._parent else None
