"""Soak: a bounded mixed load against 2 daemons, one of them restarted again and again, every byte checked.

    python bench/soak.py [--minutes 10] [--clients 4] [--restart-every 20] [--json out.json]

Client processes put prompts (some extending an earlier one, so prefixes are shared), get them back,
look them up and delete them, each in its own tenant namespace, against two kvstore-server daemons. The
payload of a block is a pure function of its key, so every byte any get returns is compared with what
was put, without keeping the bytes. Lookups of prompts never put must find nothing. Daemon "steady" runs
the whole time; daemon "restarted" is stopped every --restart-every seconds, by SIGTERM and by kill -9 in
turn, its data directory checked with fsck, and started again (its share of blocks is a set of misses
meanwhile, never an error in the clients' path).

Every --sample-every seconds the RSS and the open file descriptors of each daemon are read from /proc;
the report compares the median of the last third of the samples with the first third, after a warm-up
(the run's first 10% or 10 s, and the first seconds of each incarnation of a restarted daemon), and says
whether each stayed flat. Errors are counted by type ("get:UNAVAILABLE", "wrong_bytes", ...).
Exit status 1 if a wrong byte was served, a prompt never put was found, an fsck failed or a SIGTERM did
not shut down cleanly.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.block import Block, KVLayout, Namespace  # noqa: E402
from kvstore.server.fsck import check  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

MiB = 2**20
LAYOUT = KVLayout(num_layers=4, kv_heads=2, head_dim=64, dtype="float16")
BLOCK_TOKENS = 32  # 16 KiB a layer, 64 KiB a block
MAX_PROMPT_BLOCKS = 8
OPS = {"put": 0.3, "get": 0.4, "lookup": 0.2, "delete": 0.1}
CRITICAL = ("wrong_bytes", "phantom_hit", "lookup_over_length", "fsck", "unclean_shutdown")
RSS_TOLERANCE = (1.10, 16 * MiB)  # flat: last-third median <= first-third median * 1.10 + 16 MiB
FD_TOLERANCE = (1.10, 8)  # flat: last-third median <= first-third median * 1.10 + 8 (connections come and go)


# -- the clients --------------------------------------------------------------------------------------


def payload_of(block: Block, nbytes: int) -> bytes:
    """The payload a block always carries: a pure function of its key, so readers need not keep it."""
    return random.Random(block.key).randbytes(nbytes)


@dataclass
class ClientTally:
    worker: int
    ops: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    blocks_checked: int = 0
    bytes_checked: int = 0
    blocks_missed: int = 0  # asked for by a get, not served (a restarted daemon, eviction, a delete)
    miss_causes: Counter = field(default_factory=Counter)  # the client library's verified-miss causes

    def as_dict(self) -> dict:  # plain dicts cross the process boundary (dataclasses.asdict mangles Counters)
        return {name: dict(value) if isinstance(value, Counter) else value for name, value in vars(self).items()}


def client_loop(worker: int, servers: tuple[str, ...], stop: mp.Event, reports: mp.Queue, seed: int) -> None:
    from kvstore.client import ClientConfig, KVClient

    rng = random.Random(seed)
    namespace = Namespace("soak-model", LAYOUT, BLOCK_TOKENS, salt=f"tenant-{worker}")
    nobody = Namespace("soak-model", LAYOUT, BLOCK_TOKENS, salt=f"never-put-{worker}")  # no client puts here
    block_bytes = namespace.block_bytes
    base = worker << 26  # each worker's token ids, below 2**32 for 64 workers
    prompts: list[list[int]] = []  # the token ids of each prompt this worker holds
    next_token = base
    tally = ClientTally(worker)
    config = ClientConfig(servers, timeout_s=5, lookup_timeout_s=2, down_backoff_s=0.2, max_down_backoff_s=1.0)
    with KVClient(config) as client:
        seen_failures: Counter = Counter()  # daemon address -> failed calls counted so far
        last_report = time.monotonic()
        while not stop.is_set():
            op = rng.choices(list(OPS), weights=list(OPS.values()))[0] if prompts else "put"
            try:
                if op == "put":
                    length = rng.randint(1, MAX_PROMPT_BLOCKS) * BLOCK_TOKENS
                    extend = prompts and rng.random() < 0.3
                    tokens = (rng.choice(prompts) if extend else []) + list(range(next_token, next_token + length))
                    next_token += length
                    tokens = tokens[: MAX_PROMPT_BLOCKS * 2 * BLOCK_TOKENS]
                    blocks = namespace.blocks(tokens)
                    summary = client.put([(b, payload_of(b, block_bytes)) for b in blocks], LAYOUT.num_layers)
                    tally.errors["put:failed_blocks"] += summary.failed
                    prompts.append(tokens)
                    if len(prompts) > 64:  # bounded: forget the oldest (eviction deals with its blocks)
                        prompts.pop(0)
                elif op == "get":
                    blocks = namespace.blocks(rng.choice(prompts))
                    got = client.get(blocks)
                    for data in got:
                        tally.blocks_checked += 1
                        tally.bytes_checked += len(data.payload)
                        if bytes(data.payload) != payload_of(data.block, block_bytes):
                            tally.errors["wrong_bytes"] += 1
                    tally.blocks_missed += len(blocks) - len(got)
                elif op == "lookup":
                    tokens = rng.choice(prompts)
                    if client.lookup(namespace.blocks(tokens)) > len(tokens) // BLOCK_TOKENS:
                        tally.errors["lookup_over_length"] += 1
                    if client.lookup(nobody.blocks(tokens)):
                        tally.errors["phantom_hit"] += 1
                else:
                    client.delete(namespace.blocks(prompts.pop(rng.randrange(len(prompts)))))
            except Exception as exc:  # the client promises not to raise on a daemon's failure: count it
                tally.errors[f"{op}:raised:{type(exc).__name__}"] += 1
            tally.ops[op] += 1
            new_failures = client.stats.shard_errors - seen_failures
            if new_failures:
                last = client.last_errors()
                for address, count in new_failures.items():  # by status code: "get:UNAVAILABLE"
                    tally.errors[f"{op}:{last.get(address, 'unknown').split(':', 1)[0]}"] += count
                seen_failures = Counter(client.stats.shard_errors)
            if time.monotonic() - last_report >= 1.0:
                tally.miss_causes = Counter(client.stats.miss_causes)
                reports.put(tally.as_dict())
                last_report = time.monotonic()
        tally.miss_causes = Counter(client.stats.miss_causes)
    reports.put(tally.as_dict())


# -- the daemons --------------------------------------------------------------------------------------


@dataclass
class Watched:
    name: str
    daemon: DaemonProcess
    started_at: float = 0.0  # monotonic time of the current incarnation's start
    samples: list[dict] = field(default_factory=list)  # t, pid, rss_bytes, fds, uptime_s

    def sample(self, t: float) -> dict | None:
        proc = self.daemon.proc
        if proc is None or proc.poll() is not None:
            return None
        try:
            rss = self.daemon.rss_bytes()
            fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        except OSError:  # it died between the check and the read
            return None
        row = {"t": round(t, 2), "pid": proc.pid, "rss_bytes": rss, "fds": fds,
               "uptime_s": round(time.monotonic() - self.started_at, 2)}
        self.samples.append(row)
        return row


def restart(watched: Watched, kind: str, errors: Counter) -> dict:
    """Stop a daemon (SIGTERM or kill -9), fsck its data, start it again; what happened."""
    daemon = watched.daemon
    began = time.monotonic()
    if kind == "kill":
        daemon.kill()
        code = -9
    else:
        code = daemon.stop(timeout_s=60)
        if code != 0:
            errors["unclean_shutdown"] += 1
    report = check(daemon.data_dir)
    if not report.ok:
        errors["fsck"] += 1
    daemon.start(timeout_s=120)
    watched.started_at = time.monotonic()
    return {"kind": kind, "exit_code": code, "fsck_ok": report.ok, "fsck_problems": report.problems[:3],
            "entries": report.entries, "down_s": round(time.monotonic() - began, 2)}


def flatness(watched: Watched, warmup_s: float, incarnation_warmup_s: float) -> dict:
    steady = [s for s in watched.samples if s["t"] >= warmup_s and s["uptime_s"] >= incarnation_warmup_s]
    if len(steady) < 6:
        return {"samples": len(steady), "verdict": "too few samples"}
    third = len(steady) // 3
    first, last = steady[:third], steady[-third:]

    def median(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    rss_first, rss_last = median(first, "rss_bytes"), median(last, "rss_bytes")
    fds_first, fds_last = median(first, "fds"), median(last, "fds")
    rss_flat = rss_last <= rss_first * RSS_TOLERANCE[0] + RSS_TOLERANCE[1]
    fds_flat = fds_last <= fds_first * FD_TOLERANCE[0] + FD_TOLERANCE[1]
    return {"samples": len(steady), "rss_first_mib": rss_first / MiB, "rss_last_mib": rss_last / MiB,
            "rss_max_mib": max(s["rss_bytes"] for s in watched.samples) / MiB,
            "fds_first": fds_first, "fds_last": fds_last, "fds_max": max(s["fds"] for s in watched.samples),
            "rss_flat": rss_flat, "fds_flat": fds_flat,
            "verdict": "flat" if rss_flat and fds_flat else "GROWING"}


# -- the run ------------------------------------------------------------------------------------------


def merge(tallies: dict[int, dict]) -> dict:
    """The latest tally (ClientTally as a dict) of every client, added up."""
    ops, errors, causes = Counter(), Counter(), Counter()
    for tally in tallies.values():
        ops.update(tally["ops"])
        errors.update(tally["errors"])
        causes.update(tally["miss_causes"])
    return {"ops": dict(ops), "errors": {k: v for k, v in errors.items() if v},
            "blocks_checked": sum(t["blocks_checked"] for t in tallies.values()),
            "bytes_checked": sum(t["bytes_checked"] for t in tallies.values()),
            "blocks_missed": sum(t["blocks_missed"] for t in tallies.values()), "client_miss_causes": dict(causes)}


def progress(elapsed: float, total: float, totals: dict, watched: list[Watched], restarts: int) -> str:
    rss = " ".join(f"{w.name} {w.samples[-1]['rss_bytes'] / MiB:.0f}MiB/{w.samples[-1]['fds']}fd"
                   if w.samples else f"{w.name} -" for w in watched)
    errors = sum(totals["errors"].values())
    return (f"[{elapsed:6.0f}/{total:.0f} s] ops {sum(totals['ops'].values()):,}  checked "
            f"{totals['blocks_checked']:,} blocks ({totals['bytes_checked'] / 2**30:.2f} GiB)  missed "
            f"{totals['blocks_missed']:,}  errors {errors:,}  restarts {restarts}  {rss}")


def print_report(report: dict) -> None:
    totals, seconds = report["totals"], report["seconds"]
    print(f"\nsoak: {seconds:.0f} s, {report['clients']} client processes, 2 daemons, "
          f"{len(report['restarts'])} restarts of 'restarted' "
          f"({sum(r['kind'] == 'kill' for r in report['restarts'])} kill -9, "
          f"{sum(r['kind'] == 'term' for r in report['restarts'])} SIGTERM)")
    print(f"\n{'op':<8} {'count':>10} {'per s':>8}")
    for op in OPS:
        count = totals["ops"].get(op, 0)
        print(f"{op:<8} {count:>10,} {count / seconds:>8.1f}")
    print(f"\nblocks checked {totals['blocks_checked']:,} ({totals['bytes_checked'] / 2**30:.2f} GiB, every byte),"
          f" missed {totals['blocks_missed']:,}; client miss causes {totals['client_miss_causes'] or '{}'}")
    print(f"\n{'error':<34} {'count':>8}")
    for name, count in sorted(totals["errors"].items(), key=lambda kv: -kv[1]) or [("(none)", 0)]:
        flag = "  <-- must be 0" if name in CRITICAL else ""
        print(f"{name:<34} {count:>8,}{flag}")
    print(f"\n{'daemon':<10} {'samples':>7} {'RSS first':>10} {'RSS last':>9} {'RSS max':>8} {'fds first':>9} "
          f"{'fds last':>8} {'fds max':>7} {'tracebacks':>10}  verdict")
    for name, flat in report["daemons"].items():
        if "rss_first_mib" not in flat:
            print(f"{name:<10} {flat['samples']:>7}  {flat['verdict']}")
            continue
        print(f"{name:<10} {flat['samples']:>7} {flat['rss_first_mib']:>8.0f}Mi {flat['rss_last_mib']:>7.0f}Mi "
              f"{flat['rss_max_mib']:>6.0f}Mi {flat['fds_first']:>9.0f} {flat['fds_last']:>8.0f} "
              f"{flat['fds_max']:>7} {flat['tracebacks']:>10}  {flat['verdict']}")
    print(f"\nresult: {'FAIL' if report['failed'] else 'ok'}"
          + (f" ({', '.join(report['failed'])})" if report["failed"] else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--restart-every", type=float, default=20.0, help="seconds between restarts")
    parser.add_argument("--sample-every", type=float, default=2.0, help="seconds between /proc samples")
    parser.add_argument("--capacity", default="256MiB", help="each daemon's byte budget (evictions happen)")
    parser.add_argument("--hot-tier", default="32MiB",
                        help="each daemon's DRAM tier: small, so that it is full before the warm-up ends")
    parser.add_argument("--durability", choices=["os", "fsync"], default="os")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the data directories and logs")
    parser.add_argument("--json", type=Path, help="write the totals, restarts, samples and verdicts here")
    args = parser.parse_args()
    total_s = args.minutes * 60
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-soak-"))
    daemon_args = ["--capacity-bytes", args.capacity, "--hot-tier-bytes", args.hot_tier, "--segment-bytes", "16MiB",
                   "--durability", args.durability]
    watched = [Watched(name, DaemonProcess(workdir / name, workdir, daemon_args)) for name in ("steady", "restarted")]
    ctx = mp.get_context("spawn")  # no fork of a process that may hold gRPC threads
    stop, reports = ctx.Event(), ctx.Queue()
    tallies: dict[int, dict] = {}
    restarts: list[dict] = []
    daemon_errors: Counter = Counter()
    workers = []
    began = time.monotonic()
    try:
        for w in watched:
            w.daemon.start()
            w.started_at = time.monotonic()
        servers = tuple(w.daemon.address for w in watched)
        workers = [ctx.Process(target=client_loop, args=(i, servers, stop, reports, args.seed * 1000 + i))
                   for i in range(args.clients)]
        for worker in workers:
            worker.start()
        began = time.monotonic()
        next_sample, next_restart, next_line = began, began + args.restart_every, began
        tty = sys.stderr.isatty()
        while (now := time.monotonic()) < began + total_s:
            while True:
                try:
                    tally = reports.get(timeout=max(0.0, min(next_sample, next_restart) - time.monotonic()))
                    tallies[tally["worker"]] = tally
                except queue.Empty:
                    break
            now = time.monotonic()
            if now >= next_sample:
                for w in watched:
                    w.sample(now - began)
                totals = merge(tallies)
                totals["errors"] = {**totals["errors"], **daemon_errors}
                line = progress(now - began, total_s, totals, watched, len(restarts))
                if tty:
                    print("\r" + line, end="", file=sys.stderr, flush=True)
                elif now >= next_line:  # a log, not a terminal: a line every 15 s
                    print(line, file=sys.stderr, flush=True)
                    next_line = now + 15
                next_sample = now + args.sample_every
            if now >= next_restart and now + 5 < began + total_s:
                kind = "kill" if len(restarts) % 2 == 0 else "term"
                restarts.append({"t": round(now - began, 2), **restart(watched[1], kind, daemon_errors)})
                next_restart = time.monotonic() + args.restart_every
    finally:
        stop.set()
        deadline = time.monotonic() + 60
        while any(worker.is_alive() for worker in workers) and time.monotonic() < deadline:
            try:
                tally = reports.get(timeout=0.5)
                tallies[tally["worker"]] = tally
            except queue.Empty:
                pass
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
        while True:
            try:
                tally = reports.get_nowait()
                tallies[tally["worker"]] = tally
            except queue.Empty:
                break
        seconds = time.monotonic() - began
        for w in watched:
            if w.daemon.stop(timeout_s=60) != 0:
                daemon_errors["unclean_shutdown"] += 1
            if not check(w.daemon.data_dir).ok:
                daemon_errors["fsck"] += 1
        print(file=sys.stderr)

    warmup_s = max(10.0, total_s * 0.1)
    daemons = {}
    for w in watched:
        daemons[w.name] = flatness(w, warmup_s, incarnation_warmup_s=5.0 if w.name == "restarted" else 0.0)
        daemons[w.name]["tracebacks"] = w.daemon.log().count("Traceback")
    totals = merge(tallies)
    totals["errors"] = {**totals["errors"], **{k: v for k, v in daemon_errors.items() if v}}
    failed = [name for name in CRITICAL if totals["errors"].get(name)]
    failed += [f"{name}: {flat['tracebacks']} tracebacks in its log" for name, flat in daemons.items()
               if flat["tracebacks"]]
    report = {"minutes": args.minutes, "seconds": seconds, "clients": args.clients, "capacity": args.capacity,
              "hot_tier": args.hot_tier,
              "durability": args.durability, "restart_every_s": args.restart_every, "totals": totals,
              "restarts": restarts, "daemons": daemons, "failed": failed,
              "samples": {w.name: w.samples for w in watched}}
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if args.keep:
        print(f"data and logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
