"""Adaptive: follow whichever candidate policy is winning on this cache's own traffic.

No single policy wins everywhere: PrefixReuse beats LRU by far at small capacities of chat traffic and
loses to it on traffic of long private contexts. A store run on traffic nobody has measured should never
do worse than the best of its candidates, so it measures them online:

* every candidate runs in full over the whole key set (each tracks every key and every use); the cache
  has one eviction order, so victims come from the candidate being followed, and each victim is removed
  from all of them. Switching is free: the new order already knows every key and its history.
* what each candidate *would* hit at this capacity is estimated by miniature simulations (Waldspurger
  et al., "Cache Modeling and Optimization using Miniature Simulations", USENIX ATC 2017): keys are
  sampled by a hash of the key at rate R (spatial sampling: a sampled key is sampled at every use), and
  each candidate gets a shadow cache of capacity x R bytes fed every use of a sampled key. R is chosen so
  a shadow holds about `SHADOW_BLOCKS` blocks (1 when the capacity is that small): enough to rank policies,
  cheap at large capacities. A shadow's hits are per block; prefix-aware owners keep parents at least
  as long as children, so that is close to the leading-run hits the store counts.
* the hit bytes of each shadow decay over a window of `WINDOW_CAPACITIES` shadow capacities of use; the
  followed candidate changes only when another's windowed hit ratio is higher by more than `MARGIN`
  and by more than `Z` standard deviations of a sign test on the uses where only one of the two hit
  (hysteresis: a tie does not flip it, nor does the noise of a few thousand sampled uses). LRU is
  followed first: it is the safe default until the shadows know better.

Costs: the sum of the candidates' own, plus the shadows on an R-share of the uses. Known bias: only the
followed candidate sees its victims as evictions (PrefixReuse remembers its own victims as ghosts; the
others' victims it sees removed), so a candidate not followed learns slightly less; the shadows, which
evict for themselves, are what the choice rests on.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable, Sequence

from kvstore.eviction.base import EvictionPolicy, ReuseHint
from kvstore.eviction.lru import LRU
from kvstore.eviction.prefix import PrefixLFU
from kvstore.eviction.reuse import PrefixReuse
from kvstore.eviction.s3fifo import S3FIFO
from kvstore.eviction.sieve import SIEVE

CANDIDATES = ("lru", "prefix-reuse")
SHADOW_BLOCKS = 2048  # blocks a shadow cache holds (Waldspurger et al. rank policies well with far fewer)
WINDOW_CAPACITIES = 64.0  # the hit ratios are measured over this many shadow capacities of use
MARGIN = 0.01  # another candidate must hit this much more (1 point) of the sampled bytes to be followed
Z = 3.0  # and by more than chance could give it: three standard deviations of a sign test
CHECK_EVERY = 256  # sampled uses between comparisons
_SPACE = 1 << 64


def _candidate(name: str, capacity_bytes: int) -> EvictionPolicy:
    makers: dict[str, Callable[[], EvictionPolicy]] = {
        "lru": LRU, "prefix-reuse": PrefixReuse, "prefix-lfu": PrefixLFU, "sieve": SIEVE,
        "s3fifo": lambda: S3FIFO(max(capacity_bytes, 1))}
    if name not in makers:
        raise ValueError(f"adaptive cannot follow {name!r}; choose among {', '.join(makers)}")
    return makers[name]()


def sample_point(key) -> int:
    """A uniform 64-bit hash of `key`, the same in every process (spatial sampling needs it stable)."""
    if isinstance(key, int):  # the simulator's ids: a multiplicative hash (Knuth), then mixed
        x = (key * 0x9E3779B97F4A7C15) % _SPACE
        return ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) % _SPACE
    data = key if isinstance(key, bytes) else repr(key).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class _Shadow:
    """A miniature cache running one candidate on the sampled keys."""

    def __init__(self, policy: EvictionPolicy, capacity_bytes: float) -> None:
        self.policy, self.capacity_bytes = policy, capacity_bytes
        self.hits = 0.0  # decayed hit bytes

    def use(self, key, size: int, parent, hint: ReuseHint | None) -> bool:
        if key in self.policy:
            self.hits += size
            self.policy.access(key)
            return True
        self.policy.insert(key, size, parent, hint)
        self._fit()
        return False

    def _fit(self) -> None:
        while self.policy.tracked_bytes > self.capacity_bytes and self.policy.pop_victim() is not None:
            pass


class Adaptive(EvictionPolicy):
    def __init__(self, capacity_bytes: int, candidates: Sequence[str] = CANDIDATES) -> None:
        if len(set(candidates)) != len(candidates) or not candidates:
            raise ValueError("adaptive needs distinct candidates")
        self.capacity_bytes = capacity_bytes
        self.names = tuple(candidates)
        self._full = [_candidate(name, capacity_bytes) for name in self.names]
        self._following = 0
        self._shadows: list[_Shadow] = []  # made at the first block (R needs a block's size); none at capacity 0
        self._sized = False  # whether the first block has sized the shadows
        self._threshold = _SPACE  # sampled: sample_point(key) < threshold
        self._used = 0.0  # decayed sampled bytes used
        self._since_check = 0
        self._bytes_since_check = 0.0
        # sampled tracked key -> (size, parent), for the shadows
        self._kept: dict[Hashable, tuple[int, Hashable | None]] = {}
        self.switches = 0
        # a reuse-learning candidate keeps the classes the owner stores with each block
        self._classer = next((p for p in self._full if isinstance(p, PrefixReuse)), None)

    # -- which candidate -----------------------------------------------------------------------------

    @property
    def following(self) -> str:
        return self.names[self._following]

    @property
    def sample_rate(self) -> float:
        return self._threshold / _SPACE

    def estimates(self) -> dict[str, float]:
        """Each candidate's windowed hit ratio in its shadow (of the sampled bytes used)."""
        if not self._shadows or not self._used:
            return {name: 0.0 for name in self.names}
        return {name: shadow.hits / self._used for name, shadow in zip(self.names, self._shadows)}

    def _start_shadows(self, size: int) -> None:
        self._sized = True
        if self.capacity_bytes <= 0:  # nothing to size them by: follow the first candidate
            return
        rate = min(1.0, SHADOW_BLOCKS * max(size, 1) / self.capacity_bytes)
        self._threshold = min(_SPACE, math.ceil(rate * _SPACE))
        self._shadows = [_Shadow(_candidate(name, max(1, round(self.capacity_bytes * rate))),
                                 self.capacity_bytes * rate) for name in self.names]
        self._window = WINDOW_CAPACITIES * self.capacity_bytes * rate
        self._disagree = [[0.0] * len(self.names) for _ in self.names]  # decayed size^2 of uses only one hit

    def _sampled(self, key) -> bool:
        return self._threshold == _SPACE or sample_point(key) < self._threshold

    def _shadow_use(self, key, size: int, parent, hint: ReuseHint | None) -> None:
        hits = [shadow.use(key, size, parent, hint) for shadow in self._shadows]
        if any(hits) and not all(hits):
            for i, hit in enumerate(hits):
                for j in range(i):
                    if hit != hits[j]:
                        self._disagree[i][j] += size * size
                        self._disagree[j][i] += size * size
        self._used += size
        self._bytes_since_check += size
        self._since_check += 1
        if self._since_check >= CHECK_EVERY:
            self._check()

    def _check(self) -> None:
        decay = math.exp(-self._bytes_since_check / self._window)
        self._since_check, self._bytes_since_check = 0, 0.0
        self._used *= decay
        for shadow in self._shadows:
            shadow.hits *= decay
        self._disagree = [[d * decay for d in row] for row in self._disagree]
        hits = [shadow.hits for shadow in self._shadows]
        best = max(range(len(hits)), key=hits.__getitem__)
        lead = hits[best] - hits[self._following]
        # a sign test (McNemar's): were the two alike, each use where only one of them hits would favour
        # either with even odds, and the lead would be within Z standard deviations of 0
        if lead > MARGIN * self._used and lead > Z * math.sqrt(self._disagree[best][self._following]):
            self._following = best
            self.switches += 1

    # -- what is observed ----------------------------------------------------------------------------

    def insert(self, key, size: int, parent=None, hint: ReuseHint | None = None) -> None:
        if not self._sized:
            self._start_shadows(size)
        if self._shadows and self._sampled(key):
            if key not in self._kept:
                self._kept[key] = (size, parent)
            self._shadow_use(key, size, parent, hint)
        for policy in self._full:
            policy.insert(key, size, parent, hint)

    def access(self, key) -> None:
        if key not in self._full[0]:
            return
        if key in self._kept:  # sampled: a shadow may have to put a block the cache only reads
            self._shadow_use(key, *self._kept[key], None)
        for policy in self._full:
            policy.access(key)

    def advise(self, key, hint: ReuseHint) -> None:
        for policy in self._full:
            policy.advise(key, hint)
        if key in self._kept:
            for shadow in self._shadows:
                shadow.policy.advise(key, hint)

    def remove(self, key) -> None:
        """Deleted or expired: gone from the shadows too. (A victim is untracked already: a no-op.)"""
        if key not in self._full[0]:
            return
        for policy in self._full:
            policy.remove(key)
        if self._kept.pop(key, None) is not None:
            for shadow in self._shadows:
                shadow.policy.remove(key)

    def pop_victim(self):
        key = self._full[self._following].pop_victim()
        if key is not None:
            for number, policy in enumerate(self._full):
                if number != self._following:
                    policy.remove(key)
            self._kept.pop(key, None)
        return key

    # -- restarts: classes and what was learned --------------------------------------------------------

    def classify(self, hint: ReuseHint | None) -> int:
        return self._classer.classify(hint) if self._classer is not None else 0

    def class_of(self, key) -> int:
        return self._classer.class_of(key) if self._classer is not None else 0

    def restore(self, key, size: int, parent, klass: int) -> None:
        if not self._sized:
            self._start_shadows(size)
        for policy in self._full:
            policy.restore(key, size, parent, klass)
        if self._shadows and self._sampled(key):
            self._kept.setdefault(key, (size, parent))
            for shadow in self._shadows:
                if key not in shadow.policy:
                    shadow.policy.restore(key, size, parent, klass)
                    shadow._fit()

    def snapshot(self) -> dict:
        return {"policy": "adaptive", "following": self.following,
                "candidates": {name: policy.snapshot() for name, policy in zip(self.names, self._full)}}

    def load(self, snapshot: dict) -> None:
        try:
            if snapshot.get("policy") != "adaptive":
                raise ValueError("not an adaptive snapshot")
            following, learned = snapshot["following"], snapshot["candidates"]
            if following not in self.names or not isinstance(learned, dict):
                raise ValueError(f"an adaptive snapshot following {following!r}, not one of {self.names}")
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"a malformed adaptive snapshot: {exc!r}") from None
        for name, policy in zip(self.names, self._full):
            if learned.get(name) is not None:
                policy.load(learned[name])
        self._following = self.names.index(following)

    def __len__(self) -> int:
        return len(self._full[0])

    def __contains__(self, key: object) -> bool:
        return key in self._full[0]

    @property
    def tracked_bytes(self) -> int:
        return self._full[0].tracked_bytes
