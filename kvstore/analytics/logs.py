"""`kvstore analytics log PATH...`: what the daemons' access logs say (see kvstore/server/access_log.py)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvstore.analytics.simulate import access_statistics
from kvstore.analytics.trace import TraceError, decode


def read_access_log(path: Path, skip_bad: bool = False, errors: list[str] | None = None) -> Iterator[tuple]:
    """(time_ms, op, key, traffic_class, result, tier, bytes) per line; a bad line names itself."""
    with open(path, "rb") as f:  # decoded line by line: a line that is not UTF-8 is named, or skipped
        for number, raw in enumerate(f, start=1):
            try:
                fields = decode(raw).rstrip("\n").split("\t")
                if len(fields) != 7:
                    raise ValueError(f"{len(fields)} fields; an access log line has 7")
                time_ms, op, key, traffic_class, result, tier, nbytes = fields
                if op not in ("lookup", "get", "put", "remove"):
                    raise ValueError(f"op must be lookup, get, put or remove, got {op!r}")
                yield int(time_ms), op, bytes.fromhex(key), traffic_class, result, tier, int(nbytes)
            except ValueError as exc:
                if not skip_bad:
                    raise TraceError(path, number, str(exc)) from None
                if errors is not None:
                    errors.append(f"{path}:{number}: {exc}")


def summarize(paths: Sequence[Path], skip_bad: bool = False, block_tokens: int = 512) -> dict:
    """The figures of the logs at `paths`. The log records blocks, not tokens: token counts are blocks x
    `block_tokens` (the namespace's), which is exact, as the store only ever keeps and looks up full blocks;
    so a token-weighted rate over what was looked up or read equals the block rate, and a prompt's partial
    last block, never looked up, is in neither (the simulator's token hit rate divides by prompt tokens)."""
    gets: dict = defaultdict(Counter)  # class -> hit / miss
    tiers: Counter = Counter()
    causes: Counter = Counter()
    puts: dict = defaultdict(Counter)
    served_bytes = stored_bytes = 0
    lookups: Counter = Counter()  # True: in the leading run found, False: not
    accesses = []
    errors: list[str] = []
    first = last = None
    for path in paths:
        for time_ms, op, key, traffic_class, result, tier, nbytes in read_access_log(path, skip_bad, errors):
            first = time_ms if first is None else min(first, time_ms)
            last = time_ms if last is None else max(last, time_ms)
            if op == "remove":  # the daemon let the block go (evicted, expired, deleted, corrupt): not an access
                continue
            if op == "put":
                puts[traffic_class][result] += 1
                stored_bytes += nbytes if result == "stored" else 0
                continue
            if op == "lookup":
                lookups[result == "hit"] += 1
                accesses.append((key, time_ms / 1000))
                continue
            if result == "hit":
                gets[traffic_class]["hit"] += 1
                tiers[tier] += 1
                served_bytes += nbytes
            else:
                gets[traffic_class]["miss"] += 1
                causes[result] += 1
    looked_up = lookups[True] + lookups[False]
    return {
        "files": [str(p) for p in paths], "skipped_lines": errors, "span_s": ((last or 0) - (first or 0)) / 1000,
        # a daemon writes its log in batches (access_flush_interval_s) and at its stop: a file written
        # moments ago may belong to a running daemon whose latest accesses are not in it yet
        "written_s_ago": min((time.time() - p.stat().st_mtime for p in paths), default=None),
        "blocks_looked_up": looked_up, "lookup_hits": lookups[True],
        "block_hit_rate": lookups[True] / looked_up if looked_up else 0.0,
        "block_tokens": block_tokens, "tokens_looked_up": looked_up * block_tokens,
        "lookup_tokens_found": lookups[True] * block_tokens,
        "token_hit_rate": lookups[True] / looked_up if looked_up else 0.0,  # the same tokens in every block
        "gets": sum(c["hit"] + c["miss"] for c in gets.values()),
        "by_class": {cls: {"hits": c["hit"], "misses": c["miss"], "tokens_served": c["hit"] * block_tokens,
                           "tokens_asked": (c["hit"] + c["miss"]) * block_tokens,
                           "hit_rate": c["hit"] / (c["hit"] + c["miss"]) if c["hit"] + c["miss"] else 0.0,
                           "token_hit_rate": c["hit"] / (c["hit"] + c["miss"]) if c["hit"] + c["miss"] else 0.0}
                     for cls, c in sorted(gets.items())},
        "hits_by_tier": dict(tiers), "misses_by_cause": dict(causes),
        "puts_by_class": {cls: dict(c) for cls, c in sorted(puts.items())},
        "bytes_served": served_bytes, "bytes_stored": stored_bytes,
        "reuse": access_statistics(accesses),
    }


RECENT_S = 60.0  # a log written this recently may belong to a daemon still running


def render(report: dict) -> str:
    tokens = report["block_tokens"]
    lines = [f"{report['blocks_looked_up']:,} blocks looked up over {report['span_s']:,.0f} s: prefix hit rate "
             f"{report['block_hit_rate']:.2%} of blocks (blocks found in the cached leading run / blocks looked up), "
             f"{report['token_hit_rate']:.2%} of tokens ({report['lookup_tokens_found']:,} tokens found / "
             f"{report['tokens_looked_up']:,} looked up, at {tokens:,} a block: the log counts blocks, all full, so "
             f"the two agree; a prompt's partial last block is never looked up, nor counted here); "
             f"{report['gets']:,} blocks read "
             f"({report['bytes_served'] / 2**20:,.0f} MiB served, {report['bytes_stored'] / 2**20:,.0f} MiB stored)"]
    for cls, row in report["by_class"].items():
        lines.append(f"  reads of class {cls:<8} {row['hits']:,} served, {row['misses']:,} failed: "
                     f"{row['hit_rate']:.2%} of blocks read (served / asked), {row['token_hit_rate']:.2%} of tokens "
                     f"({row['tokens_served']:,} / {row['tokens_asked']:,})")
    if report["hits_by_tier"]:
        lines.append("  hits by tier:    " + ", ".join(f"{t} {n:,}" for t, n in sorted(report["hits_by_tier"].items())))
    if report["misses_by_cause"]:
        causes = sorted(report["misses_by_cause"].items(), key=lambda kv: -kv[1])
        lines.append("  misses by cause: " + ", ".join(f"{c} {n:,}" for c, n in causes))
    distance, gap = report["reuse"]["reuse_distance_blocks"], report["reuse"]["reuse_time_s"]
    if distance["count"]:
        lines.append(f"  reuse distance p50 {distance['p50']:,.0f} blocks, p90 {distance['p90']:,.0f}; "
                     f"reuse time p50 {gap['p50']:,.1f} s, p90 {gap['p90']:,.1f} s")
    if report["skipped_lines"]:
        lines.append(f"  {len(report['skipped_lines'])} bad lines skipped")
    if report.get("written_s_ago") is not None and report["written_s_ago"] < RECENT_S:
        lines.append(f"  note: written {report['written_s_ago']:.0f} s ago; if its daemon is still running, its "
                     "latest accesses may not be flushed yet (it writes every access_flush_interval_s and at stop)")
    return "\n".join(lines)
