"""How fast `kvstore analytics replay` goes, and in how much memory: every policy, Belady and the infinite cache.

    python bench/replay_speed.py [--requests 200000] [--capacity 5%,20%] [--repeats 3] [--policies ...]
                                 [--json out.json]
    python bench/replay_speed.py --requests 1000000 --repeats 1    # the million-request check

Generates a seeded trace in the Mooncake format (below; --requests of them), reads it with `read_trace`
as the CLI does, and replays it through each policy at each capacity (a share of its unique full blocks),
--repeats times; then the same on the shipped conversation trace (12,031 requests, long prompts that
mostly miss: the hardest per request). Prints, per policy and capacity, requests per second (median and
the spread, min-max, over the repeats), the ratio to LRU's median in the same run, whether it meets
20,000 requests/s, and the peak memory of its replays above the loaded trace (each policy's replays run
in a forked child: its peak RSS less the RSS it started with). Writes nothing unless --json PATH.
The default run (200,000 requests, 3 repeats) takes about 7 minutes on two busy cores; a million
requests with one repeat about 15 (PrefixReuse, at about 5,000 requests/s, is most of it).

The generated workload, seeded, sessions interleaved in time:
* 40% agent sessions: one of 20 tool-definition prefixes of 8-24 blocks (Zipf-chosen, so a few are
  hot), a task of 1-6 blocks, then 5-40 steps 2-30 s apart, each adding 1-3 blocks of tool output;
* 60% chat sessions: one of 50 system prompts of 1-4 blocks, then 1-12 turns 20-300 s apart, each
  adding 1-4 blocks;
* a context that reaches 60 full blocks is compacted to its shared prefix and a 2-block summary;
* every prompt ends in a partial block of 1-511 tokens with a hash id of its own, as in Mooncake's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.analytics.simulate import replay  # noqa: E402
from kvstore.analytics.trace import CONVERSATION_TRACE, read_trace  # noqa: E402
from kvstore.eviction import POLICIES  # noqa: E402

TARGET = 20_000  # requests per second every policy should replay at
MAX_BLOCKS = 64


def generate(path: Path, requests: int, seed: int = 11) -> None:
    """Write `requests` requests of the workload above to `path`."""
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(count: int) -> list[int]:
        nonlocal next_id
        next_id += count
        return list(range(next_id - count, next_id))

    tools = [fresh(int(rng.integers(8, 25))) for _ in range(20)]
    systems = [fresh(int(rng.integers(1, 5))) for _ in range(50)]
    zipf = 1 / np.arange(1, 51)
    # the sessions: kind, prefix and number of steps, then the times of their steps
    sessions, steps_left = [], 0
    while steps_left < requests:
        agent = rng.random() < 0.4
        steps = int(rng.integers(5, 41)) if agent else int(rng.integers(1, 13))
        sessions.append((agent, steps))
        steps_left += steps
    span_s = requests / 50  # about 50 requests a second, whatever the scale
    times, owners = [], []
    for number, (agent, steps) in enumerate(sessions):
        start = rng.uniform(0, span_s)
        gaps = rng.uniform(2, 30, steps) if agent else rng.uniform(20, 300, steps)
        gaps[0] = 0
        times.append(start + np.cumsum(gaps))
        owners.append(np.full(steps, number))
    times, owners = np.concatenate(times), np.concatenate(owners)
    order = np.argsort(times, kind="stable")[:requests]
    prompts: dict[int, tuple[int, list[int]]] = {}  # the sessions under way: shared prefix length, prompt so far
    remaining = [steps for _, steps in sessions]
    with open(path, "w") as f:
        for index in order:
            number, time_ms = int(owners[index]), int(times[index] * 1000)
            agent = sessions[number][0]
            if number not in prompts:
                if agent:
                    shared = tools[int(rng.choice(20, p=zipf[:20] / zipf[:20].sum()))]
                    prompts[number] = (len(shared), shared + fresh(int(rng.integers(1, 7))))
                else:
                    shared = systems[int(rng.choice(50, p=zipf / zipf.sum()))]
                    prompts[number] = (len(shared), shared[:])
            base, prompt = prompts[number]
            if len(prompt) >= MAX_BLOCKS - 4:  # the context is full: compacted to its prefix and a summary
                prompt = prompt[:base] + fresh(2)
            prompt = prompt + fresh(int(rng.integers(1, 4 if agent else 5)))
            remaining[number] -= 1
            if remaining[number]:
                prompts[number] = (base, prompt)
            else:
                del prompts[number]
            partial = int(rng.integers(1, 512))
            f.write(json.dumps({"timestamp": time_ms, "input_length": len(prompt) * 512 + partial,
                                "output_length": int(rng.integers(20, 400)), "hash_ids": prompt + fresh(1),
                                "traffic_class": "agent" if agent else "chat"}) + "\n")


def rss_mib() -> float:
    """This process's resident memory now, from /proc (ru_maxrss is a peak, not the present)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def in_child(work):
    """Run `work()` in a forked child (which shares the loaded trace); its JSON result and peak RSS growth."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send the result, leave without cleaning up the parent's state
        os.close(read)
        try:
            before = rss_mib()  # the trace's pages, shared with the parent, count here too
            result = work()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before  # KiB on Linux
            payload = json.dumps({"result": result, "peak": peak}).encode()
        except BaseException as exc:  # noqa: BLE001 - reported by the parent
            payload = json.dumps({"error": repr(exc)}).encode()
        with os.fdopen(write, "wb") as pipe:
            pipe.write(payload)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = json.loads(pipe.read() or b'{"error": "the child died"}')
    os.waitpid(pid, 0)
    if "error" in message:
        raise RuntimeError(f"replay failed: {message['error']}")
    return message["result"], message["peak"]


def measure(name: str, requests: list, shares: list[float], repeats: int, policies: list[str]) -> list[dict]:
    unique = len({k for r in requests for k in r.hash_ids[: r.input_length // 512]})
    print(f"\n{name}: {len(requests):,} requests, {unique:,} unique full blocks", flush=True)
    rows = []
    for policy in policies:
        for share in (shares if policy != "infinite" else [None]):
            capacity = None if share is None else max(1, int(unique * share))

            def work(policy=policy, capacity=capacity) -> dict:
                speeds = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    result = replay(requests, policy, capacity)
                    speeds.append(len(requests) / (time.perf_counter() - started))
                return {"speeds": speeds, "token_hit_rate": result.token_hit_rate}

            measured, peak = in_child(work)
            speeds = measured["speeds"]
            rows.append({"policy": policy, "capacity": "all" if share is None else f"{share:.0%}",
                         "capacity_blocks": capacity, "requests_per_s": statistics.median(speeds),
                         "min": min(speeds), "max": max(speeds), "peak_mib_above_trace": max(0.0, peak),
                         "token_hit_rate": measured["token_hit_rate"]})
            print(f"  {policy:>12} at {rows[-1]['capacity']:>4}: {rows[-1]['requests_per_s']:>9,.0f} req/s", flush=True)
    for row in rows:
        lru = next((r for r in rows if r["policy"] == "lru" and r["capacity"] == row["capacity"]), None)
        row["ratio_to_lru"] = row["requests_per_s"] / lru["requests_per_s"] if lru else None
        row["meets_target"] = row["requests_per_s"] >= TARGET
    print(f"{'policy':>12} {'capacity':>8} {'req/s':>9} {'spread':>17} {'x LRU':>6} {'>=20k':>6} "
          f"{'peak MiB':>9} {'hit rate':>8}")
    for row in rows:
        ratio = f"{row['ratio_to_lru']:.2f}" if row["ratio_to_lru"] is not None else "-"
        print(f"{row['policy']:>12} {row['capacity']:>8} {row['requests_per_s']:>9,.0f} "
              f"{row['min']:>8,.0f}-{row['max']:<8,.0f} {ratio:>6} {'yes' if row['meets_target'] else 'NO':>6} "
              f"{row['peak_mib_above_trace']:>9,.0f} {row['token_hit_rate']:>8.2%}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200_000, help="requests in the generated trace")
    parser.add_argument("--capacity", default="5%,20%", help="shares of the unique full blocks")
    parser.add_argument("--repeats", type=int, default=3, help="replays per policy and capacity")
    parser.add_argument("--policies", default=",".join((*POLICIES, "belady", "infinite")), help="comma-separated")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    shares = [float(item.strip().rstrip("%")) / 100 for item in args.capacity.split(",") if item.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    report: dict = {"repeats": args.repeats, "target_requests_per_s": TARGET}
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "generated.jsonl"
        started = time.perf_counter()
        generate(path, args.requests)
        generated_s = time.perf_counter() - started
        size = path.stat().st_size
        before = rss_mib()
        started = time.perf_counter()
        requests = list(read_trace(path))
        read_s = time.perf_counter() - started
        loaded = rss_mib() - before
    print(f"generated {args.requests:,} requests ({size / 2**20:,.0f} MiB of JSON) in {generated_s:.0f} s; read in "
          f"{read_s:.1f} s ({len(requests) / read_s:,.0f} lines/s), {loaded:,.0f} MiB resident for the requests "
          f"({sum(len(r.hash_ids) for r in requests) / len(requests):.1f} blocks each)")
    rows = measure("generated trace", requests, shares, args.repeats, policies)
    report["generated"] = {"requests": len(requests), "json_mib": size / 2**20, "read_s": read_s,
                           "trace_mib": loaded, "rows": rows}
    del requests
    conversation = list(read_trace(CONVERSATION_TRACE))
    report["conversation"] = {"rows": measure("conversation trace", conversation, shares, args.repeats, policies)}
    slowest = min((row for part in ("generated", "conversation") for row in report[part]["rows"]),
                  key=lambda row: row["requests_per_s"])
    report["every_policy_meets_target_generated"] = all(row["meets_target"] for row in report["generated"]["rows"])
    met = report["every_policy_meets_target_generated"]
    print(f"\nevery policy >= {TARGET:,} req/s on the generated trace: {met}; "
          f"slowest anywhere: {slowest['policy']} at {slowest['capacity']}, {slowest['requests_per_s']:,.0f} req/s; "
          f"peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
