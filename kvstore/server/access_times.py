"""What reads teach the index between flushes: access times, extended expiries and eviction policy classes.

A read (or Touch, or a put of a block held already) restarts the block's retention for the longest-lived
class that has used it; Advise may change its eviction policy class. Both are kept here, in memory, and
written to the index every `access_flush_interval_s` and at close, so a read costs no index commit; a crash
loses at most one interval of them (docs/operations.md). What the eviction policy has learned is saved
with them, under POLICY_STATE.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from kvstore.eviction import EvictionPolicy
from kvstore.server.index import Entry, Index, IndexFull, IndexNoSpace, Op

log = logging.getLogger(__name__)
POLICY_STATE = b"policy:learned"  # the index meta key of what the eviction policy has learned


class AccessTimes:
    def __init__(self, policy: EvictionPolicy, ttl_ms: Callable[[int], int]) -> None:
        self._policy = policy
        self._ttl_ms = ttl_ms  # class id -> its TTL
        # key -> (access_ms, expires_ms, class_id), not yet in the index (whose lookups take it into account)
        self.extended: dict[bytes, tuple[int, int, int]] = {}
        self._reclassed: dict[bytes, int] = {}  # key -> its new eviction policy class
        self._learned_saved: bytes | None = None  # the policy snapshot last persisted

    def expiry(self, key: bytes, entry: Entry) -> int:
        """When the block of `entry` expires (ms), counting extensions not yet flushed."""
        extended = self.extended.get(key)
        return max(entry.expires_ms, extended[1]) if extended else entry.expires_ms

    def extend(self, key: bytes, entry: Entry, now_ms: int, class_id: int) -> None:
        """Retain `key` for the TTL of the longest-lived class that has used it, from now."""
        previous = self.extended.get(key)
        classes = [class_id, entry.class_id] + ([previous[2]] if previous else [])
        class_id = max(classes, key=self._ttl_ms)
        expires = now_ms + self._ttl_ms(class_id)
        self.extended[key] = (now_ms, max(expires, previous[1] if previous else 0), class_id)

    def reclass(self, key: bytes, policy_class: int) -> None:
        self._reclassed[key] = policy_class

    def forget(self, key: bytes) -> None:
        """The block left the index: nothing of it is to be written."""
        self.extended.pop(key, None)
        self._reclassed.pop(key, None)

    def unsaved(self) -> int:
        """How many blocks have access times or classes the index lacks."""
        return len(self.extended.keys() | self._reclassed.keys())

    def restore_learned(self, index: Index) -> None:
        """Give the eviction policy back what it had learned (start-up)."""
        saved = index.meta(POLICY_STATE)
        if saved is None:
            return
        try:
            self._policy.load(json.loads(saved))
            self._learned_saved = bytes(saved)
        except ValueError as exc:  # another policy's, or damaged: learning starts afresh, nothing else is lost
            log.warning("the eviction policy's learned state was not restored: %s", exc)

    async def flush(self, index: Index, commit: Callable[[Op], Awaitable]) -> None:
        """Write access times, extended expiries, changed policy classes and what the policy has learned to
        the index; on a full index or disk they are kept for the next flush (a full disk's reserve is
        eviction's)."""
        snapshot = self._policy.snapshot()
        learned = json.dumps(snapshot).encode() if snapshot is not None else None
        if learned == self._learned_saved:
            learned = None
        if not (self.extended or self._reclassed or learned):
            return
        dirty, self.extended = self.extended, {}
        reclassed, self._reclassed = self._reclassed, {}
        save_learned = index.set_meta_op(POLICY_STATE, learned) if learned else None

        def op(txn, db) -> None:
            for key, (access_ms, expires_ms, class_id) in dirty.items():
                raw = txn.get(key, db=db)
                if raw is not None:
                    txn.put(key, Entry.unpack(raw).with_access(access_ms, expires_ms, class_id).pack(), db=db)
            for key, policy_class in reclassed.items():
                raw = txn.get(key, db=db)
                if raw is not None:
                    txn.put(key, replace(Entry.unpack(raw), policy_class=policy_class).pack(), db=db)
            if save_learned is not None:
                save_learned(txn, db)
        try:
            await commit(op)
        except (IndexFull, IndexNoSpace):
            for key, times in dirty.items():
                self.extended.setdefault(key, times)
            for key, policy_class in reclassed.items():
                self._reclassed.setdefault(key, policy_class)
            return
        if learned:
            self._learned_saved = learned
