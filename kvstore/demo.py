"""`make demo`: two daemons on loopback serving a multi-turn chat and agent workload.

What an engine would do per turn, without the model: look up the longest cached prefix of the prompt,
load those blocks (verified), "compute" the rest, save the new full blocks. Payloads are derived from
the block key, so every loaded byte is checked against what was saved. Half-way through, both daemons
are restarted to show that the cache survives and is then served from SSD instead of DRAM.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.block import KVLayout, Namespace
from kvstore.client import KVClient
from kvstore.server.process import DaemonProcess

# A Qwen2.5-0.5B-like KV layout: 24 layers x 2 KV heads x 64 dims in bf16, 256-token blocks = 3 MiB.
LAYOUT = KVLayout(num_layers=24, kv_heads=2, head_dim=64, dtype="bfloat16")
BLOCK_TOKENS = 256


@dataclass
class Session:
    traffic_class: str
    tokens: list[int]


def payload_for(key: bytes, nbytes: int) -> bytes:
    """Stand-in KV of a block: a pure function of its key, so reads can be checked byte for byte."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(nbytes)


def run(sessions: int, turns: int, workdir: Path) -> None:
    rng = np.random.default_rng(0)
    namespace = Namespace("demo/qwen2.5-0.5b-like", LAYOUT, BLOCK_TOKENS, salt="demo-tenant")
    system_prompt = rng.integers(0, 150_000, 1024).tolist()  # shared by every session
    convs = [Session("agent" if i % 2 else "chat", list(system_prompt)) for i in range(sessions)]
    daemons = [DaemonProcess(workdir / f"daemon{i}", workdir, ["--hot-tier-bytes", "512MiB"]) for i in range(2)]
    for daemon in daemons:
        daemon.start()
    print(f"started 2 daemons on {', '.join(d.address for d in daemons)}; data in {workdir}")
    print(f"{sessions} sessions ({sessions // 2} agent, {sessions - sessions // 2} chat) x {turns} turns, "
          f"{BLOCK_TOKENS}-token blocks of {namespace.block_bytes / 2**20:.1f} MiB, shared 1024-token system prompt\n")
    print(f"{'turn':>4} {'prompt tok':>10} {'hit tok':>8} {'hit rate':>8} {'ideal':>6} {'loaded':>9} "
          f"{'load GB/s':>9} {'saved':>9} {'save GB/s':>9}  served from")
    totals = dict(prompt=0, hit=0, ideal=0, loaded=0, saved=0)
    seen: set[bytes] = set()
    client = KVClient([d.address for d in daemons])
    try:
        for turn in range(turns):
            if turn == turns // 2:
                client.close()
                for daemon in daemons:
                    daemon.stop()
                    daemon.start()
                client = KVClient([d.address for d in daemons])
                print("      -- both daemons restarted: the DRAM tier is empty, the SSD segments are not --")
            before = _tier_hits(client)
            row = dict(prompt=0, hit=0, ideal=0, loaded=0, saved=0, load_s=0.0, save_s=0.0)
            for conv in convs:
                conv.tokens += rng.integers(0, 150_000, int(rng.integers(200, 600))).tolist()  # the user's turn
                blocks = namespace.blocks(conv.tokens)
                row["prompt"] += len(conv.tokens)
                row["ideal"] += BLOCK_TOKENS * sum(1 for b in blocks if b.key in seen)
                started = time.perf_counter()
                hits = client.lookup(blocks)
                loaded = client.get(blocks[:hits])
                row["load_s"] += time.perf_counter() - started
                for data in loaded:
                    if data.payload != payload_for(data.block.key, namespace.block_bytes):
                        raise AssertionError(f"block {data.block.key.hex()} came back different")
                row["hit"] += len(loaded) * BLOCK_TOKENS
                row["loaded"] += sum(len(d.payload) for d in loaded)
                new = [(b, payload_for(b.key, namespace.block_bytes)) for b in blocks[len(loaded):]]
                started = time.perf_counter()
                summary = client.put(new, LAYOUT.num_layers, conv.traffic_class)
                row["save_s"] += time.perf_counter() - started
                row["saved"] += summary.stored * namespace.block_bytes
                seen.update(b.key for b in blocks)
                conv.tokens += rng.integers(0, 150_000, int(rng.integers(100, 300))).tolist()  # the reply
            tiers = {k: v - before.get(k, 0) for k, v in _tier_hits(client).items()}
            print(f"{turn + 1:>4} {row['prompt']:>10,} {row['hit']:>8,} {row['hit'] / row['prompt']:>8.1%} "
                  f"{row['ideal'] / row['prompt']:>6.1%} {row['loaded'] / 2**20:>7.0f}Mi "
                  f"{_rate(row['loaded'], row['load_s']):>9} {row['saved'] / 2**20:>7.0f}Mi "
                  f"{_rate(row['saved'], row['save_s']):>9}  "
                  + ", ".join(f"{tier} {count:.0f}" for tier, count in sorted(tiers.items()) if count))
            for name in totals:
                totals[name] += row[name]
        print(f"\nall turns: {totals['hit']:,} of {totals['prompt']:,} prompt tokens served from the cache "
              f"({totals['hit'] / totals['prompt']:.1%}; the most any cache could serve: "
              f"{totals['ideal'] / totals['prompt']:.1%}), every loaded byte verified")
        for address, stats in client.server_stats().items():
            stats = stats or {}
            blocks_held = sum(v for k, v in stats.items() if k.startswith("kvstore_blocks{"))
            print(f"  {address}: {blocks_held:.0f} blocks, {stats.get('kvstore_disk_bytes', 0) / 2**20:.0f} MiB on disk, "
                  f"{stats.get('kvstore_segments', 0):.0f} segments, "
                  f"hits dram/ssd {stats.get('kvstore_hits_total{tier=dram}', 0):.0f}/"
                  f"{stats.get('kvstore_hits_total{tier=ssd}', 0):.0f}")
    finally:
        client.close()
        codes = [daemon.stop() for daemon in daemons]
        print(f"daemons stopped (exit codes {codes})")


def _tier_hits(client: KVClient) -> dict[str, float]:
    out: dict[str, float] = {}
    for stats in client.server_stats().values():
        for tier in ("dram", "ssd"):
            out[tier] = out.get(tier, 0) + (stats or {}).get(f"kvstore_hits_total{{tier={tier}}}", 0)
    return out


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 and nbytes else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-demo-"))
    try:
        run(args.sessions, args.turns, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
