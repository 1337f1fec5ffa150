"""The daemons this client knows, and which of them to ask for a key.

Keys are placed by rendezvous over the members that are up (kvstore/client/placement.py). When the
members change, only the keys of daemons that joined or left change owner, and for `handoff_s` those
are looked for on their previous owners too (kvstore/client/replicas.py says why); a daemon that left is
kept open meanwhile, as it serves while it drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor

from kvstore.client.config import ClientConfig
from kvstore.client.membership import Members
from kvstore.client.placement import place
from kvstore.client.replicas import Replicas
from kvstore.client.shard import Shard
from kvstore.client.stats import ClientStats

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, members: Members, config: ClientConfig, stats: ClientStats, executor: Executor,
                 replicas: Replicas) -> None:
        self.config, self.stats, self.executor, self.replicas = config, stats, executor, replicas
        # member name -> its shard; replaced whole, never changed in place, so that threads planning a get
        # (KVClient.get) always see one consistent set while the follower applies a change
        self.shards: dict[str, Shard] = {}
        self._previous: tuple[str, ...] = ()  # the members before the last change ...
        self._previous_until = 0.0  # ... looked at for moved keys until then (time.monotonic)
        # daemons that left, kept open for the handoff: one that left cleanly serves for its leave_drain_s
        self._departed: dict[str, Shard] = {}
        self._leaving: set[asyncio.Task] = set()  # closes of shards whose daemons left
        self._set_members(members)

    def _set_members(self, members: Members) -> list[Shard]:
        """Make `members` the shards (keeping those that stay); returns the shards that left."""
        old, new = self.shards, {}
        for member in members:
            kept = old.get(member.name)
            new[member.name] = kept if kept is not None and kept.address == member.address else \
                Shard(member.address, self.config, self.stats, self.executor, name=member.name)
        self.shards = new
        return [shard for name, shard in old.items() if new.get(name) is not shard]

    def change(self, members: Members) -> None:
        """On the event loop: the follower saw another set of daemons. Only the keys of daemons that joined
        or left change owner (rendezvous); calls in flight to a leaving daemon end as misses."""
        before = tuple(self.shards)
        left = self._set_members(members)
        self.stats.membership_changes += 1
        # The keys that changed owner are still on their old owners: a member that stays, or one that left
        # and still serves while it drains. For handoff_s they are looked for there.
        self._previous, self._previous_until = before, time.monotonic() + self.config.handoff_s
        log.info("daemons now: %s", ", ".join(self.shards) or "none")
        for shard in self._departed.values():
            self._close_later(shard, 0)
        self._departed = {shard.name: shard for shard in left if shard.name not in self.shards}
        for shard in left:
            self._close_later(shard, self.config.handoff_s if shard.name in self._departed else 0)

    def _close_later(self, shard: Shard, delay_s: float) -> None:
        def close() -> None:
            if self._departed.get(shard.name) is shard and delay_s:
                del self._departed[shard.name]
            task = asyncio.ensure_future(shard.close())
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
        if delay_s:
            asyncio.get_running_loop().call_later(delay_s, close)
        else:
            close()

    async def close(self) -> None:
        await asyncio.gather(*(shard.close() for shard in (*self.shards.values(), *self._departed.values())),
                             *self._leaving)

    # -- which daemon -----------------------------------------------------------------------------

    def live(self) -> list[str]:
        """The names of the members that are up."""
        return [name for name, shard in self.shards.items() if shard.up]

    def owner(self, key: bytes) -> Shard | None:
        """The live daemon that owns `key` (rendezvous over the members currently up)."""
        shards = self.shards
        live = [name for name, shard in shards.items() if shard.up]
        return shards[place(key, live)] if live else None

    def owner_name(self, key: bytes) -> str | None:
        shard = self.owner(key)
        return shard.name if shard else None

    def reader(self, key: bytes) -> Shard | None:
        """The live daemon to read `key` from: its owner, or for a hot block the least loaded holder of a copy."""
        shards = self.shards
        previous = self.replicas.moved.get(key)
        if previous is not None and (shard := self.member(previous)) is not None and shard.up:
            return shard  # a moved block not yet copied to its new owner
        live = [name for name, shard in shards.items() if shard.up]
        if not live:
            return None
        return shards[self.replicas.reader(key, live)]

    def member(self, name: str) -> Shard | None:
        """A member's shard, or that of one that left and is kept open for the handoff."""
        return self.shards.get(name) or self._departed.get(name)

    @property
    def changed_lately(self) -> bool:
        """Whether the members changed within handoff_s: moved keys may still be on their previous owners."""
        return bool(self._previous) and time.monotonic() <= self._previous_until

    def previous_owner(self, key: bytes, live: Sequence[str]) -> str | None:
        """Shortly after the daemons changed: the member that owned `key` before, if another and still up."""
        if not self.changed_lately:
            return None
        before = [name for name in self._previous if (shard := self.member(name)) is not None and shard.up]
        if not before or not live:
            return None
        previous = place(key, before)
        return previous if previous != place(key, live) else None

    def group(self, keys: Sequence[bytes]) -> dict[Shard | None, list[int]]:
        """The positions of `keys` by owning live daemon (None: no daemon is up)."""
        groups: dict[Shard | None, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self.owner(key), []).append(i)
        return groups
