"""Data-plane throughput of one kvstore-server on loopback beside raw TCP, raw file I/O, Redis and Mooncake Store.

    python bench/dataplane.py [--sizes 1,4,16] [--repeats 5] [--json out.json]

For each block size, every contender stores the same blocks and reads them back, one block per call
("op", giving p50/p99 latency) and in batches ("batch": our prefix read, Redis MGET, Mooncake's
zero-copy batch_get_into, pipelined raw TCP). Puts too, one block per call and in batches (ours: a
prompt's blocks in one call, as an engine puts them; the others one after another); a put ratio takes
each system's faster put. Our put's CPU time, client and daemon, is measured too: on 2 cores no overlap
can beat (that CPU time) / cores (`put_cpu_bound_GBps`). Every contender gets the same warm-up pass and the same
pre-touched destination buffers (fresh memory on these VMs costs ~3 us per 4 KiB page to fault in).
Our reads are verified (header and per-layer checksums); the peers' are not. "kvstore" reads as a
remote client would (raw-TCP data channel): the headline ratios use it. "kvstore (shm)" reads into a
shared buffer the daemon writes into directly, the same-host path. Puts use fresh names
every repeat. Repeats interleave the contenders, so that drift in these shared machines' speed hits
them all alike. Figures are medians over repeats with [min, max]; ratios are ours over theirs, each
system at its faster Get path. Run bench/setup_peers.sh first for Redis and Mooncake.

"raw file" appends the same blocks to files on the same file system and keeps them, as the daemon keeps
its segments; "raw file (O_DIRECT)" writes them through one reused aligned buffer, straight to the device.
A durable put must cross the wire and land on the device, so `put_vs_bound` divides our put by the slower
of raw TCP and the O_DIRECT writes. (Buffered appends are slower still on these VMs while the guest has
memory it never touched: each such page costs the hypervisor ~2.5 us on first touch.) Mooncake's put
depends on the same thing, so it runs twice: "Mooncake" as started, "Mooncake (warm)" after a pass of
puts of its own has touched its memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peers import Contender, KVStoreDaemon, Mooncake, RawFile, RawTCP, Redis  # noqa: E402

MiB = 2**20


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Run:
    """One contender at one block size: its names, buffers and the samples of every repeat."""

    def __init__(self, contender: Contender, size: int, count: int, batch: int, repeats: int) -> None:
        self.contender, self.size, self.count, self.batch = contender, size, count, batch
        # a repeat's names, for single puts; and as many more for batched puts (fresh names every time)
        self.names = [list(range(r * count, (r + 1) * count)) for r in range(repeats + 1)]
        self.batch_names = [list(range((repeats + 1 + r) * count, (repeats + 2 + r) * count))
                            for r in range(repeats + 1)]
        self.whole = contender.memory(count * size) or memoryview(bytearray(count * size))
        self.whole[:] = b"\x01" * len(self.whole)  # pre-touched
        self.bufs = [self.whole[i * size : (i + 1) * size] for i in range(count)]
        self.put_rates: list[float] = []
        self.put_batch_rates: list[float] = []
        self.put_cpu_s: list[float] = []  # CPU seconds (client and servers) per byte put, where known
        self.op_rates: list[float] = []
        self.batch_rates: list[float] = []
        self.latencies: list[float] = []

    def warm_up(self, payload: bytes) -> None:
        """One full pass of every operation, on names of its own."""
        self.contender.prepare(self.size, 2 * len(self.names) * self.count)
        self.contender.register(self.whole)
        for name in self.names[0]:
            self.contender.put(name, payload)
        self.contender.put_many(self.batch_names[0][: self.batch], payload)
        for name, buf in zip(self.names[0], self.bufs):
            self.contender.get(name, buf)
        self.contender.get_many(self.names[0][: self.batch], self.bufs[: self.batch])

    def repeat(self, r: int, payload: bytes) -> None:
        c, names, nbytes = self.contender, self.names[r], self.count * self.size
        cpu_before = c.cpu_seconds()
        self.put_rates.append(nbytes / sum(timed(lambda n=n: c.put(n, payload)) for n in names))
        if cpu_before is not None:
            self.put_cpu_s.append((c.cpu_seconds() - cpu_before) / nbytes)
        batched = self.batch_names[r]
        self.put_batch_rates.append(nbytes / sum(timed(lambda i=i: c.put_many(batched[i : i + self.batch], payload))
                                                 for i in range(0, self.count, self.batch)))
        op_times = [timed(lambda n=n, b=b: c.get(n, b)) for n, b in zip(names, self.bufs)]
        self.latencies += op_times
        self.op_rates.append(nbytes / sum(op_times))
        self.batch_rates.append(nbytes / sum(
            timed(lambda i=i: c.get_many(names[i : i + self.batch], self.bufs[i : i + self.batch]))
            for i in range(0, self.count, self.batch)))

    def result(self) -> dict:
        self.contender.clear([n for names in self.names + self.batch_names for n in names])
        latencies = sorted(self.latencies)
        cpu = {"put_cpu_ms_per_block": statistics.median(self.put_cpu_s) * self.size * 1000} if self.put_cpu_s else {}
        return {
            **cpu,
            "put_GBps": _summary(self.put_rates),
            "put_batch_GBps": _summary(self.put_batch_rates),
            "get_op_GBps": _summary(self.op_rates),
            "get_batch_GBps": _summary(self.batch_rates),
            "get_p50_ms": 1000 * latencies[len(latencies) // 2],
            "get_p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        }


def _attempt(fn, *args) -> bool:
    """Run one step of one contender; a failure drops that contender at that size, not the benchmark."""
    *fn_args, label, skipped = args
    try:
        fn(*fn_args)
        return True
    except Exception as exc:  # noqa: BLE001
        skipped[label] = repr(exc)
        print(f"{label} failed: {exc!r}", file=sys.stderr)
        return False


def _summary(rates: list[float]) -> dict:
    return {"median": statistics.median(rates) / 1e9, "min": min(rates) / 1e9, "max": max(rates) / 1e9}


def best_put(result: dict) -> float:
    return max(result["put_GBps"]["median"], result["put_batch_GBps"]["median"])


def best_get(result: dict) -> float:
    return max(result["get_op_GBps"]["median"], result["get_batch_GBps"]["median"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,4,16", help="block sizes in MiB")
    parser.add_argument("--bytes-per-repeat", type=int, default=128, help="MiB moved per repeat and size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="blocks per batched get")
    parser.add_argument("--only", default="", help="comma-separated contender names to run (e.g. 'kvstore,raw TCP')")
    parser.add_argument("--json", type=Path, help="write every figure and the headline ratios here")
    args = parser.parse_args()
    sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]
    max_size = max(sizes)

    contenders: list[Contender] = [RawTCP(max_size), RawFile(), RawFile(direct=True), KVStoreDaemon("tcp"),
                                   KVStoreDaemon("shm"), KVStoreDaemon("grpc"), Redis(), Mooncake(max_size, args.batch),
                                   Mooncake(max_size, args.batch, warm=True)]
    if args.only:
        wanted = {n.strip() for n in args.only.split(",")}
        contenders = [c for c in contenders if c.name in wanted]
    results: dict[str, dict[str, dict]] = {}
    skipped: dict[str, str] = {}
    started: list[Contender] = []
    for contender in contenders:
        try:
            contender.start()
            started.append(contender)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            skipped[contender.name] = str(exc)
            print(f"skipping {contender.name}: {exc}", file=sys.stderr)
    try:
        for size in sizes:
            payload = os.urandom(size)
            count = max(args.batch, args.bytes_per_repeat * MiB // size)
            runs = []
            for contender in started:
                run = Run(contender, size, count, args.batch, args.repeats)
                if _attempt(run.warm_up, payload, f"{contender.name} {size // MiB}MiB", skipped):
                    runs.append(run)
            # Repeats interleave the contenders, so that each repeat sees them all under the same load.
            for r in range(1, args.repeats + 1):
                print(f"{size // MiB} MiB x {count}: repeat {r}/{args.repeats}", file=sys.stderr)
                for run in list(runs):
                    if not _attempt(run.repeat, r, payload, f"{run.contender.name} {size // MiB}MiB", skipped):
                        runs.remove(run)
            for run in runs:
                results.setdefault(run.contender.name, {})[f"{size // MiB}MiB"] = run.result()
    finally:
        for contender in started:
            contender.stop()

    report = {"results": results, "skipped": skipped, "repeats": args.repeats, "batch": args.batch}
    print_table(results, sizes)
    ours = results.get("kvstore", {})
    for size in sizes:
        label = f"{size // MiB}MiB"
        if label not in ours:
            continue
        for peer, key in (("raw TCP", "tcp"), ("raw file", "file"), ("raw file (O_DIRECT)", "odirect"),
                          ("Redis", "redis"), ("Mooncake", "mooncake"), ("Mooncake (warm)", "mooncake_warm")):
            theirs = results.get(peer, {}).get(label)
            if theirs:
                report[f"get_vs_{key}_{label}"] = best_get(ours[label]) / best_get(theirs)
                report[f"put_vs_{key}_{label}"] = best_put(ours[label]) / best_put(theirs)
                report[f"{key}_get_GBps_{label}"] = best_get(theirs)
                report[f"{key}_put_GBps_{label}"] = best_put(theirs)
        report[f"kvstore_get_GBps_{label}"] = best_get(ours[label])
        report[f"kvstore_put_GBps_{label}"] = best_put(ours[label])
        if "put_cpu_ms_per_block" in ours[label]:
            # However well a put overlaps its parts, their CPU time (both ends) must fit on this machine's cores.
            cpu_s = ours[label]["put_cpu_ms_per_block"] / 1000
            report[f"kvstore_put_cpu_ms_{label}"] = cpu_s * 1000
            report[f"put_cpu_bound_GBps_{label}"] = size / (cpu_s / (os.cpu_count() or 1)) / 1e9
            report[f"put_vs_cpu_bound_{label}"] = best_put(ours[label]) / report[f"put_cpu_bound_GBps_{label}"]
    print()
    for key in ("get_vs_tcp_4MiB", "get_vs_redis_4MiB", "get_vs_mooncake_4MiB", "put_vs_tcp_4MiB",
                "put_vs_file_4MiB", "put_vs_odirect_4MiB", "put_vs_mooncake_4MiB", "put_vs_mooncake_warm_4MiB",
                "kvstore_put_cpu_ms_4MiB", "put_cpu_bound_GBps_4MiB", "put_vs_cpu_bound_4MiB"):
        if key in report:
            print(f"{key:>22} = {report[key]:.2f}")
    if "put_vs_tcp_4MiB" in report and "put_vs_odirect_4MiB" in report:
        # A durable put crosses the wire and lands on the device: it can go no faster than the slower of the two.
        bound = min(report["tcp_put_GBps_4MiB"], report["odirect_put_GBps_4MiB"])
        report["put_vs_bound_4MiB"] = report["kvstore_put_GBps_4MiB"] / bound
        print(f"{'put_vs_bound_4MiB':>22} = {report['put_vs_bound_4MiB']:.2f}  (bound: min(raw TCP, raw file "
              f"(O_DIRECT)) = {bound:.2f} GB/s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


def print_table(results: dict, sizes: list[int]) -> None:
    print(f"\n{'contender':>18} {'size':>6} {'put GB/s':>20} {'put/batch GB/s':>20} {'get/op GB/s':>20} "
          f"{'get/batch GB/s':>20} {'p50 ms':>7} {'p99 ms':>7}")
    for name, by_size in results.items():
        for size in sizes:
            r = by_size.get(f"{size // MiB}MiB")
            if r is None:
                continue
            cell = lambda s: f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"  # noqa: E731
            print(f"{name:>18} {size // MiB:>4}Mi {cell(r['put_GBps']):>20} {cell(r['put_batch_GBps']):>20} "
                  f"{cell(r['get_op_GBps']):>20} "
                  f"{cell(r['get_batch_GBps']):>20} {r['get_p50_ms']:>7.2f} {r['get_p99_ms']:>7.2f}")


if __name__ == "__main__":
    main()
