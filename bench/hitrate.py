"""Hit rate of every policy against capacity on the real trace and a family of generated workloads.

    python bench/hitrate.py [--trace traces/conversation_trace.jsonl] [--json out.json] [--plot out.png]
                            [--jobs 2] [--scale 1.0]

Workloads, one command:
* the Mooncake conversation trace (one hour of production chat, 12,031 requests);
* the generated family of `kvstore/analytics/workloads.py` (chat, agent, rag, trees, mix; seeded, with
  lengths and gaps drawn from the conversation trace), to see how the policies generalise.
Capacities are shares of each workload's unique full blocks. For each workload it prints the table
(token-weighted hit rate and its ratio to Belady), then the worst case of each policy against LRU per
workload and over all (in points of hit rate: the aim is adaptive >= LRU - 0.1 everywhere), the replay
speed of each policy (requests/s in `simulate.replay`; noisy on a shared machine), and what the
engines' hints and advice add to PrefixReuse and adaptive at 1% and 10%: without hints (every block in
one class), with the hints the replay sends (cached fraction, length, turn), and with advice right 95%
of the time (`continuation_signal`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvstore.analytics.simulate as simulate  # noqa: E402
from kvstore.analytics.cli import plot  # noqa: E402
from kvstore.analytics.simulate import replay  # noqa: E402
from kvstore.analytics.trace import CONVERSATION_TRACE, read_trace  # noqa: E402
from kvstore.analytics.workloads import KINDS, generate  # noqa: E402
from kvstore.eviction import POLICIES, EvictionPolicy, ReuseHint, make_policy  # noqa: E402

SHARES = (0.01, 0.02, 0.05, 0.10, 0.25, 0.50)
HINT_SHARES = (0.01, 0.10)
HINTED = ("prefix-reuse", "adaptive")
SEED = 1
_requests: dict = {}


def workload(name: str, trace: Path, scale: float) -> list:
    """Requests of a workload, once per process."""
    if name not in _requests:
        _requests[name] = list(read_trace(trace)) if name == "conversation" else generate(name, SEED, scale)
    return _requests[name]


class _NoHints(EvictionPolicy):
    """A policy told nothing of the requests: what the hints add is the difference."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner

    def insert(self, key, size: int, parent=None, hint: ReuseHint | None = None) -> None:
        self.inner.insert(key, size, parent, None)

    def access(self, key) -> None:
        self.inner.access(key)

    def remove(self, key) -> None:
        self.inner.remove(key)

    def pop_victim(self):
        return self.inner.pop_victim()

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    @property
    def tracked_bytes(self) -> int:
        return self.inner.tracked_bytes


@contextmanager
def _without_hints():
    """`replay` makes its policy by name and sends the hints itself, so the policy it makes is wrapped."""
    simulate.make_policy = lambda name, capacity: _NoHints(make_policy(name, capacity))
    try:
        yield
    finally:
        simulate.make_policy = make_policy


