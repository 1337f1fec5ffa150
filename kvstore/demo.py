"""The storage path alone, without a model: `python -m kvstore.demo` (`make demo` is `engine.demo`).

Two daemons on loopback serve a multi-turn chat and agent workload, doing per turn what an engine would
without the model: look up the longest cached prefix of the prompt, load it layer by layer into its KV
buffers (waiting for each layer as the model would reach it), "compute" the rest, and save the new full
blocks behind its back (write-behind). The client keeps a host-memory tier smaller than the working set,
so hits come from this process's memory, the daemons' DRAM and their SSD. Payloads are derived from the
block key, so every loaded byte is checked against what was saved. Half-way through, both daemons are
restarted: the cache survives, on SSD.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.client.loading import BufferDestination
from kvstore.server.process import DaemonProcess
from kvstore.stats import Stats

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
    block_bytes = namespace.block_bytes
    system_prompt = rng.integers(0, 150_000, 1024).tolist()  # shared by every session
    convs = [Session("agent" if i % 2 else "chat", list(system_prompt)) for i in range(sessions)]
    daemons = [DaemonProcess(workdir / f"daemon{i}", workdir, ["--hot-tier-bytes", "512MiB"]) for i in range(2)]
    for daemon in daemons:
        daemon.start()
    config = ClientConfig(tuple(d.address for d in daemons), host_tier_bytes=32 * block_bytes,
                          host_block_bytes=block_bytes)
    print(f"started 2 daemons on {', '.join(d.address for d in daemons)}; data in {workdir}")
    print(f"{sessions} sessions ({sessions // 2} agent, {sessions - sessions // 2} chat) x {turns} turns, "
          f"{BLOCK_TOKENS}-token blocks of {block_bytes / 2**20:.1f} MiB, shared 1024-token system prompt; "
          f"client host tier of {config.host_tier_bytes // 2**20} MiB\n")
    print(f"{'turn':>4} {'prompt tok':>10} {'hit tok':>8} {'hit rate':>8} {'ideal':>6} {'loaded':>9} "
          f"{'load GB/s':>9}  served from (blocks)")
    totals = dict(prompt=0, hit=0, ideal=0)
    seen: set[bytes] = set()
    client = KVClient(config)
    buffers = client.shared_buffer(64 * block_bytes)  # the "engine's" KV buffers, reused every request
    try:
        for turn in range(turns):
            if turn == turns // 2:
                client = restarted(client, daemons, config)
                buffers = client.shared_buffer(64 * block_bytes)
                print("      -- both daemons and the client restarted: only the daemons' SSD segments remain --")
            before = tier_hits(client)
            row = dict(prompt=0, hit=0, ideal=0)  # tokens
            load_s = 0.0
            for conv in convs:
                conv.tokens += rng.integers(0, 150_000, int(rng.integers(200, 600))).tolist()  # the user's turn
                blocks = namespace.blocks(conv.tokens)[:64]
                row["prompt"] += len(conv.tokens)
                row["ideal"] += BLOCK_TOKENS * sum(1 for b in blocks if b.key in seen)
                started = time.perf_counter()
                views = [buffers[i * block_bytes : (i + 1) * block_bytes] for i in range(len(blocks))]
                handle = client.load(blocks, BufferDestination(views, LAYOUT.num_layers, namespace.layer_bytes))
                for layer in range(LAYOUT.num_layers):  # as the model reaches each attention layer
                    handle.wait_layer(layer, timeout=30)
                hit = handle.wait(timeout=30) // BLOCK_TOKENS
                load_s += time.perf_counter() - started
                for block, view in zip(blocks[:hit], views):
                    if view != payload_for(block.key, block_bytes):
                        raise AssertionError(f"block {block.key.hex()} came back different")
                row["hit"] += hit * BLOCK_TOKENS
                client.save([(b, payload_for(b.key, block_bytes)) for b in blocks[hit:]], LAYOUT.num_layers,
                            conv.traffic_class)  # write-behind: never waits for the store
                seen.update(b.key for b in blocks)
                conv.tokens += rng.integers(0, 150_000, int(rng.integers(100, 300))).tolist()  # the reply
            client.write_behind.flush(timeout=60)
            tiers = {k: v - before.get(k, 0) for k, v in tier_hits(client).items()}
            print(f"{turn + 1:>4} {row['prompt']:>10,} {row['hit']:>8,} {row['hit'] / row['prompt']:>8.1%} "
                  f"{row['ideal'] / row['prompt']:>6.1%} {row['hit'] // BLOCK_TOKENS * block_bytes / 2**20:>7.0f}Mi "
                  f"{_rate(row['hit'] // BLOCK_TOKENS * block_bytes, load_s):>9}  "
                  + ", ".join(f"{tier} {count:.0f}" for tier, count in tiers.items() if count))
            for name in totals:
                totals[name] += row[name]
        print(f"\nall turns: {totals['hit']:,} of {totals['prompt']:,} prompt tokens served from the cache "
              f"({totals['hit'] / totals['prompt']:.1%}; the most any cache could serve: "
              f"{totals['ideal'] / totals['prompt']:.1%}), every loaded byte verified; "
              f"saves dropped: {client.write_behind.counters['dropped']}")
        for address, stats in client.server_stats().items():
            stats = stats or Stats()
            blocks_held = stats.value("kvstore_blocks")
            disk_mib = stats.value("kvstore_disk_bytes") / 2**20
            print(f"  {address}: {blocks_held:.0f} blocks, {disk_mib:.0f} MiB on disk, "
                  f"{stats.value('kvstore_segments'):.0f} segments, "
                  f"{stats.value('kvstore_region_read_bytes_total') / 2**20:.0f} MiB written straight into the "
                  f"client's shared memory")
    finally:
        client.close()
        codes = [daemon.stop() for daemon in daemons]
        print(f"daemons stopped (exit codes {codes})")


def restarted(client: KVClient, daemons: list[DaemonProcess], config: ClientConfig) -> KVClient:
    """Close `client`, restart every daemon (their segments and index stay on disk), and connect anew."""
    client.close()
    for daemon in daemons:
        daemon.stop()
        daemon.start()
    return KVClient(config)


def tier_hits(client: KVClient) -> dict[str, float]:
    """Blocks served so far: by the client's host tier, and by the daemons' DRAM and SSD."""
    out = {"host": float(client.stats.tier_hits["host"]), "daemon DRAM": 0.0, "daemon SSD": 0.0}
    for stats in client.server_stats().values():
        out["daemon DRAM"] += (stats or Stats()).value("kvstore_hits_total", tier="dram")
        out["daemon SSD"] += (stats or Stats()).value("kvstore_hits_total", tier="ssd")
    return out


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 and nbytes else "-"


def demo_main(run: Callable[[int, int, Path], None], description: str, sessions: int, turns: int,
              prefix: str) -> None:
    """A demo's command line: --sessions, --turns, --keep; `run` works in a scratch directory."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=sessions)
    parser.add_argument("--turns", type=int, default=turns)
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        run(args.sessions, args.turns, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    demo_main(run, __doc__, sessions=8, turns=6, prefix="kvstore-demo-")
