"""`kvstore analytics live --servers ...`: hit rates, capacity and churn of running daemons, in place."""

from __future__ import annotations

import sys
import time

from kvstore.client import ClientConfig, KVClient
from kvstore.stats import Stats


def render(all_stats: dict[str, Stats | None]) -> str:
    lines = [time.strftime("%H:%M:%S") + f"  {len(all_stats)} daemons"]
    for address, stats in all_stats.items():
        lines.append(f"  {address}: unreachable" if stats is None else "  " + _line(address, stats))
    reachable = [s for s in all_stats.values() if s]
    total = Stats.sum(reachable)
    if len(reachable) > 1:
        lines.append("  " + _line("cluster", total))
    if total:
        tiers = total.by("kvstore_hits_total", "tier")
        classes = total.by("kvstore_class_hits_total", "traffic_class")
        causes = total.by("kvstore_misses_total", "cause")
        lines.append("  hits by tier:    " + ", ".join(f"{t} {n:,.0f}" for t, n in sorted(tiers.items())))
        lines.append("  hits by class:   " + ", ".join(f"{c} {n:,.0f}" for c, n in sorted(classes.items())))
        by_count = sorted(causes.items(), key=lambda kv: -kv[1])
        lines.append("  misses by cause: " + ", ".join(f"{c} {n:,.0f}" for c, n in by_count))
        blocks = total.by("kvstore_blocks", "traffic_class")
        lines.append("  blocks by class: " + ", ".join(f"{c} {n:,.0f}" for c, n in sorted(blocks.items())))
        advised = total.by("kvstore_advised_blocks_total", "continues")
        if advised:
            lines.append("  advised blocks:  " + ", ".join(f"{'going on' if c == 'true' else 'ended'} {n:,.0f}"
                                                          for c, n in sorted(advised.items(), reverse=True)))
    return "\n".join(lines)


def _line(name: str, stats: Stats) -> str:
    """The prefix hit rate first: Get reads are of blocks a Lookup already found, so nearly all of them hit
    and their rate says little about the cache. Lookups ask for full blocks only, so within a namespace the
    share of looked-up blocks found is the share of looked-up tokens found."""
    asked, found = stats.value("kvstore_lookup_keys_total"), stats.value("kvstore_lookup_hits_total")
    hits, misses = stats.value("kvstore_hits_total"), stats.value("kvstore_misses_total")
    prefix = found / asked if asked else 0.0
    reads = hits / (hits + misses) if hits + misses else 0.0
    used, capacity = stats.value("kvstore_disk_bytes"), stats.value("kvstore_capacity_bytes")
    return (f"{name:<22} prefix hit {prefix:>7.2%} (blocks found / {asked:,.0f} looked up)   reads served "
            f"{reads:>7.2%} (of {hits + misses:,.0f} Get blocks)   disk {used / 2**30:8.2f} of "
            f"{capacity / 2**30:8.2f} GiB   evictions {stats.value('kvstore_evictions_total'):>9,.0f}   "
            f"expiries {stats.value('kvstore_expiries_total'):>9,.0f}")


def run_live(servers: str, interval_s: float, rounds: int | None, security: dict | None = None) -> int:
    """Print the cluster's figures every `interval_s`; in place on a terminal. 1 if a daemon is unreachable.

    `security`: ClientConfig's token and TLS fields, for a secured cluster (Stats needs an admin token)."""
    config = ClientConfig(tuple(s for s in servers.split(",") if s), lookup_timeout_s=max(1.0, interval_s / 2),
                          **(security or {}))
    unreachable = False
    with KVClient(config) as client:
        done = 0
        while rounds is None or done < rounds:
            stats = client.server_stats()
            unreachable = any(v is None for v in stats.values())
            if sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")
            print(render(stats), flush=True)
            done += 1
            if rounds is None or done < rounds:
                time.sleep(interval_s)
    return 1 if unreachable else 0
