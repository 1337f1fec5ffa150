"""PrefixReuse: evict the leaf least likely to be used again, as learned from this cache's own traffic.

What a KV-prefix cache knows and a generic cache does not:

* A block is reachable only through its parent, so only *leaves* of the cached prefix tree are
  evicted; a parent outlives its children.
* Whether a block is used again is mostly whether its conversation goes on, and the request that put it
  says much about that (`ReuseHint`): in the Mooncake conversation trace a prompt that was >= 90%
  cached is continued 73% of the time, one that was < 50% cached 28%, a prompt under 4 blocks 72%
  (`bench/continuation.py`); so does the number of earlier turns its prompt holds: 42% for a first
  turn, 66% with 4-7 earlier turns, 81% with 8 or more. Blocks are classed by (cached fraction, prompt
  length, turn) of the request that put them, and refined by the engine's advice once the reply is done
  (`advise`: the conversation goes on, or ended), when it has any. Advice covers the conversation's
  whole path but for the blocks several prompts branch from.

Each class keeps its leaves in recency order. The victim is the class tail with the lowest probability
of being used again given its age a (the time since its last use, counted in cache operations):

    P(reuse | class c, unused for a) = p_c S_c(a) / (1 - p_c + p_c S_c(a))

where p_c is the fraction of class-c uses that were followed by another use, and S_c the survival
function of the gaps between uses (the share of gaps longer than a). Both are learned online, and
without the feedback of the policy's own choices: an evicted key is remembered as a *ghost* (as in ARC,
Megiddo and Modha, FAST'03), so a later use of it still counts as a reuse, with its gap. S_c is shrunk
towards the all-class survival with a prior worth 20 gaps, so sparse classes borrow strength. This is
the hit-probability half of LHD (Beckmann et al., NSDI'18) with classes a prefix cache can observe.
Without hints every block falls in one class and the policy is leaf-only LRU. No parameter is fitted to
a trace: the class edges are round numbers and every probability is learned.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
from collections import OrderedDict

from kvstore.eviction.base import ReuseHint, SizedPolicy
from kvstore.eviction.tree import PrefixTree

_FRACTION_EDGES = (0.0, 0.5, 0.9)  # cached fraction of the prompt
_LENGTH_EDGES = (0, 4, 16)  # full blocks in the prompt
_TURN_EDGES = (0, 1, 4)  # earlier turns of the conversation
_ADVICE = {None: 0, True: 1, False: 2}  # the engine said nothing, that the conversation goes on, that it ended
_CLASSES = (1 + 3 * 3 * 3) * len(_ADVICE)  # (no hint, or fraction x length x turn) x advice
_GAP_EDGES = [2 ** (i / 2) for i in range(64)]  # gap histogram bins, in operations: sqrt(2) apart
_EDGE_STEPS = [math.ceil(edge) for edge in _GAP_EDGES]  # the first whole age past each edge
_PRIOR_GAPS = 20.0
_GHOSTS_PER_KEY = 4  # ghost entries kept per tracked key (at least _MIN_GHOSTS)
_MIN_GHOSTS = 1024
_STALE_PER_KEY, _STALE_SLACK = 4, 4096  # heap entries allowed (stale ones included) per tracked key, and more


@functools.lru_cache(maxsize=4096)  # every put of one request has the same hint
def reuse_class(hint: ReuseHint | None) -> int:
    """0 without a hint; else one of 27 (cached fraction x length x turn), refined by the advice."""
    if hint is None or hint.blocks <= 0:
        shape = 0
    else:
        fraction = min(hint.hit_blocks, hint.blocks) / hint.blocks
        f = bisect.bisect_right(_FRACTION_EDGES, fraction) - 1
        n = bisect.bisect_right(_LENGTH_EDGES, hint.blocks) - 1
        t = bisect.bisect_right(_TURN_EDGES, hint.turn) - 1
        shape = 1 + (f * len(_LENGTH_EDGES) + n) * len(_TURN_EDGES) + t
    return with_advice(shape * len(_ADVICE), hint.continues if hint is not None else None)


def with_advice(klass: int, continues: bool | None) -> int:
    """`klass` refined by what the engine advised: the same shape of request, told apart by its fate."""
    return klass - klass % len(_ADVICE) + _ADVICE[continues]


class _Gaps:
    """A histogram of gaps between uses; survival(a) = share of gaps longer than a.

    Every count is a whole number (each gap adds one), so the share longer than any age is kept as
    suffix sums, rebuilt once after a change: exactly the sums of the bins, in whatever order added."""

    def __init__(self) -> None:
        self.counts = [0.0] * (len(_GAP_EDGES) + 1)
        self.total = 0.0
        self._longer: list[float] | None = None  # _longer[b] = sum(counts[b:]), None once stale

    def add(self, gap: int) -> None:
        self.add_in(bisect.bisect_right(_GAP_EDGES, gap))

    def add_in(self, bin: int) -> None:
        self.counts[bin] += 1
        self.total += 1
        self._longer = None

    def longer_than(self, age: int) -> float:
        return self.longer_in(bisect.bisect_right(_GAP_EDGES, age))

    def longer_in(self, bin: int) -> float:
        """The gaps in bin `bin` or later (bin = bisect_right(_GAP_EDGES, age))."""
        longer = self._longer
        if longer is None:  # one bin asked for since the last change: a sum (exact, as whole numbers are)
            return sum(self.counts[bin:])
        return longer[bin]

    def suffix_sums(self) -> list[float]:
        """longer_in for every bin, at once (for rescoring many classes)."""
        longer = self._longer
        if longer is None:
            longer = list(itertools.accumulate(reversed(self.counts)))
            longer.reverse()
            longer.append(0.0)
            self._longer = longer
        return longer

    @staticmethod
    def of(counts: list) -> _Gaps:
        if len(counts) != len(_GAP_EDGES) + 1:
            raise ValueError(f"{len(counts)} gap bins, expected {len(_GAP_EDGES) + 1}")
        gaps = _Gaps()
        gaps.counts = [float(c) for c in counts]
        if not all(c >= 0 and c.is_integer() for c in gaps.counts):
            raise ValueError("gap bins are counts: whole numbers, none negative")
        gaps.total = sum(gaps.counts)
        return gaps


_NO_GAPS = _Gaps()  # what a class has learned before its first gap


class PrefixReuse(SizedPolicy):
    def __init__(self) -> None:
        super().__init__()
        self._last: dict = {}  # key -> operation count at its last use
        self._class: dict = {}
        self._tree = PrefixTree()
        self._leaves: dict[int, list] = {}  # class -> heap of (last use, key) of leaves; stale entries skipped
        self._ghosts: OrderedDict = OrderedDict()  # evicted key -> (last use, class), oldest first
        self._uses: dict[int, float] = {}  # class -> uses seen
        self._reuses: dict[int, float] = {}  # class -> uses followed by another use
        self._gaps: dict[int, _Gaps] = {}
        self._all_gaps = _Gaps()
        self._now = 0
        # The choice, kept between evictions: a class's score changes only when what it learned, its
        # oldest leaf, or the histogram bin of that leaf's age does, and pop_victim rescores only those
        # classes (all of them once the all-class gaps change). Classes in the order of _leaves, as the
        # scan of every class did, so that ties go the same way.
        self._index: dict[int, int] = {}  # class -> its place in _leaves
        self._classes: list[int] = []  # the classes of _leaves, in its order
        self._score: list[float] = []  # per place: the reuse probability of the class's oldest leaf (inf: none)
        # per place: _own(class, bin) and the bin; None: no leaf (then its score is inf)
        self._own_part: list[tuple[float, float, float, int] | None] = []
        self._until: list[float] = []  # per place: the operation count at which that score goes stale
        self._dirty: set[int] = set()  # classes to rescore
        # When only the all-class gaps changed, the scores of the other classes are not recomputed while
        # the oldest leaf with the lowest one is certainly still the choice: each gap added moves the
        # all-class survival of any bin by at most 1 / (gaps), so a score by at most its slope times that
        # (_drift sums those moves; _drift_exact is its value when every score was last exact).
        self._slope: list[float] = []  # per place: a bound on d score / d all-class survival
        self._max_slope = 0.0  # max(_slope) since every score was last exact
        self._drift = 0.0
        self._drift_exact = 0.0
        self._soonest = math.inf  # min(_until)
        self._entries = 0  # heap entries, stale ones included

    def _heap(self, klass: int) -> list:
        heap = self._leaves.get(klass)
        if heap is None:
            heap = self._leaves[klass] = []
            self._index[klass] = len(self._score)
            self._classes.append(klass)
            self._score.append(math.inf)
            self._until.append(math.inf)
            self._own_part.append(None)
            self._slope.append(0.0)
        self._dirty.add(klass)
        self._entries += 1  # the caller pushes one
        if self._entries > _STALE_PER_KEY * len(self._size) + _STALE_SLACK:
            self._compact()
        return heap

    # -- what is observed ---------------------------------------------------------------------------

    def insert(self, key, size: int, parent=None, hint: ReuseHint | None = None) -> None:
        if key in self._size:
            self.access(key)
            return
        self._now += 1
        ghost = self._ghosts.pop(key, None)
        if ghost is not None:
            self._learn_reuse(*ghost)
        self._size[key] = size  # _track, _tree.add and _use inlined: this runs for every block put
        self._bytes += size
        self._tree.add(key, parent)
        above = self._class.get(parent)
        if above is not None:  # the parent is tracked: no longer a leaf
            self._dirty.add(above)
        self._use(key, self.classify(hint))

    def classify(self, hint: ReuseHint | None) -> int:
        """The class of a block put with `hint`; the benchmark overrides it to try other classes."""
        return reuse_class(hint)

    def access(self, key) -> None:
        klass = self._class.get(key)
        if klass is None:  # untracked
            return
        self._now += 1
        self._learn_reuse(self._last[key], klass)
        self._use(key, klass)

    def class_of(self, key) -> int:
        return self._class.get(key, 0)

    def restore(self, key, size: int, parent, klass: int) -> None:
        if key in self._size:
            return
        self._now += 1
        self._track(key, size)
        self._tree.add(key, parent)
        if parent in self._class:  # no longer a leaf
            self._dirty.add(self._class[parent])
        self._last[key] = self._now
        self._class[key] = klass = klass if 0 <= klass < _CLASSES else 0
        if self._tree.is_leaf(key):
            heapq.heappush(self._heap(klass), (self._now, key))

    def snapshot(self) -> dict:
        return {"policy": "prefix-reuse", "now": self._now, "uses": dict(self._uses), "reuses": dict(self._reuses),
                "gaps": {klass: list(gaps.counts) for klass, gaps in self._gaps.items()},
                "all_gaps": list(self._all_gaps.counts)}

    def load(self, snapshot: dict) -> None:
        try:
            if snapshot.get("policy") != "prefix-reuse":
                raise ValueError("not a prefix-reuse snapshot")
            uses = {int(k): float(v) for k, v in snapshot["uses"].items()}
            reuses = {int(k): float(v) for k, v in snapshot["reuses"].items()}
            gaps = {int(k): _Gaps.of(v) for k, v in snapshot["gaps"].items()}
            all_gaps, now = _Gaps.of(snapshot["all_gaps"]), int(snapshot["now"])
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"a malformed prefix-reuse snapshot: {exc!r}") from None
        if not all(0 <= k < _CLASSES for k in (*uses, *reuses, *gaps)) or now < 0:
            raise ValueError("a prefix-reuse snapshot with classes this version does not have")
        self._uses, self._reuses, self._gaps, self._all_gaps, self._now = uses, reuses, gaps, all_gaps, now
        self._dirty.update(self._leaves)
        self._drift_exact = -math.inf  # all-class gaps of another run: no score is near its old value

    def advise(self, key, hint: ReuseHint) -> None:
        if key not in self._size or self._tree.branches(key) > 1:
            return  # a prefix several conversations branch from (a system prompt) is not one's to judge
        old = self._class[key]
        new = with_advice(old, hint.continues)
        if new == old:
            return
        self._class[key] = new
        # its last use now counts for the class whose reuse its next use will show (none to move if it
        # was restored without what was learned)
        self._uses[old] = max(0.0, self._uses.get(old, 0.0) - 1)
        self._uses[new] = self._uses.get(new, 0.0) + 1
        self._dirty.add(old)
        self._dirty.add(new)
        if self._tree.is_leaf(key):
            heapq.heappush(self._heap(new), (self._last[key], key))

    def _use(self, key, klass: int) -> None:
        now = self._now
        self._last[key] = now
        self._class[key] = klass
        uses = self._uses
        uses[klass] = uses.get(klass, 0.0) + 1
        self._dirty.add(klass)
        if not self._tree.branches(key):  # a leaf
            heapq.heappush(self._heap(klass), (now, key))

    def _learn_reuse(self, last: int, klass: int) -> None:
        reuses = self._reuses
        reuses[klass] = reuses.get(klass, 0.0) + 1
        bin = bisect.bisect_right(_GAP_EDGES, self._now - last)
        gaps = self._gaps.get(klass)
        if gaps is None:
            gaps = self._gaps[klass] = _Gaps()
        gaps.add_in(bin)
        every = self._all_gaps
        every.add_in(bin)
        self._dirty.add(klass)
        self._drift += 1.0 / every.total  # every class's survival leans on the all-class gaps

    # -- the choice ---------------------------------------------------------------------------------

    def reuse_probability(self, klass: int, age: int) -> float:
        """P(used again | class, unused for `age` operations), from what was learned so far."""
        return self._probability(klass, bisect.bisect_right(_GAP_EDGES, age))

    def _probability(self, klass: int, bin: int) -> float:
        return self._combine(*self._own(klass, bin), bin)

    def _own(self, klass: int, bin: int) -> tuple[float, float, float]:
        """What the class alone contributes: p, its gaps longer than the age, and their total + prior."""
        uses = self._uses.get(klass, 0.0)
        p = (self._reuses.get(klass, 0.0) + 0.5) / (uses + 1.0)  # a half-use prior keeps p inside (0, 1)
        p = min(p, 0.999)
        gaps = self._gaps.get(klass) or _NO_GAPS
        return p, gaps.longer_in(bin), gaps.total + _PRIOR_GAPS

    def _combine(self, p: float, longer: float, weight: float, bin: int) -> float:
        every = self._all_gaps
        shared = every.longer_in(bin) / every.total if every.total else 1.0
        survival = (longer + _PRIOR_GAPS * shared) / weight
        alive = p * survival
        return alive / (1 - p + alive)

    def _rescore(self, klass: int) -> None:
        """Drop the stale entries off the class's heap and score its oldest leaf (_own and _combine
        inlined: this runs a few times per eviction)."""
        place = self._index.get(klass)
        if place is None:  # a class none of whose blocks was ever a leaf
            return
        heap, last_use, class_of, is_leaf = self._leaves[klass], self._last, self._class, self._tree.is_leaf
        while heap:
            last, key = heap[0]
            if last_use.get(key) == last and class_of[key] == klass and is_leaf(key):
                break
            heapq.heappop(heap)  # stale: used since, evicted, re-classed or no longer a leaf
            self._entries -= 1
        if not heap:
            self._score[place] = self._until[place] = math.inf
            self._own_part[place] = None
            return
        last = heap[0][0]
        bin = bisect.bisect_right(_GAP_EDGES, self._now - last)
        p = (self._reuses.get(klass, 0.0) + 0.5) / (self._uses.get(klass, 0.0) + 1.0)
        p = min(p, 0.999)
        gaps = self._gaps.get(klass) or _NO_GAPS
        longer, weight = gaps.longer_in(bin), gaps.total + _PRIOR_GAPS
        self._own_part[place] = (p, longer, weight, bin)
        every = self._all_gaps
        shared = every.longer_in(bin) / every.total if every.total else 1.0
        alive = p * ((longer + _PRIOR_GAPS * shared) / weight)
        self._score[place] = alive / (1 - p + alive)
        # d score / d shared = (1 - p) (20 p / weight) / (1 - p + alive)^2, at most 20 p / (weight (1 - p))
        slope = self._slope[place] = _PRIOR_GAPS * p / (weight * (1 - p))
        if slope > self._max_slope:
            self._max_slope = slope
        # the score holds until the age reaches the next bin's edge
        self._until[place] = last + _EDGE_STEPS[bin] if bin < len(_GAP_EDGES) else math.inf

    def pop_victim(self):
        now = self._now
        stale = self._dirty
        if now >= self._soonest:
            classes = self._classes
            stale |= {classes[place] for place, until in enumerate(self._until) if until <= now}
        for klass in stale:
            self._rescore(klass)
        if stale:
            self._dirty = set()
            self._soonest = min(self._until, default=math.inf)
        best = self._choice(stale) if self._drift != self._drift_exact else min(self._score, default=math.inf)
        if best == math.inf:
            if self._size:  # only reachable if the tree has a cycle, which chained keys cannot form
                key = next(iter(self._size))
                self.remove(key)
                return key
            return None
        klass = self._classes[self._score.index(best)]  # the first of equals, as a scan in order finds
        _, key = heapq.heappop(self._leaves[klass])
        self._entries -= 1
        self._ghosts[key] = (self._last[key], self._class[key])
        while len(self._ghosts) > max(_MIN_GHOSTS, _GHOSTS_PER_KEY * len(self._size)):
            self._ghosts.popitem(last=False)
        self.remove(key)
        return key

    def _choice(self, fresh: set[int]) -> float:
        """The lowest score, exact, once the all-class gaps changed since the scores of the classes not in
        `fresh` (just rescored) were: those are rescored only if one of them could be the lowest."""
        score, index = self._score, self._index
        fresh = {index[klass] for klass in fresh if klass in index}
        bound = self._max_slope * (self._drift - self._drift_exact) + 1e-9  # and for rounding
        for _ in range(4):
            best = min(score, default=math.inf)
            if best == math.inf:
                return best
            place = score.index(best)
            if place in fresh:
                break
            score[place] = self._arithmetic(place)
            fresh.add(place)
        else:
            return self._rescore_all()
        score[place] = math.inf
        runner_up = min(score)
        score[place] = best
        if runner_up - bound > best:  # no other class can be as low: the choice is `place`, exactly
            return best
        return self._rescore_all()

    def _arithmetic(self, place: int) -> float:
        """_combine for a class whose own part is unchanged, inlined (the all-class gaps changed)."""
        own = self._own_part[place]
        assert own is not None, "a place with a finite score has a leaf, so its own part"
        p, longer, weight, bin = own
        every = self._all_gaps
        shared = every.longer_in(bin) / every.total if every.total else 1.0
        alive = p * ((longer + _PRIOR_GAPS * shared) / weight)
        return alive / (1 - p + alive)

    def _rescore_all(self) -> float:
        """Every score with the all-class gaps as they are: the arithmetic of _combine, inlined."""
        score, every = self._score, self._all_gaps
        total = every.total
        longer_all = every.suffix_sums()
        for place, own in enumerate(self._own_part):
            if own is not None:
                p, longer, weight, bin = own
                shared = longer_all[bin] / total if total else 1.0
                alive = p * ((longer + _PRIOR_GAPS * shared) / weight)
                score[place] = alive / (1 - p + alive)
        self._drift_exact = self._drift
        self._max_slope = max(self._slope, default=0.0)
        return min(score, default=math.inf)

    def _compact(self) -> None:
        """Rebuild the heaps from their entries in force, once mostly stale (each use of a leaf pushes
        one), so that memory follows the blocks tracked. A stale entry never comes back into force but
        with an identical entry pushed (a block's last use only moves forward; a block that is a leaf
        again, or advised back into a class, is pushed again), so every choice stays the same."""
        self._entries = 0
        for klass, heap in self._leaves.items():
            heap[:] = sorted({(last, key) for last, key in heap if self._last.get(key) == last
                              and self._class[key] == klass and self._tree.is_leaf(key)})
            self._entries += len(heap)
        self._dirty.update(self._leaves)

    def remove(self, key) -> None:
        if key not in self._size:
            return
        self._untrack(key)
        self._dirty.add(self._class[key])
        del self._last[key], self._class[key]
        parent = self._tree.remove(key)
        if parent is not None:  # the parent is a leaf now: a candidate
            heapq.heappush(self._heap(self._class[parent]), (self._last[parent], parent))
