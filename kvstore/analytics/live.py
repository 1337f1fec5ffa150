"""`kvstore analytics live --servers ...`: hit rates, capacity and churn of running daemons, in place."""

from __future__ import annotations

import re
import sys
import time

from kvstore.client import ClientConfig, KVClient


def _labelled(stats: dict[str, float], name: str) -> dict[str, float]:
    """{label value: number} of `name{label=value}` samples."""
    out = {}
    for key, value in stats.items():
        match = re.fullmatch(re.escape(name) + r"\{\w+=([^}]*)\}", key)
        if match:
            out[match.group(1)] = value
    return out


def render(all_stats: dict[str, dict | None]) -> str:
    lines = [time.strftime("%H:%M:%S") + f"  {len(all_stats)} daemons"]
    total: dict[str, float] = {}
    for address, stats in all_stats.items():
        if stats is None:
            lines.append(f"  {address}: unreachable")
            continue
        for key, value in stats.items():
            total[key] = total.get(key, 0) + value
        lines.append("  " + _line(address, stats))
    if len([s for s in all_stats.values() if s]) > 1:
        lines.append("  " + _line("cluster", total))
    if total:
        tiers = _labelled(total, "kvstore_hits_total")
        classes = _labelled(total, "kvstore_class_hits_total")
        causes = _labelled(total, "kvstore_misses_total")
        lines.append("  hits by tier:    " + ", ".join(f"{t} {n:,.0f}" for t, n in sorted(tiers.items())))
        lines.append("  hits by class:   " + ", ".join(f"{c} {n:,.0f}" for c, n in sorted(classes.items())))
        by_count = sorted(causes.items(), key=lambda kv: -kv[1])
        lines.append("  misses by cause: " + ", ".join(f"{c} {n:,.0f}" for c, n in by_count))
        blocks = _labelled(total, "kvstore_blocks")
        lines.append("  blocks by class: " + ", ".join(f"{c} {n:,.0f}" for c, n in sorted(blocks.items())))
        advised = _labelled(total, "kvstore_advised_blocks_total")
        if advised:
            lines.append("  advised blocks:  " + ", ".join(f"{'going on' if c == 'true' else 'ended'} {n:,.0f}"
                                                          for c, n in sorted(advised.items(), reverse=True)))
    return "\n".join(lines)


def _line(name: str, stats: dict[str, float]) -> str:
    hits = sum(_labelled(stats, "kvstore_hits_total").values())
    misses = sum(_labelled(stats, "kvstore_misses_total").values())
    rate = hits / (hits + misses) if hits + misses else 0.0
    used, capacity = stats.get("kvstore_disk_bytes", 0), stats.get("kvstore_capacity_bytes", 0)
    return (f"{name:<22} hit {rate:>7.2%} of {hits + misses:>10,.0f} reads   disk {used / 2**30:8.2f} of "
            f"{capacity / 2**30:8.2f} GiB   evictions {stats.get('kvstore_evictions_total', 0):>9,.0f}   "
            f"expiries {stats.get('kvstore_expiries_total', 0):>9,.0f}")


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
