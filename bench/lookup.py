"""Lookup latency of a 1,000-block prefix as the daemon's index grows to 10 million blocks.

    python bench/lookup.py [--sizes 1e5,1e6,1e7] [--prefix 1000] [--lookups 300] [--json out.json]

The index is built directly in the daemon's own format (LMDB entries pointing into one sparse, sealed
segment file, so no payload bytes are written), then a real kvstore-server is started on it and
timed through the Lookup RPC. Beside it, the limit: the same 1,000 reads straight from LMDB in this
process. Reported: p50/p99 of both, their ratio, the daemon's start-up (recovery) time, the index's
live bytes per block, and its file's bytes per block (which also count free pages).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import lmdb  # noqa: E402
import numpy as np  # noqa: E402

from kvstore.proto import method, pb  # noqa: E402
from kvstore.server.index import Entry  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

RECORD_BYTES = 4096  # what each entry claims; the segment file is sparse, so nothing is written
BATCH = 200_000


def grow_index(data_dir: Path, total: int, have: int, rng: np.random.Generator) -> list[bytes]:
    """Add `total - have` random keys to the stopped daemon's index; returns a sample of the new keys."""
    env = lmdb.open(str(data_dir / "index"), map_size=1 << 40, max_dbs=4, sync=False, metasync=False)
    blocks, meta = env.open_db(b"blocks"), env.open_db(b"meta")
    with env.begin(db=meta) as txn:
        class_id = int(txn.get(b"class:chat"))
    segment = next((data_dir / "segments").glob("*.sealed"))
    segment_id = int(segment.stem.split("-")[0])
    expires_ms = int((time.time() + 6 * 86400) * 1000)
    now_ms = int(time.time() * 1000)
    sample: list[bytes] = []
    added = 0
    while have + added < total:
        n = min(BATCH, total - have - added)
        raw = rng.bytes(16 * n)
        keys = sorted(raw[i * 16 : (i + 1) * 16] for i in range(n))
        parents = rng.bytes(16 * n)  # every stored entry names its prefix parent
        items = [(k, Entry(segment_id, (have + added + i) * RECORD_BYTES, 256, RECORD_BYTES - 256,
                           expires_ms, now_ms, class_id, parents[i * 16 : (i + 1) * 16]).pack())
                 for i, k in enumerate(keys)]
        with env.begin(write=True, db=blocks) as txn:
            txn.cursor().putmulti(items, dupdata=False, overwrite=True)
        sample += keys[:: max(1, n // 2000)]
        added += n
        print(f"  index: {have + added:,} of {total:,} entries", end="\r", file=sys.stderr)
    print(file=sys.stderr)
    env.close()
    os.truncate(segment, total * RECORD_BYTES)  # sparse: every entry points at a whole "record"
    return sample


def index_bytes_per_block(data_dir: Path, entries: int) -> tuple[float, float]:
    """Live LMDB pages per block, and the data file's size per block (which also holds free pages)."""
    env = lmdb.open(str(data_dir / "index"), readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        stats = [txn.stat(env.open_db(name, txn=txn, create=False)) for name in (b"blocks", b"meta")] + [env.stat()]
    page = env.stat()["psize"]
    live = sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"] for s in stats) * page
    file_bytes = (env.info()["last_pgno"] + 1) * page
    env.close()
    return live / entries, file_bytes / entries


def raw_lmdb_ms(data_dir: Path, prefixes: list[list[bytes]]) -> list[float]:
    env = lmdb.open(str(data_dir / "index"), readonly=True, lock=False, max_dbs=4)
    blocks = env.open_db(b"blocks", create=False)
    times = []
    for keys in prefixes:
        started = time.perf_counter()
        with env.begin(db=blocks, buffers=True) as txn:
            for key in keys:
                if txn.get(key) is None:
                    break
        times.append((time.perf_counter() - started) * 1000)
    env.close()
    return times


def rpc_ms(address: str, prefixes: list[list[bytes]]) -> list[float]:
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        lookup = channel.unary_unary(method("Lookup"), pb.LookupRequest.SerializeToString, pb.LookupResponse.FromString)
        for keys in prefixes[:10]:  # warm-up: connection, page cache
            lookup(pb.LookupRequest(keys=keys), timeout=30)
        times = []
        for keys in prefixes:
            started = time.perf_counter()
            hits = lookup(pb.LookupRequest(keys=keys), timeout=30).hits
            times.append((time.perf_counter() - started) * 1000)
            assert hits == len(keys), f"only {hits} of {len(keys)} keys found"
    return times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e5,1e6,1e7", help="index sizes, in blocks")
    parser.add_argument("--prefix", type=int, default=1000, help="blocks per looked-up prefix")
    parser.add_argument("--lookups", type=int, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-lookup-bench-"))
    daemon = DaemonProcess(workdir / "data", workdir, ["--hot-tier-bytes", "0", "--capacity-bytes", "100TiB",
                                                        "--max-keys-per-request", str(max(args.prefix, 1000))])
    report: dict = {"prefix_blocks": args.prefix, "lookups": args.lookups, "sizes": {}}
    try:
        daemon.start()  # lays out the data directory: index, classes, segments/
        daemon.stop()
        (daemon.data_dir / "segments" / f"{1:010d}-{2**40}.sealed").touch()
        sample: list[bytes] = []
        have = 0
        print(f"\n{'blocks':>12} {'rpc p50 ms':>11} {'rpc p99 ms':>11} {'lmdb p50 ms':>12} {'lmdb p99 ms':>12} "
              f"{'rpc/lmdb p50':>13} {'start-up s':>11} {'index B/block':>14} {'file B/block':>13}")
        for size in sizes:
            sample += grow_index(daemon.data_dir, size, have, rng)
            have = size
            started = time.perf_counter()
            daemon.start(timeout_s=1800)
            startup_s = time.perf_counter() - started
            prefixes = [[sample[j] for j in rng.choice(len(sample), args.prefix, replace=False)]
                        for _ in range(args.lookups)]
            rpc = rpc_ms(daemon.address, prefixes)
            daemon.stop(timeout_s=600)
            raw = raw_lmdb_ms(daemon.data_dir, prefixes)
            bytes_per_block, file_bytes_per_block = index_bytes_per_block(daemon.data_dir, size)
            row = {"rpc_p50_ms": pct(rpc, 0.5), "rpc_p99_ms": pct(rpc, 0.99), "lmdb_p50_ms": pct(raw, 0.5),
                   "lmdb_p99_ms": pct(raw, 0.99), "rpc_over_lmdb_p50": pct(rpc, 0.5) / pct(raw, 0.5),
                   "startup_s": startup_s, "index_bytes_per_block": bytes_per_block,
                   "index_file_bytes_per_block": file_bytes_per_block,
                   "rpc_mean_ms": statistics.fmean(rpc)}
            report["sizes"][str(size)] = row
            print(f"{size:>12,} {row['rpc_p50_ms']:>11.2f} {row['rpc_p99_ms']:>11.2f} {row['lmdb_p50_ms']:>12.2f} "
                  f"{row['lmdb_p99_ms']:>12.2f} {row['rpc_over_lmdb_p50']:>13.2f} {startup_s:>11.1f} "
                  f"{bytes_per_block:>14.1f} {file_bytes_per_block:>13.1f}")
    finally:
        daemon.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    largest = report["sizes"][str(sizes[-1])]
    label = f"{sizes[-1] // 1_000_000}M" if sizes[-1] >= 1_000_000 else str(sizes[-1])
    report[f"lookup_p99_ms_{label}"] = largest["rpc_p99_ms"]
    report[f"lookup_p50_ms_{label}"] = largest["rpc_p50_ms"]
    report["index_bytes_per_block"] = largest["index_bytes_per_block"]
    print(f"\nlookup_p99_ms_{label} = {largest['rpc_p99_ms']:.2f}   index_bytes_per_block = "
          f"{largest['index_bytes_per_block']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
