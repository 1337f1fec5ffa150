"""`kvstore analytics`: hit rates of request traces, running daemons and their access logs.

    kvstore analytics replay traces/conversation_trace.jsonl --capacity 1%,5%,10%,20%,50% \\
        --plot hitrate.png --json hitrate.json [--servers host:port,... --payload-bytes 4KiB]
    kvstore analytics live --servers host:port,... [--interval 2]
    kvstore analytics log /var/lib/kvstore/access.log [--json out.json]

Capacities are a share of the trace's unique full blocks ("10%"), a number of blocks ("20000"), or
bytes ("64GiB", with --block-bytes). Each row shows the token-weighted hit rate of every policy, of
Belady's optimum at the same capacity and of the infinite cache. Exit codes: 0 done, 2 bad usage or a
bad trace line (which names its line; --skip-bad goes on past it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.analytics.drive import replay_through_daemons
from kvstore.analytics.live import run_live
from kvstore.analytics.logs import render as render_log
from kvstore.analytics.logs import summarize
from kvstore.analytics.parallel import Job, Progress, replay_many
from kvstore.analytics.simulate import replay, reuse_statistics
from kvstore.analytics.trace import read_trace
from kvstore.client.config import add_security_flags, security_settings
from kvstore.eviction import POLICIES
from kvstore.units import parse_duration, parse_size


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("analytics", help="cache hit-rate analytics over request traces")
    sub = parser.add_subparsers(dest="analytics_command", required=True)
    play = sub.add_parser("replay", help="replay a Mooncake-format trace through the policies",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    play.add_argument("trace", type=Path, help="JSONL: timestamp (ms), input_length, output_length, hash_ids")
    play.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    play.add_argument("--capacity", default="1%,2%,5%,10%,20%,50%",
                      help="comma-separated: a share of unique blocks (10%%), blocks (20000) or bytes (64GiB)")
    play.add_argument("--block-bytes", type=parse_size, default=0, help="bytes of one block, for byte capacities")
    play.add_argument("--block-tokens", type=int, default=512, help="tokens per hash_id block (512 in Mooncake's)")
    play.add_argument("--ttl", default="", help="TTL per traffic class, e.g. agent=3d,chat=7d (default: none)")
    play.add_argument("--reuse", action="store_true", help="also report reuse distance and reuse time")
    play.add_argument("--plot", type=Path, help="draw hit rate against capacity into this PNG")
    play.add_argument("--json", type=Path, help="write every figure here")
    play.add_argument("--skip-bad", action="store_true", help="skip malformed trace lines (and count them)")
    play.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                      help="replays run at once, one process each (default: one per core); memory grows with it")
    play.add_argument("--servers", help="also drive the trace through these running daemons (host:port,...) and "
                                        "set their hit rate beside the simulator's at the first --capacity")
    play.add_argument("--payload-bytes", type=parse_size, default=4096, help="payload per block with --servers")
    play.add_argument("--continuation-signal", type=probability, metavar="Q",
                      help="simulate engines that advise the store once each reply is done whether its "
                           "conversation goes on, right with probability Q; traces do not record it, so it "
                           "is drawn from the trace's own future (what such advice would be worth)")
    add_security_flags(play)
    play.set_defaults(run=run_replay)

    live = sub.add_parser("live", help="hit rates, capacity and churn of running daemons, refreshed in place")
    live.add_argument("--servers", required=True, help="comma-separated host:port of the daemons")
    live.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    live.add_argument("--rounds", type=int, help="stop after this many refreshes (default: until interrupted)")
    add_security_flags(live)
    live.set_defaults(run=lambda args: run_live(args.servers, args.interval, args.rounds, security_settings(args)))

    log = sub.add_parser("log", help="the same analysis from the daemons' access logs (--access-log)")
    log.add_argument("paths", type=Path, nargs="+", help="access log files")
    log.add_argument("--json", type=Path, help="write every figure here")
    log.add_argument("--skip-bad", action="store_true", help="skip malformed lines (and count them)")
    log.add_argument("--block-tokens", type=int, default=512,
                     help="tokens per block of the namespace logged, for token counts (the log records blocks)")
    log.set_defaults(run=run_log)


def run_log(args: argparse.Namespace) -> int:
    for path in args.paths:
        if not path.is_file():
            raise ValueError(f"{path} is not a file")
    if args.block_tokens < 1:
        raise ValueError(f"--block-tokens must be at least 1, got {args.block_tokens}")
    report = summarize(args.paths, args.skip_bad, args.block_tokens)
    print(render_log(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"figures written to {args.json}")
    return 0


def probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a probability in [0, 1]")
    return value


def parse_capacities(text: str, unique_blocks: int, block_bytes: int) -> list[tuple[str, int]]:
    capacities = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item.endswith("%"):
            share = float(item[:-1]) / 100
            if not 0 < share <= 1:
                raise ValueError(f"capacity {item} must be a share in (0%, 100%]")
            blocks = int(unique_blocks * share)
        elif item.isdigit():
            blocks = int(item)
        else:
            try:  # the unit first: "10pc" is a unit no one knows, not a size missing --block-bytes
                size = parse_size(item)
            except ValueError:
                raise ValueError(f"capacity {item!r}: unknown unit; give a share (10%), a number of blocks (5000) "
                                 "or a size in bytes (64GiB, with --block-bytes)") from None
            if not block_bytes:
                raise ValueError(f"capacity {item} is in bytes: give --block-bytes, the size of one block")
            blocks = size // block_bytes
        if blocks < 1:
            raise ValueError(f"capacity {item} holds no block")
        capacities.append((item, blocks))
    if not capacities:
        raise ValueError("give at least one capacity")
    return capacities


class ProgressLine:
    """One line on stderr, rewritten at most a few times a second."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.last = label, total, 0.0

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last > 0.25 or done == self.total:
            self.last = now
            end = "\n" if done == self.total else ""
            print(f"\r  {self.label}: {done:,}/{self.total:,} requests", end=end, file=sys.stderr, flush=True)


