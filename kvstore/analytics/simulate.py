"""Replay a request trace through a cache of blocks: our policies, Belady's optimum, the infinite cache.

Each request is served as the engine and the daemon serve it: the hit is the leading run of its blocks
that are cached (and not expired); those are read, leaf first; the missing blocks are computed and put,
leaf first, evicting what the policy chooses once the cache is full. Blocks carry the TTL of the
longest-lived traffic class that used them, refreshed on every use; expired blocks are misses and are
evicted before the policy is asked. A block's weight is its tokens (512, or fewer for the last block).

Like the store (only full blocks are stored, docs/design.md section 3), a request's partial last block is
never cached, by any policy or bound: the next turn's version of it is longer and hashes differently
(in the Mooncake conversation trace, 11,891 partial blocks are reused 118 times in all).
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import cast

import numpy as np

from kvstore.analytics.trace import Request, continued_requests, conversation_turns
from kvstore.eviction import ReuseHint, make_policy

Progress = Callable[[int], None]
_STALE_SLACK = 4096  # Belady's heap entries beyond 2 per cached block before the stale ones are dropped


@dataclass
class ReplayResult:
    policy: str
    capacity_blocks: int | None
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    expiries: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "token_hit_rate": self.token_hit_rate, "block_hit_rate": self.block_hit_rate}


def replay(requests: Sequence[Request], policy: str, capacity_blocks: int | None, block_tokens: int = 512,
           ttl_s: dict[str, float] | None = None, progress: Progress | None = None,
           low_blocks: int | None = None, continuation_signal: float | None = None) -> ReplayResult:
    """Replay through `policy` ("lru", "s3fifo", "sieve", "prefix-lfu", "belady" or "infinite").

    With `low_blocks`, eviction works as the daemon's watermarks do: once more than `capacity_blocks`
    are cached, blocks go until `low_blocks` are left; otherwise one block goes per block admitted.
    With `continuation_signal` = q, engines are simulated that advise the store, once each reply is
    done, whether its conversation goes on (`ReuseHint.continues`), right with probability q: traces
    do not record it, so it is drawn from the future (seeded, the same for every policy)."""

    if policy == "belady":
        return _belady(requests, capacity_blocks, block_tokens, progress)
    if capacity_blocks is not None and capacity_blocks < 1:
        raise ValueError("capacity must be at least one block")
    result = ReplayResult(policy, capacity_blocks)
    chooser = None if policy == "infinite" or capacity_blocks is None else make_policy(policy, capacity_blocks)
    ttl = _Retention(ttl_s) if ttl_s else None
    present: set = set()
    turns = conversation_turns(requests, block_tokens)
    signals = None if continuation_signal is None else continuation_signals(requests, continuation_signal, block_tokens)
    # the policy's methods and the counters as locals: this loop runs once per block of a million-request trace.
    # A policy orders any hashable keys (EvictionPolicy.insert), here the trace's ints, where its methods'
    # annotations name the store's bytes.
    access = cast("Callable[[int], None]", chooser.access) if chooser is not None else None
    insert = chooser.insert if chooser is not None else None
    advise = cast("Callable[[int, ReuseHint], None]", chooser.advise) if chooser is not None else None
    room = capacity_blocks if chooser is not None and low_blocks is None else None  # one out per block in
    high = capacity_blocks if chooser is not None and low_blocks is not None else None  # watermarks: past it
    blocks = hit_blocks = tokens = hit_tokens = 0

    def evict(key) -> None:
        present.discard(key)
        if chooser is not None:
            chooser.remove(key)
        if ttl is not None:
            ttl.forget(key)

    for number, request in enumerate(requests):
        now = request.timestamp_ms / 1000
        ids = request.hash_ids
        hit = 0
        if ttl is None:
            for key in ids:
                if key not in present:
                    break
                hit += 1
        else:
            for key in ids:
                if key not in present:
                    break
                if ttl.expired(key, now):
                    evict(key)
                    result.expiries += 1
                    break
                hit += 1
        length = request.input_length
        blocks += len(ids)
        hit_blocks += hit
        tokens += length
        hit_tokens += _hit_tokens(len(ids), length, hit, block_tokens)
        full = length // block_tokens
        hint = ReuseHint(min(hit, full), full, turns[number])  # what the engine tells the store with its puts
        if hit:
            if access is not None:
                for position in range(hit - 1, -1, -1):  # read, leaf first
                    access(ids[position])
            if ttl is not None:
                for position in range(hit - 1, -1, -1):
                    ttl.touch(ids[position], request.traffic_class, now)
        for position in range(full - 1, hit - 1, -1):  # computed and put, leaf first
            key = ids[position]
            if key in present:  # put again: its retention is extended, nothing more
                if ttl is not None:
                    ttl.touch(key, request.traffic_class, now)
                continue
            if room is not None:
                while len(present) >= room:
                    _make_room(chooser, ttl, now, present, result)
            if insert is not None:
                insert(key, 1, ids[position - 1] if position else None, hint)
            present.add(key)
            if high is not None and low_blocks is not None and len(present) > high:
                while len(present) > low_blocks:
                    _make_room(chooser, ttl, now, present, result)
            if ttl is not None:
                ttl.touch(key, request.traffic_class, now)
        if signals is not None and advise is not None:  # the reply is done: the engine says what it knows
            advice = hint._replace(continues=signals[number])
            for key in ids[:full]:
                advise(key, advice)
        if progress is not None:
            progress(number + 1)
    result.requests = len(requests)
    result.blocks, result.hit_blocks, result.tokens, result.hit_tokens = blocks, hit_blocks, tokens, hit_tokens
    return result


def continuation_signals(requests: Sequence[Request], right: float, block_tokens: int = 512) -> list[bool]:
    """Per request, a simulated engine's word on whether its conversation goes on, right with
    probability `right` (seeded: the same for every policy and for the daemons)."""
    if not 0.0 <= right <= 1.0:
        raise ValueError(f"the continuation signal is right with a probability, got {right}")
    flips = np.random.default_rng(0).random(len(requests)) >= right
    return [bool(truth != flip) for truth, flip in zip(continued_requests(requests, block_tokens), flips)]


def _make_room(chooser, ttl: _Retention | None, now: float, present: set, result: ReplayResult) -> None:
    """Evict one block: an expired one if there is any, else the policy's choice."""
    victim = ttl.pop_expired(now) if ttl is not None else None
    if victim is not None:
        result.expiries += 1
        chooser.remove(victim)
    else:
        victim = chooser.pop_victim()  # which stops tracking it
        result.evictions += 1
    present.discard(victim)
    if ttl is not None:
        ttl.forget(victim)


