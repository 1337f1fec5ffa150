"""An n-gram (prompt-lookup) drafter: the tokens that followed the last earlier occurrence of the context.

Agent traffic repeats its context (tool output quoted back, code edited in place, JSON echoed), so the
tokens that followed the longest suffix of the history the last time it occurred are a cheap, often
right guess of what comes next. No model runs: a draft costs a few dictionary lookups.

Per request, `NGramIndex` is updated incrementally as tokens arrive (O(max_n) dict operations a token)
and forgets positions older than `window` tokens, so memory is O(window · max_n) and a proposal is
O(γ · max_n), however long the session grows.

Confidence. For each proposed token k the drafter reports the empirical conditional frequency of that
token after its own context: the longest m-gram (m ≤ max_n) ending just before it, in the history
followed by the drafts 1..k-1 (the tokens before it, as DSpark defines the confidence: given that
the earlier drafts are accepted), counted over the window. With c = how often that m-gram occurred with
a successor and f = how often the successor was the drafted token,

    raw = (f + 1) / (c + 2)          (Laplace: a context seen once gives 2/3, never 1)

It rises with how consistently the continuation was seen and how often, is low where the context was
followed by different tokens, and needs no training; the length m of the match and the position k are
kept beside it (`DraftToken`) because calibration (`engine.speculative.calibration`) gives each
position its own temperature, which absorbs how reliability falls with k.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

GAMMA = 5  # drafts per request at most (DSpark's γ)
MAX_N = 4  # the longest suffix n-gram looked up
WINDOW = 8192  # positions the index remembers: bounds memory and per-token work


@dataclass(frozen=True)
class DraftToken:
    token: int
    confidence: float  # raw, uncalibrated: (follow + 1) / (context_count + 2)
    match: int  # m: the length of the context n-gram the counts are of (0: no context seen)
    context_count: int  # c: occurrences of that context with a successor, in the window
    follow_count: int  # f: of those, followed by `token`


class NGramIndex:
    """One request's token history, indexed by every n-gram (n ≤ max_n) that has a successor.

    For the n-gram g ending just before position t (tokens [t-n, t)), appending token t records:
    last[g] = t (where its latest continuation starts), context[g] += 1 and follow[(g, token t)] += 1.
    Positions that leave the window are taken back out, so the counts are always over the window.
    """

    def __init__(self, max_n: int = MAX_N, window: int = WINDOW) -> None:
        if max_n < 1 or window < max_n + 1:
            raise ValueError(f"an n-gram index needs max_n >= 1 and window > max_n, got {max_n}, {window}")
        self.max_n, self.window = max_n, window
        self._tokens: deque[int] = deque()  # the last window + max_n tokens (the evicted n-grams' own tokens)
        self._first = 0  # absolute position of self._tokens[0]
        self.length = 0  # tokens appended so far
        self._last: dict[tuple[int, ...], int] = {}
        self._context: dict[tuple[int, ...], int] = {}
        self._follow: dict[tuple[tuple[int, ...], int], int] = {}
        self._events: deque[tuple[int, list[tuple[int, ...]]]] = deque()  # (t, the n-grams recorded at t)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        t = self.length
        grams = [self._gram(t - n, t) for n in range(1, min(self.max_n, t) + 1)]
        for gram in grams:
            self._last[gram] = t
            self._context[gram] = self._context.get(gram, 0) + 1
            self._follow[gram, token] = self._follow.get((gram, token), 0) + 1
        self._events.append((t, grams))
        self._tokens.append(token)
        self.length += 1
        self._evict()

    def _evict(self) -> None:
        oldest = self.length - self.window  # continuations starting before this are forgotten
        while self._events and self._events[0][0] < oldest:
            t, grams = self._events.popleft()
            token = self.token(t)
            for gram in grams:
                if self._last.get(gram) == t:  # no later occurrence: the n-gram leaves the index
                    del self._last[gram]
                _decrement(self._context, gram)
                _decrement(self._follow, (gram, token))
        # keep the tokens of what is still indexed: continuations from `oldest`, their contexts max_n before
        while self._first < oldest - self.max_n:
            self._tokens.popleft()
            self._first += 1

    def token(self, position: int) -> int:
        return self._tokens[position - self._first]

    def _gram(self, begin: int, end: int) -> tuple[int, ...]:
        return tuple(self._tokens[i - self._first] for i in range(begin, end))

    def continuation(self, gram: tuple[int, ...]) -> int | None:
        """Where the latest continuation of `gram` starts (absolute position), or None if not indexed."""
        return self._last.get(gram)

    def counts(self, gram: tuple[int, ...], token: int) -> tuple[int, int]:
        """(occurrences of `gram` with a successor, of those followed by `token`), over the window."""
        return self._context.get(gram, 0), self._follow.get((gram, token), 0)

    @property
    def entries(self) -> int:
        """Dictionary entries held: bounded by about 3 · window · max_n."""
        return len(self._last) + len(self._context) + len(self._follow)


def _decrement(counts: dict, key: object) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


class NGramDrafter:
    """Prompt-lookup drafting over one request's `NGramIndex`: feed it every token, ask it for drafts."""

    def __init__(self, gamma: int = GAMMA, max_n: int = MAX_N, window: int = WINDOW) -> None:
        if gamma < 1:
            raise ValueError(f"a drafter proposes at least one token, got gamma {gamma}")
        self.gamma = gamma
        self.index = NGramIndex(max_n, window)

    def extend(self, tokens: Iterable[int]) -> None:
        """Tokens the request now has (prompt, then accepted and sampled ones), in order."""
        self.index.extend(tokens)

    def propose(self, limit: int | None = None) -> list[DraftToken]:
        """Up to min(gamma, limit) drafts continuing the history; [] when no suffix occurred before."""
        index, count = self.index, self.gamma if limit is None else min(self.gamma, limit)
        if count <= 0 or index.length == 0:
            return []
        start = None
        for n in range(min(index.max_n, index.length), 0, -1):  # the longest suffix seen before wins
            start = index.continuation(tuple(index.token(p) for p in range(index.length - n, index.length)))
            if start is not None:
                break
        if start is None:
            return []
        drafts: list[int] = []
        for k in range(count):
            # copying from `start` may run into the end of the history (a period shorter than gamma): it goes
            # on through the drafts themselves, which repeat the period
            position = start + k
            drafts.append(index.token(position) if position < index.length else drafts[position - index.length])
        return [self._scored(drafts, k) for k in range(count)]

    def _scored(self, drafts: Sequence[int], k: int) -> DraftToken:
        """Draft k's confidence from the counts of its longest indexed context in history + drafts[:k]."""
        index, token = self.index, drafts[k]

        def at(position: int) -> int:  # a position of history + drafts
            return index.token(position) if position < index.length else drafts[position - index.length]

        end = index.length + k  # draft k sits at this position of history + drafts
        for m in range(min(index.max_n, end), 0, -1):
            context, follow = index.counts(tuple(at(p) for p in range(end - m, end)), token)
            if context:
                return DraftToken(token, (follow + 1) / (context + 2), m, context, follow)
        return DraftToken(token, 0.5, 0, 0, 0)  # unreachable for copied drafts: their 1-gram was indexed