def _cell(task: tuple) -> tuple:
    """One replay: (workload, share, policy, variant) -> its result and speed."""
    name, trace, scale, share, policy, variant = task
    requests = workload(name, trace, scale)
    unique = len({k for r in requests for k in r.hash_ids[: r.input_length // 512]})
    capacity = max(1, int(unique * share))
    started = time.perf_counter()
    if variant == "no-hints":
        with _without_hints():
            result = replay(requests, policy, capacity)
    else:
        result = replay(requests, policy, capacity, continuation_signal=0.95 if variant == "advice" else None)
    return task, result.as_dict(), len(requests) / (time.perf_counter() - started), unique


def table(name: str, cells: dict, infinite: float, unique: int, requests: int, plot_path: Path | None) -> dict:
    rows = []
    for share in SHARES:
        row = {"capacity": f"{share:.0%}", "capacity_blocks": max(1, int(unique * share))}
        for policy in (*POLICIES, "belady"):
            row[policy] = cells[name, share, policy, "hints"][0]
        rows.append(row)
    print(f"\n{name}: {requests:,} requests, {unique:,} unique full blocks, infinite cache {infinite:.2%}")
    print(f"{'capacity':>9} " + " ".join(f"{p:>16}" for p in POLICIES) + f" {'belady':>8}")
    for row in rows:
        opt = row["belady"]["token_hit_rate"]
        print(f"{row['capacity']:>9} " + " ".join(
            f"{row[p]['token_hit_rate']:>7.2%} ({row[p]['token_hit_rate'] / opt:4.2f}x)" for p in POLICIES)
            + f" {opt:>8.2%}")
    if plot_path is not None:
        plot(rows, list(POLICIES), unique, infinite, plot_path, name)
    worst = {p: min(100 * (row[p]["token_hit_rate"] - row["lru"]["token_hit_rate"]) for row in rows)
             for p in POLICIES}
    return {"requests": requests, "unique_full_blocks": unique, "infinite": infinite, "rows": rows,
            "worst_vs_lru_points": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG for the conversation trace; the others go beside it")
    parser.add_argument("--jobs", type=int, default=2, help="replays run at once")
    parser.add_argument("--scale", type=float, default=1.0, help="sessions of the generated workloads, x")
    args = parser.parse_args()
    names = ("conversation", *KINDS)
    tasks = [(name, args.trace, args.scale, share, policy, "hints")
             for name in names for share in SHARES for policy in (*POLICIES, "belady")]
    tasks += [(name, args.trace, args.scale, share, policy, variant) for name in names for share in HINT_SHARES
              for policy in HINTED for variant in ("no-hints", "advice")]
    tasks += [(name, args.trace, args.scale, 1.0, "infinite", "hints") for name in names]
    tasks.sort(key=lambda t: t[4] not in ("adaptive", "prefix-reuse"))  # the slow ones first
    cells: dict = {}
    uniques: dict = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for done, (task, result, speed, unique) in enumerate(pool.map(_cell, tasks, chunksize=1), start=1):
            name, _, _, share, policy, variant = task
            cells[name, share, policy, variant] = (result, speed)
            uniques[name] = unique
            if done % 20 == 0:
                print(f"  {done}/{len(tasks)} replays done", file=sys.stderr)
    report: dict = {}
    for name in names:
        plot_path = None
        if args.plot:
            plot_path = args.plot if name == "conversation" else args.plot.with_name(f"{args.plot.stem}_{name}.png")
        infinite = cells[name, 1.0, "infinite", "hints"][0]
        report[name] = table(name, {k[:4]: v for k, v in cells.items()}, infinite["token_hit_rate"], uniques[name],
                             infinite["requests"], plot_path)
    print("\nworst case against LRU, points of token hit rate (lowest over 1, 2, 5, 10, 25, 50% capacity)")
    print(f"{'workload':>13} " + " ".join(f"{p:>12}" for p in POLICIES))
    for name in names:
        print(f"{name:>13} " + " ".join(f"{report[name]['worst_vs_lru_points'][p]:>+12.2f}" for p in POLICIES))
    overall = {p: min(report[name]["worst_vs_lru_points"][p] for name in names) for p in POLICIES}
    print(f"{'over all':>13} " + " ".join(f"{overall[p]:>+12.2f}" for p in POLICIES))
    report["worst_vs_lru_points"] = overall
    report["adaptive_at_least_lru_everywhere"] = overall["adaptive"] >= -0.1
    speeds = {p: min(cells["conversation", share, p, "hints"][1] for share in SHARES) for p in (*POLICIES, "belady")}
    report["conversation_requests_per_s_slowest_capacity"] = speeds
    print("\nreplay speed on the conversation trace, requests/s at the slowest capacity: "
          + ", ".join(f"{p} {s:,.0f}" for p, s in speeds.items()))
    print("\nwhat the engines' hints and advice add, token hit rate: no hints / hints / hints + advice (95% right)")
    hints: dict = {}
    for name in names:
        for share in HINT_SHARES:
            parts = []
            for policy in HINTED:
                rates = [cells[name, share, policy, v][0]["token_hit_rate"] for v in ("no-hints", "hints", "advice")]
                hints[f"{name} {share:.0%} {policy}"] = rates
                parts.append(f"{policy} " + " / ".join(f"{r:.2%}" for r in rates))
            print(f"{name:>13} {share:>4.0%}  " + "   ".join(parts))
    report["hints_advice"] = hints
    ten = next(row for row in report["conversation"]["rows"] if row["capacity"] == "10%")
    opt = ten["belady"]["token_hit_rate"]
    best = max(POLICIES, key=lambda p: ten[p]["token_hit_rate"])
    report["best_policy_10pct"] = best
    report["best_over_opt_10pct"] = ten[best]["token_hit_rate"] / opt
    report["lru_over_opt_10pct"] = ten["lru"]["token_hit_rate"] / opt
    print(f"\nbest_over_opt_10pct = {report['best_over_opt_10pct']:.2f} ({best})   "
          f"lru_over_opt_10pct = {report['lru_over_opt_10pct']:.2f}   adaptive >= LRU - 0.1 pt everywhere: "
          f"{report['adaptive_at_least_lru_everywhere']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
