"""What a Verify may cost: each principal's checks held to a rate, and a block checked at most once in a while.

A Verify re-reads a block's segment copy and checksums it and its DRAM copy: work a client asks for with a
few bytes of request. Unmetered, one read-only token naming its own blocks in a loop kept the disks and
CRC busy at many times the scrub's pace, and every other tenant's reads slowed. So:

* Each principal (limits.py: a token's name, else the peer) has a token bucket of `verify_bytes_per_s`
  record bytes a second, holding at most one second of it; a block is checked only while the caller's
  bucket is not empty. One principal's reports never spend another's.
* A block checked in the last `verify_recheck_s`, whose record has not moved since (same segment and
  offset), is not read again: the answer is that check's, which found it good (a corrupt block is dropped
  by its check, and is then absent).

Keys passed over are counted (`kvstore_verify_skipped_total{reason="rate"|"recent"}`) and are not an error.
Nothing is remembered of a key passed over for rate: a client reports a corrupt block again at its next
failing read, and once its bucket has refilled the report is checked. A report answered from memory can
hide damage done since that check for at most `verify_recheck_s` (and the scrub still reads every record).
A client that spends its own budget therefore delays only its own reports, never another principal's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from kvstore.server.index import Entry
from kvstore.server.pace import TokenBucket

# Why a key named in a Verify is not checked: the caller's budget is spent, or it was checked lately
SkipReason = Literal["rate", "recent"]
MAX_PRINCIPALS = 1024  # idle buckets are forgotten past this many (a full bucket is the same as a new one)
MAX_REMEMBERED = 65536  # recent checks remembered at most; the oldest are forgotten first


class VerifyMeter:
    def __init__(self, bytes_per_s: int, recheck_s: float, clock: Callable[[], float]) -> None:
        self.bytes_per_s = bytes_per_s
        self.recheck_s = recheck_s
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        # key -> (when, segment, offset) of its last check that found it good, oldest first
        self._checked: OrderedDict[bytes, tuple[float, int, int]] = OrderedDict()

    def skip_reason(self, who: str, key: bytes, entry: Entry) -> SkipReason | None:
        """Why a check of `key` (at `entry`) for `who` is passed over now; None: check it (its cost is spent
        from `who`'s budget)."""
        if self._checked_recently(key, entry):
            return "recent"
        if not self._bucket(who).try_spend(entry.record_len):
            return "rate"
        return None

    def checked_good(self, key: bytes, entry: Entry) -> None:
        """A check of `key` at `entry` found no corrupt copy."""
        self._checked.pop(key, None)
        self._checked[key] = (self.clock(), entry.segment, entry.offset)
        if len(self._checked) > MAX_REMEMBERED:
            self._checked.popitem(last=False)

    def _checked_recently(self, key: bytes, entry: Entry) -> bool:
        self._forget_old()
        last = self._checked.get(key)
        return last is not None and last[1:] == (entry.segment, entry.offset)

    def _forget_old(self) -> None:
        oldest_kept = self.clock() - self.recheck_s
        while self._checked:
            key, (when, _, _) = next(iter(self._checked.items()))
            if when > oldest_kept:
                break
            del self._checked[key]

    def _bucket(self, who: str) -> TokenBucket:
        bucket = self._buckets.get(who)
        if bucket is None:
            if len(self._buckets) >= MAX_PRINCIPALS:
                self._buckets = {name: b for name, b in self._buckets.items() if not b.full}
            bucket = self._buckets[who] = TokenBucket(self.bytes_per_s, burst=self.bytes_per_s, clock=self.clock)
        return bucket