class DoneLine:
    """For a stderr that is not a terminal (a log, a pipe): no rewriting, one line once a replay is done."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.started = label, total, time.monotonic()

    def __call__(self, done: int) -> None:
        if done == self.total:
            print(f"  {self.label}: {done:,} requests in {time.monotonic() - self.started:,.1f} s", file=sys.stderr,
                  flush=True)


def progress(label: str, total: int) -> ProgressLine | DoneLine:
    """A progress bar on a terminal; elsewhere a line once done, without the carriage returns of a bar."""
    return ProgressLine(label, total) if sys.stderr.isatty() else DoneLine(label, total)


class ReplaysProgress(Progress):
    """Many replays: one bar on a terminal, rewritten in place; elsewhere a line per replay done."""

    def __init__(self, replays: int, requests_each: int) -> None:
        self.replays, self.each, self.done = replays, requests_each, 0
        self.tty, self.started, self.last = sys.stderr.isatty(), time.monotonic(), 0.0

    def requests(self, replayed: int) -> None:
        now = time.monotonic()
        if self.tty and now - self.last > 0.25:
            self.last = now
            self._bar(replayed, "")

    def finished(self, job: Job, seconds: float) -> None:
        self.done += 1
        if not self.tty:
            print(f"  {job.policy} at {job.label}: {self.each:,} requests in {seconds:,.1f} s", file=sys.stderr,
                  flush=True)
        elif self.done == self.replays:
            self._bar(self.replays * self.each, "\n")

    def _bar(self, replayed: int, end: str) -> None:
        print(f"\r  {self.done}/{self.replays} replays, {replayed:,}/{self.replays * self.each:,} requests, "
              f"{time.monotonic() - self.started:,.0f} s", end=end, file=sys.stderr, flush=True)


def run_replay(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    ttl = {name: parse_duration(value) for name, value in
           (item.split("=", 1) for item in args.ttl.split(",") if item)} if args.ttl else None
    skipped: list[str] = []
    requests = list(read_trace(args.trace, args.block_tokens, args.skip_bad, skipped))
    for line in skipped[:10]:
        print(f"skipped {line}", file=sys.stderr)
    if not requests:
        raise ValueError(f"{args.trace} holds no request"
                         + (f" ({len(skipped):,} bad lines skipped)" if skipped else ""))
    unique = len({key for r in requests for key in r.hash_ids[: r.input_length // args.block_tokens]})
    capacities = parse_capacities(args.capacity, unique, args.block_bytes)
    infinite = replay(requests, "infinite", None, args.block_tokens, ttl)
    jobs = [Job(policy, blocks, label) for label, blocks in capacities for policy in [*policies, "belady"]]
    results = iter(replay_many(requests, jobs, args.jobs, ReplaysProgress(len(jobs), len(requests)),
                               block_tokens=args.block_tokens, ttl_s=ttl,
                               continuation_signal=args.continuation_signal))
    rows: list[dict[str, Any]] = [  # JSON-able: a capacity, then each policy's figures
        {"capacity": label, "capacity_blocks": blocks, **{p: next(results) for p in [*policies, "belady"]}}
        for label, blocks in capacities]
    print(f"\n{args.trace}: {len(requests):,} requests, {sum(r.input_length for r in requests):,} input tokens, "
          f"{unique:,} unique full blocks; infinite cache: {infinite.token_hit_rate:.2%} of tokens"
          + (f"; {len(skipped)} bad lines skipped" if skipped else ""))
    if args.continuation_signal is not None:
        print(f"engines simulated advising whether each conversation goes on, right {args.continuation_signal:.0%} "
              "of the time (policies that take advice: prefix-reuse)")
    print("token-weighted hit rate (ratio to Belady at the same capacity):")
    header = f"{'capacity':>10} {'blocks':>8} " + " ".join(f"{p:>17}" for p in policies) + f" {'belady':>8}"
    print(header)
    for row in rows:
        opt = row["belady"]["token_hit_rate"]
        cells = " ".join(f"{row[p]['token_hit_rate']:>8.2%} ({row[p]['token_hit_rate'] / opt if opt else 0:4.2f}x)"
                         for p in policies)
        print(f"{row['capacity']:>10} {row['capacity_blocks']:>8,} {cells} {opt:>8.2%}")
    report = {"trace": str(args.trace), "requests": len(requests), "unique_full_blocks": unique,
              "skipped_lines": skipped, "ttl_s": ttl, "continuation_signal": args.continuation_signal,
              "infinite": infinite.as_dict(), "rows": rows}
    if args.reuse:
        report["reuse"] = reuse = reuse_statistics(requests)
        distance, gap = reuse["reuse_distance_blocks"], reuse["reuse_time_s"]
        if distance["count"]:
            print(f"reuse distance (distinct blocks in between): p50 {distance['p50']:,.0f}, "
                  f"p90 {distance['p90']:,.0f},"
                  f" p99 {distance['p99']:,.0f}; reuse time: p50 {gap['p50']:,.1f} s, p90 {gap['p90']:,.1f} s")
    if args.servers:
        label, blocks = capacities[0]
        simulated = rows[0][policies[0]]
        driven = replay_through_daemons(requests, args.servers, args.payload_bytes, args.block_tokens,
                                        progress(f"daemons at {args.servers}", len(requests)),
                                        args.continuation_signal, security_settings(args)).as_dict()
        report["daemons"] = driven
        print(f"through the daemons: {driven['token_hit_rate']:.2%} of tokens, {driven['block_hit_rate']:.2%} of "
              f"blocks; the simulator's {policies[0]} at {label} ({blocks:,} blocks): "
              f"{simulated['token_hit_rate']:.2%} and {simulated['block_hit_rate']:.2%}")
    if args.plot:
        plot(rows, policies, unique, infinite.token_hit_rate, args.plot, str(args.trace))
        print(f"plot written to {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"figures written to {args.json}")
    return 0


def plot(rows: list[dict], policies: list[str], unique: int, infinite: float, path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvstore[analytics]'") from None
    shares = [100 * row["capacity_blocks"] / unique for row in rows]
    figure, axis = plt.subplots(figsize=(8, 5), dpi=120)
    for policy in policies:
        axis.plot(shares, [100 * row[policy]["token_hit_rate"] for row in rows], marker="o", label=policy)
    axis.plot(shares, [100 * row["belady"]["token_hit_rate"] for row in rows], "k--", marker="s",
              label="Belady (optimal)")
    axis.axhline(100 * infinite, color="grey", linestyle=":", label="infinite cache")
    axis.set_xscale("log")
    axis.set_xlabel("capacity, % of the trace's unique full blocks (log scale)")
    axis.set_ylabel("token-weighted prefix hit rate, %")
    axis.set_title(f"Hit rate against capacity: {Path(title).name}")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
