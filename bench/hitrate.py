"""Hit rate of every policy against capacity, beside Belady's optimum and the infinite cache.

    python bench/hitrate.py [--trace traces/conversation_trace.jsonl] [--json out.json] [--plot out.png]

Two workloads, one command:
* the Mooncake conversation trace (one hour of production chat, 12,031 requests);
* a generated mix of agent and chat sessions (below), to see how the policies generalise.
Capacities are shares of each workload's unique full blocks. Writes `best_over_opt_10pct` (our best
online policy over Belady at 10%), `lru_over_opt_10pct`, and the whole table.

The generated workload (seeded, so every run sees the same requests), over one hour:
* 150 agent sessions: a 16-block tool-definition prefix shared by every agent, a 2-8 block task, then
  10-40 steps 5-60 s apart (exponential), each adding 1-3 blocks of tool output;
* 400 chat sessions: a 2-block system prompt shared by every chat, then 1-8 turns 30-600 s apart
  (exponential), each adding 1-3 blocks;
* arrivals uniform over the hour; every prompt ends in a partial block of 1-511 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.analytics.cli import plot  # noqa: E402
from kvstore.analytics.simulate import replay  # noqa: E402
from kvstore.analytics.trace import CONVERSATION_TRACE, read_trace  # noqa: E402
from kvstore.eviction import POLICIES  # noqa: E402

SHARES = (0.01, 0.02, 0.05, 0.10, 0.20, 0.50)


def agent_chat_mix(path: Path, seed: int = 7) -> None:
    rng = np.random.default_rng(seed)
    ids: dict[tuple, int] = {}

    def block(prefix: tuple) -> int:
        return ids.setdefault(prefix, len(ids))

    requests = []
    for kind, sessions, shared, first, steps, gap in (("agent", 150, 16, (2, 8), (10, 40), 20.0),
                                                      ("chat", 400, 2, (1, 3), (1, 8), 150.0)):
        for session in range(sessions):
            time_s = float(rng.uniform(0, 3600))
            path_key: tuple = (kind,)
            blocks = []
            for position in range(shared):  # shared by every session of the kind
                path_key += (position,)
                blocks.append(block(path_key))
            path_key += (session,)  # the session's own part starts here
            growth = int(rng.integers(*first, endpoint=True))
            for step in range(int(rng.integers(*steps, endpoint=True))):
                for _ in range(growth):
                    path_key += (len(blocks),)
                    blocks.append(block(path_key))
                partial = int(rng.integers(1, 512))
                tail = block(path_key + ("partial", step))
                requests.append({"timestamp": int(time_s * 1000), "input_length": len(blocks) * 512 + partial,
                                 "output_length": int(rng.integers(20, 400)), "hash_ids": blocks + [tail],
                                 "traffic_class": kind})
                time_s += float(rng.exponential(gap if kind == "chat" else gap / 4)) + (5 if kind == "agent" else 30)
                growth = int(rng.integers(1, 4))
    requests.sort(key=lambda r: r["timestamp"])
    with open(path, "w") as f:
        for request in requests:
            f.write(json.dumps(request) + "\n")


def table(name: str, trace: Path, plot_path: Path | None) -> dict:
    requests = list(read_trace(trace))
    unique = len({k for r in requests for k in r.hash_ids[: r.input_length // 512]})
    infinite = replay(requests, "infinite", None).token_hit_rate
    rows = []
    for share in SHARES:
        capacity = max(1, int(unique * share))
        row = {"capacity": f"{share:.0%}", "capacity_blocks": capacity}
        for policy in (*POLICIES, "belady"):
            row[policy] = replay(requests, policy, capacity).as_dict()
        rows.append(row)
        print(f"  {name}: {share:.0%} done", file=sys.stderr)
    print(f"\n{name}: {len(requests):,} requests, {unique:,} unique full blocks, infinite cache {infinite:.2%}")
    print(f"{'capacity':>9} " + " ".join(f"{p:>16}" for p in POLICIES) + f" {'belady':>8}")
    for row in rows:
        opt = row["belady"]["token_hit_rate"]
        print(f"{row['capacity']:>9} " + " ".join(
            f"{row[p]['token_hit_rate']:>7.2%} ({row[p]['token_hit_rate'] / opt:4.2f}x)" for p in POLICIES)
            + f" {opt:>8.2%}")
    if plot_path is not None:
        plot(rows, list(POLICIES), unique, infinite, plot_path, name)
    return {"requests": len(requests), "unique_full_blocks": unique, "infinite": infinite, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG for the conversation trace; the mix goes beside it")
    args = parser.parse_args()
    report = {"conversation": table("conversation trace", args.trace, args.plot)}
    with tempfile.TemporaryDirectory() as scratch:
        mix = Path(scratch) / "agent_chat_mix.jsonl"
        agent_chat_mix(mix)
        mix_plot = args.plot.with_name(args.plot.stem + "_agent_chat_mix.png") if args.plot else None
        report["agent_chat_mix"] = table("agent + chat mix", mix, mix_plot)
    ten = next(row for row in report["conversation"]["rows"] if row["capacity"] == "10%")
    opt = ten["belady"]["token_hit_rate"]
    best = max(POLICIES, key=lambda p: ten[p]["token_hit_rate"])
    report["best_policy_10pct"] = best
    report["best_over_opt_10pct"] = ten[best]["token_hit_rate"] / opt
    report["lru_over_opt_10pct"] = ten["lru"]["token_hit_rate"] / opt
    for workload in ("conversation", "agent_chat_mix"):  # our policy against LRU at every capacity
        report[f"prefix_reuse_at_least_lru_every_capacity_{workload}"] = all(
            row["prefix-reuse"]["token_hit_rate"] >= row["lru"]["token_hit_rate"] for row in report[workload]["rows"])
    print(f"\nbest_over_opt_10pct = {report['best_over_opt_10pct']:.2f} ({best})   "
          f"lru_over_opt_10pct = {report['lru_over_opt_10pct']:.2f}   prefix-reuse >= LRU at every capacity: "
          f"{report['prefix_reuse_at_least_lru_every_capacity_conversation']} (conversation), "
          f"{report['prefix_reuse_at_least_lru_every_capacity_agent_chat_mix']} (agent + chat mix)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
