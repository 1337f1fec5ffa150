"""StoreClient: the calls engines and engine plug-ins (kvstore/connectors) make on the store, and nothing else.

They take a StoreClient, not the concrete KVClient, so that what they depend on is written down in one
place and anything with these calls (a KVClient, a stand-in in a test) can serve them. Every call blocks
until done but for `save`, `load`, `prefetch` and `cancel_prefetch`, which return at once; a dead or slow
daemon is a miss, never an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvstore.block import Block
from kvstore.client.assembly import BlockData, Buffer, Payload
from kvstore.client.loading import KVDestination, LoadHandle
from kvstore.client.stats import PutSummary
from kvstore.client.write_behind import Then, WriteBehind
from kvstore.eviction import ReuseHint


@runtime_checkable
class StoreClient(Protocol):
    def lookup(self, blocks: Sequence[Block], promote: bool = False) -> int:
        """How many leading blocks of a prefix are stored (the host tier, then every daemon); with `promote`,
        the daemons start promoting the hit from SSD into their DRAM tiers, for the read that follows."""
        ...

    def present(self, blocks: Sequence[Block]) -> list[bool]:
        """Whether each block is stored, each on its own rather than as a prefix."""
        ...

    def get(self, blocks: Sequence[Block], layer_begin: int = 0, layer_end: int | None = None,
            layer_major: bool = False, into: Sequence[Buffer] | None = None) -> list[BlockData]:
        """The leading run of `blocks` that could be read and verified, layers [layer_begin, layer_end)."""
        ...

    def load(self, blocks: Sequence[Block], destination: KVDestination, hit_blocks: int | None = None) -> LoadHandle:
        """Start loading the cached prefix of `blocks` into `destination`, layer by layer; returns at once."""
        ...

    def prefetch(self, blocks: Sequence[Block]) -> int:
        """Fetch the blocks the host tier lacks into it in the background; how many were queued."""
        ...

    def cancel_prefetch(self, blocks: Sequence[Block]) -> int:
        """Stop prefetches of `blocks` not done yet; how many were stopped."""
        ...

    def block_sources(self, blocks: Sequence[Block]) -> list[str]:
        """Where each block would be read from now: "host", or the owning daemon's address."""
        ...

    def tokens_worth_loading(self, blocks: Sequence[Block], hit_blocks: int, block_bytes: int, total_tokens: int,
                             compute_s: Callable[[int, int], float], pipelined: bool = True) -> int:
        """Of a hit of `hit_blocks` leading blocks, how many tokens are faster loaded than recomputed."""
        ...

    def put(self, items: Sequence[tuple[Block, Payload]], num_layers: int, traffic_class: str = "chat",
            hint: ReuseHint | None = None) -> PutSummary:
        """Store blocks with their layer-major payloads, now."""
        ...

    def save(self, items: Sequence[tuple[Block, Payload]], num_layers: int, traffic_class: str = "chat",
             hint: ReuseHint | None = None, then: Then | None = None) -> bool:
        """Queue blocks to be stored in the background (write_behind); False where the queue has no room."""
        ...

    @property
    def write_behind(self) -> WriteBehind:
        """The queue of `save`: flush, pending_bytes, counters."""
        ...

    def delete(self, blocks: Sequence[Block]) -> int:
        ...

    def advise(self, blocks: Sequence[Block], continues: bool) -> int:
        """Once a reply is done: whether the conversation whose prompt is `blocks` goes on."""
        ...

    def close(self) -> None:
        ...
