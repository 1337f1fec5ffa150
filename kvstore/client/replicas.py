"""Where a block can be read besides its owner: copies of hot blocks, and blocks whose owner just changed.

A daemon that sees a block read often marks it hot in its Get parts, with the number of copies it
wants (GetPartHead.replicas, ServerConfig.hot_replicas). The client keeps them on the owner and the next
members in rendezvous order (every client picks the same members, and a change of members moves few),
copied in the background (a get from a holder, a put on each member that lacks it), and reads each hot
block from the holder that has served this client the fewest blocks lately. A copy is the whole record,
verified on every read like any block.

When a daemon joins, the keys it now owns are still held by their previous owners; when one leaves
cleanly, it serves on while it drains (ServerConfig.leave_drain_s). For a while after the change
(ClientConfig.handoff_s) the client looks for a moved key on its previous owner too, reads it there,
and copies it to its new owner: a prefix stays a hit instead of breaking at its first moved block.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvstore.client.placement import place

DECAY_READS = 4096  # the load counts halve every this many reads: "lately"


class Replicas:
    def __init__(self, max_keys: int = 65536) -> None:
        self.max_keys = max_keys
        # key -> members other than the owner known to hold a copy (least recently marked first out)
        self.holders: OrderedDict[bytes, frozenset[str]] = OrderedDict()
        self.load: Counter[str] = Counter()  # blocks this client read from each member lately
        self.moved: OrderedDict[bytes, str] = OrderedDict()  # key -> the previous owner found holding it
        self._reads = 0

    def reader(self, key: bytes, live: Sequence[str]) -> str:
        """The member to read `key` from: its owner, or the least loaded holder of a copy."""
        owner = place(key, live)
        choice = owner
        copies = self.holders.get(key)
        if copies:
            choice = min((owner, *(m for m in copies if m in live)), key=self.load.__getitem__)
        self.load[choice] += 1
        self._reads += 1
        if self._reads >= DECAY_READS:
            self._reads = 0
            for member in list(self.load):
                self.load[member] //= 2
        return choice

    def held(self, key: bytes, members: frozenset[str]) -> None:
        """`members` hold copies of `key` (beyond its owner)."""
        self.holders[key] = members
        self.holders.move_to_end(key)
        while len(self.holders) > self.max_keys:
            self.holders.popitem(last=False)

    def found_moved(self, key: bytes, previous: str) -> None:
        self.moved[key] = previous
        while len(self.moved) > self.max_keys:
            self.moved.popitem(last=False)

    def missed(self, key: bytes, member: str) -> None:
        """A holder did not have `key` (its copy was evicted or expired): read the others."""
        if self.moved.get(key) == member:
            del self.moved[key]
        copies = self.holders.get(key)
        if copies and member in copies:
            self.holders[key] = copies - {member}