def _full_blocks(request: Request, block_tokens: int) -> int:
    return request.input_length // block_tokens


def _hit_tokens(blocks: int, input_length: int, hit: int, block_tokens: int) -> int:
    """Tokens of a leading run of `hit` of a prompt's `blocks` blocks: full ones, and the last one's own."""
    if hit < blocks:
        return hit * block_tokens
    return input_length


def _count(result: ReplayResult, request: Request, hit: int, block_tokens: int) -> None:
    result.requests += 1
    result.blocks += len(request.hash_ids)
    result.hit_blocks += hit
    result.tokens += request.input_length
    result.hit_tokens += _hit_tokens(len(request.hash_ids), request.input_length, hit, block_tokens)


class _Retention:
    """Last use and TTL of each cached block; expired blocks come out oldest first."""

    def __init__(self, ttl_s: dict[str, float]) -> None:
        self.ttl_s = ttl_s
        self.default = max(ttl_s.values())
        self._ttl: dict = {}  # key -> its TTL (the longest of the classes that used it)
        self._by_ttl: dict[float, OrderedDict] = defaultdict(OrderedDict)  # TTL -> key -> last use, oldest first

    def touch(self, key, traffic_class: str, now: float) -> None:
        ttl = max(self.ttl_s.get(traffic_class, self.default), self._ttl.get(key, 0.0))
        old = self._ttl.get(key)
        if old is not None and old != ttl:
            del self._by_ttl[old][key]
        self._ttl[key] = ttl
        queue = self._by_ttl[ttl]
        queue[key] = now
        queue.move_to_end(key)

    def expired(self, key, now: float) -> bool:
        ttl = self._ttl.get(key)
        return ttl is not None and self._by_ttl[ttl][key] + ttl <= now

    def pop_expired(self, now: float):
        for ttl, queue in self._by_ttl.items():
            if queue:
                key, last = next(iter(queue.items()))
                if last + ttl <= now:
                    return key
        return None

    def forget(self, key) -> None:
        ttl = self._ttl.pop(key, None)
        if ttl is not None:
            self._by_ttl[ttl].pop(key, None)


