"""How evenly daemons serve a skewed workload, with copies of hot blocks and without.

    python bench/hot_prefix.py [--repeats 3] [--requests 600] [--json out.json]

Four daemons and four engines (clients). Every request reads one shared system prompt (4 blocks) and
then its user's own conversation (4 blocks; 64 users, chosen at random): the shared blocks are read by
every request, the rest by one user's. Blocks are the real model's size (Gemma 3 270M: 18 layers, one KV
head of 256, 16 tokens, float16). Without copies each shared block is served by its one owner; with
`--hot-replicas R` on the daemons, blocks read at least 16 times within 10 s get R copies (the owner and
the next members in rendezvous order) and each engine reads them from the holder that has served it the
least. Reported, per setting: max/mean payload bytes served per daemon over the requests (1.0 is the
limit, perfect balance), its ratio to the run without copies, the bytes the copies cost, and the hit rate
(every block is stored, so anything below 1.0 is a miss copies caused). Medians with [min, max] over
repeats, each with another system prompt (another placement).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.block import KVLayout, Namespace  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

NS = Namespace("hot-prefix-bench", KVLayout(num_layers=18, kv_heads=1, head_dim=256, dtype="float16"),
               block_tokens=16)
DAEMONS, ENGINES, USERS, SHARED_BLOCKS, USER_BLOCKS = 4, 4, 64, 4, 4


def run(replicas: int, requests: int, seed: int, folder: Path) -> dict:
    rng = random.Random(seed)
    system = [rng.randrange(1 << 31) for _ in range(SHARED_BLOCKS * NS.block_tokens)]
    prompts = [NS.blocks(system + [rng.randrange(1 << 31) for _ in range(USER_BLOCKS * NS.block_tokens)])
               for _ in range(USERS)]
    args = ["--hot-replicas", str(replicas), "--hot-reads", "16", "--hot-window-s", "10",
            "--capacity-bytes", "8GiB", "--hot-tier-bytes", "1GiB"]
    daemons = [DaemonProcess(folder / f"r{replicas}-{seed}-{i}", folder, args).start() for i in range(DAEMONS)]
    try:
        config = ClientConfig(tuple(d.address for d in daemons), timeout_s=30)
        engines = [KVClient(config) for _ in range(ENGINES)]
        try:
            payload = bytes(NS.block_bytes)
            seen = set()
            for blocks in prompts:  # everything stored once, as the first prefill of each would
                engines[0].put([(b, payload) for b in blocks if b.key not in seen], NS.num_layers)
                seen.update(b.key for b in blocks)
            before = served(engines[0])
            hit = wanted = 0
            for number in range(requests):
                engine, blocks = engines[number % ENGINES], prompts[rng.randrange(USERS)]
                hit += len(engine.get(blocks[: engine.lookup(blocks)]))
                wanted += len(blocks)
            after = served(engines[0])
            per_daemon = [after[name] - before[name] for name in before]
            copies = sum(e.stats.copies_made for e in engines)
            return {"max_over_mean": max(per_daemon) / statistics.mean(per_daemon), "hit_rate": hit / wanted,
                    "copy_bytes_over_read_bytes": copies * NS.block_bytes / sum(per_daemon),
                    "copies": copies, "per_daemon_bytes": per_daemon}
        finally:
            for engine in engines:
                engine.close()
    finally:
        for daemon in daemons:
            daemon.stop()


def served(client: KVClient) -> dict[str, float]:
    return {name: stats.value("kvstore_read_bytes_total") for name, stats in client.server_stats().items()}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    settings = (1, 2, 4)
    runs: dict[int, list[dict]] = {r: [] for r in settings}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for replicas in settings:
                runs[replicas].append(run(replicas, args.requests, seed=repeat, folder=Path(folder)))
    out = {"daemons": DAEMONS, "engines": ENGINES, "requests": args.requests, "block_bytes": NS.block_bytes}
    print(f"{DAEMONS} daemons, {ENGINES} engines, {args.requests} requests: a {SHARED_BLOCKS}-block system prompt "
          f"read by every request + {USER_BLOCKS} blocks of one of {USERS} users; {args.repeats} repeats")
    print(f"{'copies':>8} {'max/mean bytes per daemon':>28} {'vs no copies':>13} {'copy bytes':>11} {'hit rate':>9}")
    base = [r["max_over_mean"] for r in runs[1]]
    for replicas in settings:
        skew = [r["max_over_mean"] for r in runs[replicas]]
        ratio = [s / b for s, b in zip(skew, base)]
        figures = {"max_over_mean": spread(skew), "over_no_copies": spread(ratio),
                   "copy_bytes_over_read_bytes": spread([r["copy_bytes_over_read_bytes"] for r in runs[replicas]]),
                   "hit_rate": spread([r["hit_rate"] for r in runs[replicas]])}
        out[f"replicas_{replicas}"] = figures
        label = "none" if replicas == 1 else str(replicas)
        m = figures["max_over_mean"]
        print(f"{label:>8} {m['median']:16.3f} [{m['min']:.3f}, {m['max']:.3f}] "
              f"{figures['over_no_copies']['median']:13.3f} {figures['copy_bytes_over_read_bytes']['median']:11.4f} "
              f"{figures['hit_rate']['median']:9.4f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
