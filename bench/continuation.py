"""How much a policy could gain by knowing which conversations go on, and how well that can be guessed.

    python bench/continuation.py [TRACE] [--json out.json]

On a Mooncake-format trace, at 1-50% of its unique full blocks:

* `lru`: plain LRU (leaf-first, as the store serves), over Belady at the same capacity;
* `oracle_block`: LRU that admits only blocks that will be used again (knows the future per block);
* `oracle_request`: LRU that admits a request's new blocks only if that request is continued later
  (its last full block is used again): the bound for any policy that predicts continuation per request.

And how well continuation can be predicted online from what a prefix cache knows at put time:
P(continued) by the request's hit fraction (how much of its own prompt was cached) and by its length.
These are the figures behind the analytics issue's note on why no online policy here reaches 0.9 x
Belady at 10%: the gap to Belady is almost all in knowing which conversations continue.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.analytics.simulate import replay  # noqa: E402
from kvstore.analytics.trace import Request, read_trace  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "conversation_trace.jsonl"
FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20, 0.50)
Admit = Callable[[int, Request, object], bool]


def lru_with_admission(requests: list[Request], capacity: int, admit: Admit) -> float:
    """Token hit rate of leaf-first LRU that stores a missing block only if `admit(number, request, key)`."""
    cache: OrderedDict = OrderedDict()
    hit_tokens = tokens = 0
    for number, request in enumerate(requests):
        ids, full = request.hash_ids, request.input_length // 512
        hit = 0
        while hit < len(ids) and ids[hit] in cache:
            hit += 1
        tokens += request.input_length
        hit_tokens += sum(request.block_tokens(i, 512) for i in range(hit))
        for key in reversed(ids[:hit]):
            cache.move_to_end(key)
        for position in range(full - 1, hit - 1, -1):
            key = ids[position]
            if key in cache:
                cache.move_to_end(key)
            elif admit(number, request, key):
                while len(cache) >= capacity:
                    cache.popitem(last=False)
                cache[key] = True
    return hit_tokens / tokens


def continuation_table(requests: list[Request], last_use: dict) -> dict:
    """P(a request is continued later) by its hit fraction and by its length in full blocks."""
    seen: set = set()
    by_fraction: dict[str, list[int]] = {}
    by_length: dict[str, list[int]] = {}
    fraction_edges, length_edges = (0, 0.01, 0.5, 0.9, 1.01), (0, 4, 16, 64, 10**9)
    for number, request in enumerate(requests):
        full = request.input_length // 512
        if not full:
            continue
        hit = 0
        while hit < full and request.hash_ids[hit] in seen:
            hit += 1
        continued = last_use[request.hash_ids[full - 1]] > number
        for table, value, edges in ((by_fraction, hit / full, fraction_edges), (by_length, full, length_edges)):
            low = max(e for e in edges[:-1] if value >= e)
            high = edges[edges.index(low) + 1]
            counts = table.setdefault(f"[{low:g}, {high:g})", [0, 0])
            counts[0] += continued
            counts[1] += 1
        seen.update(request.hash_ids[:full])
    def low_edge(item) -> float:
        return float(item[0][1:].split(",")[0])

    return {name: {bucket: {"p_continued": c / n, "requests": n}
                   for bucket, (c, n) in sorted(table.items(), key=low_edge)}
            for name, table in (("hit_fraction", by_fraction), ("full_blocks", by_length))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", type=Path, default=TRACE)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    requests = list(read_trace(args.trace))
    last_use: dict = {}
    for number, request in enumerate(requests):
        for key in request.hash_ids:
            last_use[key] = number
    unique = len({k for r in requests for k in r.hash_ids[: r.input_length // 512]})
    variants: dict[str, Admit] = {
        "lru": lambda number, request, key: True,
        "oracle_block": lambda number, request, key: last_use[key] > number,
        "oracle_request": lambda number, request, key: last_use[request.hash_ids[request.input_length // 512 - 1]]
        > number,
    }
    figures: dict = {"trace": str(args.trace), "unique_blocks": unique, "capacities": {}}
    print(f"{args.trace.name}: {len(requests):,} requests, {unique:,} unique full blocks")
    print(f"{'capacity':>8} {'belady':>7} " + " ".join(f"{name:>15}" for name in variants))
    for fraction in FRACTIONS:
        capacity = max(1, int(unique * fraction))
        optimum = replay(requests, "belady", capacity).token_hit_rate
        row = {name: lru_with_admission(requests, capacity, admit) / optimum for name, admit in variants.items()}
        figures["capacities"][f"{fraction:.0%}"] = {"belady_token_hit_rate": optimum,
                                                   **{f"{k}_over_opt": v for k, v in row.items()}}
        print(f"{fraction:>8.0%} {optimum:>7.1%} " + " ".join(f"{v:>14.2f}x" for v in row.values()), flush=True)
    figures["continuation"] = continuation_table(requests, last_use)
    for name, table in figures["continuation"].items():
        print(f"\nP(continued) by {name}: " + ", ".join(
            f"{bucket} {row['p_continued']:.2f} (n={row['requests']:,})" for bucket, row in table.items()))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
