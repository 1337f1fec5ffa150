"""How much a policy could gain by knowing which conversations go on, and how well that can be guessed.

    python bench/continuation.py [TRACE] [--json out.json]

On a Mooncake-format trace, at 1-50% of its unique full blocks, each over Belady at the same capacity:

* `lru`: plain LRU (leaf-first, as the store serves);
* `oracle_block`: LRU that admits only blocks that will be used again (knows the future per block);
* `oracle_request`: LRU that admits a request's new blocks only if that request is continued later
  (its last full block is used again);
* `prefix_reuse`: our policy, classing blocks by the hint engines send (cached fraction, length, turn);
* `hindsight_classes`: the same policy, classing each request's blocks by P(continued) given *every*
  feature of the request the trace has: cached fraction, length, turn, time since the conversation's
  previous turn, and output length. The probability of each combination of their buckets is counted
  over the whole trace, in hindsight: no predictor on these buckets, learned online, can class better;
* `oracle_classes`: the same policy told, per request, whether it is continued.
* `advised_100/95/90/80`: the same policy as the daemon runs it, with engines that advise the store once
  each reply is done whether its conversation goes on (`client.advise`), right 100/95/90/80% of the time
  (simulated: the trace does not record it).

`hindsight_classes` against `oracle_classes` says whether the policy or the information is missing;
the advised columns, how good a signal from the engines must be to close the gap. Also P(continued) by
single features, and the AUC of the hindsight predictor.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.analytics.simulate import replay  # noqa: E402
from kvstore.analytics.trace import CONVERSATION_TRACE, Request, continued_requests, conversation_turns, read_trace  # noqa: E402
from kvstore.eviction import LRU, EvictionPolicy, PrefixReuse, ReuseHint  # noqa: E402

TRACE = CONVERSATION_TRACE
FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20, 0.50)
BLOCK_TOKENS = 512
Admit = Callable[[int, object], bool]  # (request number, block key) -> store it?
# Bucket edges of each feature; the buckets of all five together class a request.
EDGES = {"hit_fraction": (0.01, 0.5, 0.9), "full_blocks": (2, 4, 8, 16, 32, 64), "turn": (1, 2, 4, 8),
         "output_tokens": (10, 50, 200, 400, 800), "gap_s": (0, 10, 60, 300)}


@dataclass
class Features:
    hit_fraction: float  # of its full blocks, the leading share seen before
    full_blocks: int
    turn: int  # earlier turns of its conversation: requests whose last full block lies in its prefix
    output_tokens: int
    gap_s: float  # since the conversation's previous turn; -1 for a first turn

    def bucket(self) -> tuple[int, ...]:
        return tuple(bisect.bisect_right(edges, getattr(self, name)) for name, edges in EDGES.items())


class ClassGiven(PrefixReuse):
    """PrefixReuse classing blocks by a class the benchmark sets per request, instead of the hint's."""

    current = 0

    def classify(self, hint: ReuseHint | None) -> int:
        return self.current


def replay_policy(requests: Sequence[Request], capacity: int, policy: EvictionPolicy,
                  admit: Admit | None = None, classes: Sequence[int] | None = None) -> float:
    """Token hit rate of `policy` serving the trace as the store does (leaf first; reads, then puts)."""
    turns = conversation_turns(requests, BLOCK_TOKENS)
    hit_tokens = tokens = 0
    for number, request in enumerate(requests):
        ids, full = request.hash_ids, request.input_length // BLOCK_TOKENS
        hit = 0
        while hit < len(ids) and ids[hit] in policy:
            hit += 1
        tokens += request.input_length
        hit_tokens += sum(request.block_tokens(i, BLOCK_TOKENS) for i in range(hit))
        if classes is not None:
            policy.current = classes[number]
        for key in reversed(ids[:hit]):
            policy.access(key)
        for position in range(full - 1, hit - 1, -1):
            key = ids[position]
            if key in policy:
                policy.access(key)
            elif admit is None or admit(number, key):
                while len(policy) >= capacity:
                    policy.pop_victim()
                policy.insert(key, 1, ids[position - 1] if position else None,
                              ReuseHint(min(hit, full), full, turns[number]))
    return hit_tokens / tokens


def request_features(requests: Sequence[Request]) -> list[Features]:
    """What is known of each request when it arrives (the gap as a store watching its prefix tree knows it)."""
    seen: set = set()
    ended: dict = {}  # last full block of an earlier request -> when it came, in s
    features = []
    for request, turn in zip(requests, conversation_turns(requests, BLOCK_TOKENS)):
        full = request.input_length // BLOCK_TOKENS
        ids = request.hash_ids[:full]
        hit = 0
        while hit < full and ids[hit] in seen:
            hit += 1
        previous = None
        for key in ids[1:]:  # as conversation_turns: the deepest earlier prompt this one holds
            previous = ended.get(key, previous)
        now = request.timestamp_ms / 1000
        features.append(Features(hit / full if full else 0.0, full, turn, request.output_length,
                                 now - previous if previous is not None else -1.0))
        seen.update(ids)
        if full > 1:
            ended[ids[-1]] = now
    return features


