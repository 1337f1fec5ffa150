"""What the API layer tells the store about a conversation's future (the store's `Advise`).

The layer sees what no trace records: a reply that ends in a tool call will be followed by the tool's
result (the conversation goes on); a conversation the client deletes (Responses' DELETE) will not; and
one that stays idle longer than its traffic class's idle limit most likely will not either. Each reply's
blocks (prompt and reply, full blocks) are remembered per conversation, keyed by its last block, until
the next turn (whose prompt holds that block) arrives, the conversation is closed, or it idles out.

Not thread-safe: the server calls it from its event loop; `sweep` runs there too, on a timer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.block import Block

Advise = Callable[[Sequence[Block], bool], None]  # client.advise(blocks, continues), perhaps queued


@dataclass
class _Open:
    blocks: Sequence[Block]
    traffic_class: str
    last_s: float


class Advisor:
    def __init__(self, advise: Advise, idle_s: Mapping[str, float], max_open: int = 100_000) -> None:
        """`idle_s`: per traffic class, how long a conversation may idle before it is taken as ended."""
        self.advise, self.idle_s, self.max_open = advise, dict(idle_s), max_open
        self._open: OrderedDict[bytes, _Open] = OrderedDict()  # last block's key -> conversation, oldest first
        self.advised = {"goes_on": 0, "ended": 0, "idle": 0}  # conversations, by why

    def replied(self, blocks: Sequence[Block], traffic_class: str, now_s: float, goes_on: bool = False) -> None:
        """A reply is done; `blocks`: the full blocks of its prompt and reply. With `goes_on` (it ended in
        a tool call) the store is told at once that the conversation goes on."""
        for block in blocks:  # this turn continues an open conversation: it is no longer open
            self._open.pop(block.key, None)
        if goes_on and blocks:  # not kept open: a tool that runs past the idle limit must not unsay it
            self.advise(blocks, True)
            self.advised["goes_on"] += 1
        elif blocks:
            self._open[blocks[-1].key] = _Open(blocks, traffic_class, now_s)
            while len(self._open) > self.max_open:  # bounded: the oldest is forgotten, not judged
                self._open.popitem(last=False)

    def closed(self, blocks: Sequence[Block]) -> None:
        """The client ended the conversation whose last turn had these blocks."""
        if blocks:
            self._open.pop(blocks[-1].key, None)
            self.advise(blocks, False)
            self.advised["ended"] += 1

    def sweep(self, now_s: float) -> int:
        """Advise every conversation idle past its class's limit that it ends; how many were."""
        shortest = min(self.idle_s.values(), default=float("inf"))
        idle = []
        for key, conversation in self._open.items():  # oldest first: once one is within every limit, so are the rest
            if now_s - conversation.last_s <= shortest:
                break
            if now_s - conversation.last_s > self.idle_s.get(conversation.traffic_class, float("inf")):
                idle.append(key)
        for key in idle:
            self.advise(self._open.pop(key).blocks, False)
        self.advised["idle"] += len(idle)
        return len(idle)

    @property
    def open(self) -> int:
        return len(self._open)
