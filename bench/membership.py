"""How many keys change owner when a daemon joins or leaves, beside the minimum any placement must move.

    python bench/membership.py [--keys 1000000] [--repeats 5] [--json out.json]

The client places each block key on the daemon with the highest rendezvous score
(kvstore/client/placement.py). For N = 3 -> 4 -> 3 daemons it counts, over `keys` seeded random 16-byte
keys, the fraction whose owner changes. The least any placement can move is the joining (or leaving)
daemon's fair share, 1/4 here, and only keys that go to it (or come from it) should move at all.
Reported per step: the fraction moved, its ratio to that minimum, the share of moves that touched the
changing daemon (1.0: none of the others traded keys), and max/mean keys per daemon. Each repeat
uses another set of daemon addresses; figures are medians with [min, max].
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.client.placement import place  # noqa: E402


def owners(keys: list[bytes], members: list[str]) -> list[str]:
    return [place(key, members) for key in keys]


def step(keys: list[bytes], before: list[str], after: list[str], old: list[str], new: list[str]) -> dict:
    """The figures of one membership change from `old` to `new` (one member more or fewer)."""
    changing = (set(old) ^ set(new)).pop()
    moved = [(a, b) for a, b in zip(before, after) if a != b]
    fraction = len(moved) / len(keys)
    minimum = 1 / max(len(old), len(new))
    counts = Counter(after)
    return {"moved_fraction": fraction, "moved_over_minimum": fraction / minimum,
            "moves_touching_the_changing_daemon": sum(changing in pair for pair in moved) / max(len(moved), 1),
            "max_over_mean_keys": max(counts.values()) / (len(keys) / len(new))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.keys < 1 or args.repeats < 1:
        parser.error("--keys and --repeats must be positive")
    rng = random.Random(0)
    keys = [rng.randbytes(16) for _ in range(args.keys)]
    samples: dict[str, list[dict]] = {"3 -> 4": [], "4 -> 3": []}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        three = [f"10.{repeat}.0.{i}:50051" for i in range(1, 4)]
        four = [*three, f"10.{repeat}.0.4:50051"]
        print(f"repeat {repeat + 1}/{args.repeats}: placing {args.keys:,} keys on 3, then 4 daemons",
              file=sys.stderr)
        on_three, on_four = owners(keys, three), owners(keys, four)
        samples["3 -> 4"].append(step(keys, on_three, on_four, three, four))
        samples["4 -> 3"].append(step(keys, on_four, owners(keys, three), four, three))
    report: dict = {"keys": args.keys, "repeats": args.repeats, "seconds": time.perf_counter() - started}
    print(f"\n{args.keys:,} keys, {args.repeats} sets of daemon addresses; medians [min - max]")
    print(f"{'change':>8} {'moved':>22} {'moved / minimum':>22} {'moves at the changer':>22} {'max/mean keys':>22}")
    for change, runs in samples.items():
        row = {}
        for name in runs[0]:
            values = [run[name] for run in runs]
            row[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        report[change] = row
        cells = [f"{row[n]['median']:.4f} [{row[n]['min']:.4f}-{row[n]['max']:.4f}]" for n in row]
        print(f"{change:>8} " + " ".join(f"{c:>22}" for c in cells))
    for change in samples:
        key = "moved_over_minimum_" + change.replace(" -> ", "_to_")
        report[key] = report[change]["moved_over_minimum"]["median"]
        print(f"{key} = {report[key]:.3f}  (aim: within 10% of 1.0)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