def _belady(requests: Sequence[Request], capacity_blocks: int | None, block_tokens: int,
            progress: Progress | None) -> ReplayResult:
    """Belady's optimum: evict (or do not admit) the block whose next use is farthest in the future.

    Next use is measured in requests, so every block of a prefix a request will read ties. Only a leading
    run hits, so among those the deepest block is the one to give up: evicting the root would cut off
    the whole run behind it. Blocks are ordered by (next use, depth), deepest first among equals."""
    result = ReplayResult("belady", capacity_blocks)
    starts, rank_of = _ranks(requests)
    rank: dict = {}  # key -> its rank: (next use, depth) in one int, the larger the sooner it goes
    present: set = set()
    farthest: list = []  # (-rank, key), stale entries skipped
    for number, request in enumerate(requests):
        ids = request.hash_ids
        hit = 0
        while hit < len(ids) and ids[hit] in present:
            hit += 1
        _count(result, request, hit, block_tokens)
        for key, order in zip(ids, rank_of[starts[number]:starts[number + 1]]):
            rank[key] = order
            if key in present:
                heapq.heappush(farthest, (-order, key))
        for key in ids[hit:_full_blocks(request, block_tokens)]:
            if key in present:
                continue
            if capacity_blocks is not None and len(present) >= capacity_blocks:
                while True:
                    negative, victim = farthest[0]
                    if victim in present and -negative == rank[victim]:
                        break
                    heapq.heappop(farthest)
                if rank[victim] <= rank[key]:
                    continue  # this block would go before anything cached: do not admit it
                heapq.heappop(farthest)
                present.discard(victim)
                result.evictions += 1
            present.add(key)
            heapq.heappush(farthest, (-rank[key], key))
        if len(farthest) > 2 * len(present) + _STALE_SLACK:  # mostly stale: keep it linear in the blocks cached
            farthest = _current(farthest, present, rank)
        if progress is not None:
            progress(number + 1)
    return result


def _ranks(requests: Sequence[Request]) -> tuple[array, array]:
    """Per block of every request, its rank once that request is served: the next request that uses it
    (len(requests) if none: later than any) and its depth, as next use * (longest prompt + 1) + depth,
    an int that orders as the pair does; in one flat array (8 bytes a block, not a list per block),
    with where each request's blocks start in it."""
    starts = array("q", [0])
    for request in requests:
        starts.append(starts[-1] + len(request.hash_ids))
    depths = 1 + max((len(request.hash_ids) for request in requests), default=0)
    never = len(requests)
    ranks = array("q", bytes(8 * starts[-1]))
    seen: dict = {}  # key -> the earliest request after this one that uses it
    for number in range(len(requests) - 1, -1, -1):
        ids, start = requests[number].hash_ids, starts[number]
        for depth in range(len(ids) - 1, -1, -1):  # a key twice in one prompt: its next use is this one
            key = ids[depth]
            ranks[start + depth] = seen.get(key, never) * depths + depth
            seen[key] = number
    return starts, ranks


def _current(farthest: list, present: set, rank: dict) -> list:
    """The heap's entries still in force, one per block. A stale entry never comes back into force (a
    block's next use only moves forward), and a block admitted again is pushed again, identically; so
    the choices made from the rebuilt heap are the ones the full heap would have made."""
    live = {key: entry for entry in farthest if (key := entry[1]) in present and -entry[0] == rank[key]}
    heap = list(live.values())
    heapq.heapify(heap)
    return heap


def reuse_statistics(requests: Sequence[Request]) -> dict:
    """Reuse distance (distinct blocks touched in between) and reuse time of every repeated block use."""
    return access_statistics([(key, request.timestamp_ms / 1000) for request in requests for key in request.hash_ids])


def access_statistics(accesses: Sequence[tuple[object, float]]) -> dict:
    """Reuse distance and reuse time over a sequence of (block, time in seconds) accesses."""
    tree = np.zeros(len(accesses) + 1, dtype=np.int64)  # Fenwick tree over access positions

    def add(position: int, value: int) -> None:
        position += 1
        while position < len(tree):
            tree[position] += value
            position += position & -position

    def prefix(position: int) -> int:
        total, position = 0, position + 1
        while position > 0:
            total += tree[position]
            position -= position & -position
        return int(total)

    last: dict = {}
    distances, times = [], []
    for position, (key, now) in enumerate(accesses):
        if key in last:
            previous, previous_time = last[key]
            distances.append(prefix(position - 1) - prefix(previous))
            times.append(now - previous_time)
            add(previous, -1)
        add(position, 1)
        last[key] = (position, now)

    def summary(values: Sequence[float]) -> dict:
        if not values:
            return {"count": 0}
        array = np.asarray(values, dtype=float)
        return {"count": len(values), **{f"p{q}": float(np.percentile(array, q)) for q in (10, 25, 50, 75, 90, 99)},
                "mean": float(array.mean())}

    return {"accesses": len(accesses), "unique_blocks": len(last), "reuses": len(distances),
            "reuse_distance_blocks": summary(distances), "reuse_time_s": summary(times)}
