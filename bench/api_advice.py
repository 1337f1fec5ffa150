"""The store's hit rate with advice from the API layer (engine/api/advice.py), through real daemons.

    python bench/api_advice.py [TRACE] [--json out.json] [--requests N] [--capacity-fraction 0.1]
                               [--repeats R] [--idle-limit S]

A Mooncake-format trace is served through fresh `kvstore-server` daemons (prefix-reuse eviction, room for
a fraction of the trace's unique full blocks, watermarks 0.99/0.97) as kvstore/analytics/drive.py serves
it (Lookup, Get of the hit, Put of the rest with the request's hint), advised by:

* `none`: nobody;
* `api_idle`: the API layer's `Advisor`, in trace time: `sweep(t)` before each request, `replied(its full
  blocks, its class, t)` after it. The trace records no tool calls, so the only advice this layer can
  give on it is "ended" for conversations idle past the limit;
* `simulated_100` / `simulated_90`: engines that know from the future whether each conversation goes on,
  right 100% / 90% of the time (`continuation_signal`, as bench/continuation.py's advised columns).

Beside them, from the simulator on the same requests: Belady's optimum at the same capacity (the limit
every figure is a ratio to), and prefix-reuse without advice, with the Advisor's, and with the signal.
The idle limit is chosen from the trace: the gaps between consecutive turns of its conversations, and a
simulator sweep of the limit (what it gains, and how many conversations it wrongly calls ended).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.api.advice import Advisor  # noqa: E402
from kvstore.analytics.cli import progress as progress_line  # noqa: E402
from kvstore.analytics.simulate import continuation_signals, replay  # noqa: E402
from kvstore.analytics.trace import CONVERSATION_TRACE, Request, conversation_turns, read_trace  # noqa: E402
from kvstore.block import Block, KVLayout, Namespace  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.eviction import PrefixReuse, ReuseHint  # noqa: E402
from kvstore.record import header_len_for  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

TRACE = CONVERSATION_TRACE
BLOCK_TOKENS = 512
HIGH, LOW = 0.99, 0.97  # the daemons' watermarks (as tests/kvstore/analytics/test_daemons.py's _pressed)
IDLE_LIMITS_S = (math.inf, 60, 120, 300, 600, 1800)
# As drive.py: two synthetic tokens per block name its hash id; 4 KiB of zeros in one layer.
LAYOUT = KVLayout(num_layers=1, kv_heads=1, head_dim=512, dtype="float16")
NAMESPACE = Namespace("kvstore-analytics-replay", LAYOUT, block_tokens=2)
RECORD_BYTES = header_len_for(2, LAYOUT.num_layers) + NAMESPACE.block_bytes
Before = Callable[[float], None]  # (now): before a request
After = Callable[[int, list[Block], float], None]  # (request number, its full blocks, now): after it


def full_blocks(request: Request) -> list[Block]:
    full = request.hash_ids[: request.input_length // BLOCK_TOKENS]
    return NAMESPACE.blocks([t for key in full for t in (key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF)])


def conversation_gaps(requests: Sequence[Request]) -> dict[str, list[float]]:
    """Per traffic class, seconds from a conversation's turn to its next one (conversations as
    `conversation_turns` finds them: a prompt holding an earlier prompt's last full block goes on from it)."""
    ended: dict[int, float] = {}
    gaps: dict[str, list[float]] = defaultdict(list)
    for request in requests:
        full, now = request.hash_ids[: request.input_length // BLOCK_TOKENS], request.timestamp_ms / 1000
        previous = None
        for key in full[1:]:
            previous = ended.get(key, previous)
        if previous is not None:
            gaps[request.traffic_class].append(now - previous)
        if len(full) > 1:
            ended[full[-1]] = now
    return gaps


def drive(requests: Sequence[Request], blocks: Sequence[list[Block]], capacity: int, label: str,
          hooks: Callable[[KVClient], tuple[Before | None, After | None]]) -> float:
    """Token hit rate of the requests served through a fresh daemon with room for `capacity` blocks."""
    turns = conversation_turns(requests, BLOCK_TOKENS)
    # a rewritten line on a terminal only: in a log or a pipe the carriage returns would pile up
    payload, progress = bytes(NAMESPACE.block_bytes), progress_line(label, len(requests))
    hit_tokens = tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        daemon = DaemonProcess(Path(tmp) / "daemon", Path(tmp), [
            "--capacity-bytes", str(capacity * RECORD_BYTES), "--eviction-policy", "prefix-reuse",
            "--high-watermark", str(HIGH), "--low-watermark", str(LOW), "--segment-bytes", "256KiB",
            "--sweep-interval-s", "0.05"]).start()
        try:
            with KVClient(ClientConfig((daemon.address,), timeout_s=30)) as client:
                before, after = hooks(client)
                for number, (request, mine) in enumerate(zip(requests, blocks)):
                    now = request.timestamp_ms / 1000
                    if before is not None:
                        before(now)
                    hit = len(client.get(mine[: client.lookup(mine)])) if mine else 0
                    hit_tokens += hit * BLOCK_TOKENS
                    tokens += request.input_length
                    if mine[hit:]:
                        client.put([(block, payload) for block in mine[hit:]], LAYOUT.num_layers,
                                   request.traffic_class, ReuseHint(hit, len(mine), turns[number]))
                    if after is not None:
                        after(number, mine, now)
                    progress(number + 1)
        finally:
            daemon.stop()
    return hit_tokens / tokens


def simulate_idle(requests: Sequence[Request], blocks: Sequence[list[Block]], capacity: int,
                  limit_s: float) -> dict:
    """replay()'s prefix-reuse at the daemons' watermarks, advised by an Advisor with `limit_s` for every
    class (a loop of its own: replay() takes advice only from its simulated engines)."""
    policy, turns = PrefixReuse(), conversation_turns(requests, BLOCK_TOKENS)
    ids = {block.key: key for request, mine in zip(requests, blocks) for block, key in zip(mine, request.hash_ids)}
    ended: set[bytes] = set()  # last blocks of conversations advised ended and not seen since

    def advise(advised: Sequence[Block], continues: bool) -> None:  # as the daemon's Store.advise
        ended.add(advised[-1].key)
        for block in advised:
            policy.advise(ids[block.key], ReuseHint(0, 0, continues=continues))

    advisor = Advisor(advise, dict.fromkeys({r.traffic_class for r in requests}, limit_s))
    hit_tokens = tokens = wrong = 0
    for number, (request, mine) in enumerate(zip(requests, blocks)):
        now, keys = request.timestamp_ms / 1000, request.hash_ids
        advisor.sweep(now)
        wrong += len(ended.intersection(block.key for block in mine))  # went on after all
        ended.difference_update(block.key for block in mine)
        hit = 0
        while hit < len(keys) and keys[hit] in policy:
            hit += 1
        hit_tokens += sum(request.block_tokens(i, BLOCK_TOKENS) for i in range(hit))
        tokens += request.input_length
        for key in reversed(keys[:hit]):
            policy.access(key)
        hint = ReuseHint(min(hit, len(mine)), len(mine), turns[number])
        for position in range(len(mine) - 1, hit - 1, -1):
            if keys[position] not in policy:
                policy.insert(keys[position], 1, keys[position - 1] if position else None, hint)
                if len(policy) > int(capacity * HIGH):
                    while len(policy) > int(capacity * LOW):
                        policy.pop_victim()
        advisor.replied(mine, request.traffic_class, now)
    return {"idle_limit_s": limit_s, "hit_rate": hit_tokens / tokens, "advised_ended": advisor.advised["idle"],
            "wrongly_ended": wrong}


def no_advice(client: KVClient) -> tuple[None, None]:
    return None, None


def api_idle(limit_s: float, classes: Sequence[str]) -> Callable[[KVClient], tuple[Before, After]]:
    """The Advisor in trace time; `classes`: each request's traffic class."""
    def hooks(client: KVClient) -> tuple[Before, After]:
        advisor = Advisor(client.advise, dict.fromkeys(classes, limit_s))
        return advisor.sweep, lambda number, mine, now: advisor.replied(mine, classes[number], now)
    return hooks


def simulated(signals: Sequence[bool]) -> Callable[[KVClient], tuple[None, After]]:
    def hooks(client: KVClient) -> tuple[None, After]:
        return None, lambda number, mine, now: client.advise(mine, signals[number]) if mine else None
    return hooks


def percentiles(values: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 95, 99)} if len(values) else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", type=Path, default=TRACE)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--requests", type=int, help="serve only the trace's first N requests (default: all)")
    parser.add_argument("--capacity-fraction", type=float, default=0.1, help="of the trace's unique full blocks")
    parser.add_argument("--repeats", type=int, default=1, help="of each daemon run (the simulator is deterministic)")
    parser.add_argument("--idle-limit", type=float, help="api_idle's limit in s (default: the simulator's best)")
    args = parser.parse_args()
    if not 0 < args.capacity_fraction <= 1 or args.repeats < 1 or (args.requests is not None and args.requests < 1):
        parser.error("--capacity-fraction must be in (0, 1], --repeats and --requests at least 1")
    started = time.monotonic()
    requests = list(itertools.islice(read_trace(args.trace), args.requests))
    blocks = [full_blocks(request) for request in requests]
    classes = [request.traffic_class for request in requests]
    unique = len({block.key for mine in blocks for block in mine})
    capacity = max(1, int(unique * args.capacity_fraction))
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    figures: dict = {"trace": str(args.trace), "requests": len(requests), "trace_span_s": span_s,
                     "unique_blocks": unique, "capacity_blocks": capacity, "repeats": args.repeats}
    print(f"{args.trace.name}: {len(requests):,} requests over {span_s / 60:.0f} min, {unique:,} unique full blocks;"
          f" capacity {capacity:,} blocks ({args.capacity_fraction:.0%}), prefix-reuse, watermarks {HIGH}/{LOW}")

    gaps = conversation_gaps(requests)
    every_gap = np.array([gap for values in gaps.values() for gap in values])
    print("\nSeconds from a conversation's turn to its next turn:")
    for name, values in {"all": every_gap, **gaps}.items():
        figures[f"gap_{name}"] = {"continuations": len(values), **percentiles(values)}
        print(f"  {name:<6} {len(values):>6,} continuations  " + "  ".join(
            f"{q} {v:,.0f}" for q, v in percentiles(values).items()))
    if len(gaps) < 2:
        print(f"  (every request is of class {next(iter(gaps), 'chat')!r}: the trace cannot tell agent from chat)")
    figures.update({f"gap_{q}_s": v for q, v in percentiles(every_gap).items()})

    optimum = replay(requests, "belady", capacity).token_hit_rate
    watermarks = {"low_blocks": int(capacity * LOW)}
    rates: dict[str, list[float]] = {"belady": [optimum]}
    for name, signal in (("sim_prefix_reuse", None), ("sim_signal_100", 1.0), ("sim_signal_90", 0.9)):
        rates[name] = [replay(requests, "prefix-reuse", int(capacity * HIGH), continuation_signal=signal,
                              **watermarks).token_hit_rate]
    print("\nThe Advisor's idle limit, swept in the simulator (a continuation after the limit = wrong advice):")
    print(f"  {'limit':>7} {'cuts off':>9} {'advised ended':>14} {'wrongly':>8} {'hit rate':>9} {'/Belady':>8}")
    sweep = []
    for limit_s in sorted({*IDLE_LIMITS_S, *([args.idle_limit] if args.idle_limit else [])}, reverse=True):
        run = simulate_idle(requests, blocks, capacity, limit_s)
        run["cuts_off"] = float((every_gap > limit_s).mean()) if every_gap.size else 0.0
        run["idle_limit_s"] = None if math.isinf(limit_s) else limit_s  # JSON has no infinity
        sweep.append(run)
        shown = "never" if math.isinf(limit_s) else f"{limit_s:.0f}s"
        print(f"  {shown:>7} {run['cuts_off']:>9.1%} {run['advised_ended']:>14,} "
              f"{run['wrongly_ended'] / max(1, run['advised_ended']):>8.1%} {run['hit_rate']:>9.2%} "
              f"{run['hit_rate'] / optimum:>7.3f}x", flush=True)
    assert sweep[0]["hit_rate"] == rates["sim_prefix_reuse"][0], "unadvised, the loop must agree with replay()"
    best = max(sweep[1:], key=lambda run: run["hit_rate"])
    limit = args.idle_limit or best["idle_limit_s"]
    rates["sim_api_idle"] = [next(run["hit_rate"] for run in sweep if run["idle_limit_s"] == limit)]
    figures.update(idle_sweep=sweep, best_idle_limit_s=best["idle_limit_s"], idle_limit_s=limit)
    print(f"  best: {best['idle_limit_s']:.0f} s; the daemons run api_idle at {limit:.0f} s")

    variants = {"none": no_advice, "api_idle": api_idle(limit, classes),
                "simulated_100": simulated(continuation_signals(requests, 1.0, BLOCK_TOKENS)),
                "simulated_90": simulated(continuation_signals(requests, 0.9, BLOCK_TOKENS))}
    for repeat in range(args.repeats):  # repeats interleaved, so drift on a shared machine hits all alike
        for name, hooks in variants.items():
            rates.setdefault(name, []).append(drive(requests, blocks, capacity, f"daemons {name} #{repeat + 1}", hooks))

    labels = {"none": "daemons    none", "api_idle": f"daemons    api_idle (idle > {limit:.0f} s)",
              "simulated_100": "daemons    simulated_100", "simulated_90": "daemons    simulated_90",
              "belady": "simulator  belady", "sim_prefix_reuse": "simulator  prefix-reuse",
              "sim_api_idle": f"simulator  prefix-reuse + api_idle ({limit:.0f} s)",
              "sim_signal_100": "simulator  prefix-reuse + signal 100%",
              "sim_signal_90": "simulator  prefix-reuse + signal 90%"}
    spread_label = f"spread over {args.repeats}" if args.repeats > 1 else "(1 run)"
    print(f"\n{'':<44} {'token hits':>10} {'/Belady':>8} {spread_label:>15}")
    for name, label in labels.items():
        median = statistics.median(rates[name])
        spread = max(rates[name]) - min(rates[name])
        figures.update({f"hit_rate_{name}": median, f"{name}_vs_belady": median / optimum})
        if name in variants:
            figures.update({f"runs_{name}": rates[name], f"spread_{name}": spread})
        shown = f"{spread:.2%}" if name in variants and args.repeats > 1 else ""
        print(f"{label:<44} {median:>10.2%} {median / optimum:>7.3f}x {shown:>15}")
    print("(api_idle: the trace records no tool calls, so the layer's only advice on it is 'ended' after idling;"
          " replies are taken as done when their request arrives)")
    figures["wall_s"] = time.monotonic() - started
    print(f"{figures['wall_s']:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