def hindsight_classes(features: Sequence[Features], continued: Sequence[bool]) -> tuple[list[int], float]:
    """Per request, P(continued | its feature buckets) counted over the whole trace, in twentieths; and
    the AUC of that probability as a predictor of continuation."""
    counts: dict = defaultdict(lambda: [0, 0])
    for feature, goes_on in zip(features, continued):
        counts[feature.bucket()][0] += goes_on
        counts[feature.bucket()][1] += 1
    probability = np.array([counts[f.bucket()][0] / counts[f.bucket()][1] for f in features])
    outcome = np.asarray(continued)
    ranks = probability.argsort().argsort() + 1.0
    for value in np.unique(probability):  # ties share their mean rank
        ranks[probability == value] = ranks[probability == value].mean()
    positives = outcome.sum()
    auc = (ranks[outcome].sum() - positives * (positives + 1) / 2) / (positives * (len(outcome) - positives))
    return [int(p * 20) for p in probability], float(auc)


def continuation_table(features: Sequence[Features], continued: Sequence[bool]) -> dict:
    """P(a request is continued later) by each feature alone."""
    table = {}
    for name, edges in EDGES.items():
        buckets: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for feature, goes_on in zip(features, continued):
            if feature.full_blocks:
                bucket = bisect.bisect_right(edges, getattr(feature, name))
                buckets[bucket][0] += goes_on
                buckets[bucket][1] += 1
        bounds = ("-inf",) + tuple(f"{e:g}" for e in edges) + ("inf",)
        table[name] = {f"[{bounds[b]}, {bounds[b + 1]})": {"p_continued": c / n, "requests": n}
                       for b, (c, n) in sorted(buckets.items())}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", type=Path, default=TRACE)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    requests = list(read_trace(args.trace))
    continued = continued_requests(requests)
    features = request_features(requests)
    classes, auc = hindsight_classes(features, continued)
    last_use: dict = {}
    for number, request in enumerate(requests):
        for key in request.hash_ids:
            last_use[key] = number
    unique = len({k for r in requests for k in r.hash_ids[: r.input_length // BLOCK_TOKENS]})
    variants: dict[str, Callable[[int], float]] = {
        "lru": lambda capacity: replay_policy(requests, capacity, LRU()),
        "oracle_block": lambda capacity: replay_policy(requests, capacity, LRU(),
                                                       admit=lambda number, key: last_use[key] > number),
        "oracle_request": lambda capacity: replay_policy(requests, capacity, LRU(),
                                                         admit=lambda number, key: continued[number]),
        "prefix_reuse": lambda capacity: replay(requests, "prefix-reuse", capacity).token_hit_rate,
        "hindsight_classes": lambda capacity: replay_policy(requests, capacity, ClassGiven(), classes=classes),
        "oracle_classes": lambda capacity: replay_policy(requests, capacity, ClassGiven(),
                                                         classes=[int(c) for c in continued]),
        **{f"advised_{right:.0%}"[:-1]: lambda capacity, right=right: replay(
            requests, "prefix-reuse", capacity, continuation_signal=right).token_hit_rate
           for right in (1.0, 0.95, 0.9, 0.8)},
    }
    figures: dict = {"trace": str(args.trace), "unique_blocks": unique, "hindsight_auc": auc, "capacities": {}}
    print(f"{args.trace.name}: {len(requests):,} requests, {unique:,} unique full blocks")
    print(f"{'capacity':>8} {'belady':>7} " + " ".join(f"{name:>17}" for name in variants))
    for fraction in FRACTIONS:
        capacity = max(1, int(unique * fraction))
        optimum = replay(requests, "belady", capacity).token_hit_rate
        row = {name: run(capacity) / optimum for name, run in variants.items()}
        figures["capacities"][f"{fraction:.0%}"] = {"belady_token_hit_rate": optimum,
                                                   **{f"{k}_over_opt": v for k, v in row.items()}}
        print(f"{fraction:>8.0%} {optimum:>7.1%} " + " ".join(f"{v:>16.2f}x" for v in row.values()), flush=True)
    figures["continuation"] = continuation_table(features, continued)
    for name, table in figures["continuation"].items():
        print(f"\nP(continued) by {name}: " + ", ".join(
            f"{bucket} {row['p_continued']:.2f} (n={row['requests']:,})" for bucket, row in table.items()))
    print(f"\nAUC of P(continued | all five features), fitted in hindsight: {auc:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
