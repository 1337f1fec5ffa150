"""The prefix hit rate while a daemon joins and leaves, on the replayed conversation trace.

    python bench/membership_hitrate.py [--requests 12031] [--json out.json] [--plot out.png]

Replays of the same requests through real daemons, as an engine serves them (Lookup, Get of the hit,
Put of the rest; kvstore/analytics/drive.py's loop, 4 KiB payloads, room for everything):
* baseline: three daemons throughout;
* the changing runs: three daemons registered in a real etcd, the client following the prefix; a fourth
  daemon registers after a third of the requests and stops (SIGTERM: its lease revoked) after two
  thirds, N = 3 -> 4 -> 3; three ways:
  - "no handoff": the client only follows (ClientConfig.handoff_s ~ 0), moved blocks miss;
  - "handoff": moved blocks are looked for on their previous owners and copied to their new ones;
  - "handoff + drain": the same, and the leaving daemon serves 30 s more out of the membership
    (--leave-drain-s 30), so the blocks first stored on it can be copied away too.
Printed per phase: the block-weighted prefix hit rate of each and its ratio to the baseline, including
the first 500 requests after each change; and how long the client took to see each change (daemon
started -> client uses it; SIGTERM -> client stops using it). The trace is replayed as fast as it goes
(about 30 requests/s here), so a change takes effect between requests, once the client has seen it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.analytics.trace import CONVERSATION_TRACE, read_trace  # noqa: E402
from kvstore.block import KVLayout, Namespace  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402
from tests.peers import EtcdServer  # noqa: E402  (a real etcd on loopback, as the tests run it)

BLOCK_TOKENS = 512
WINDOW = 500


def serve(client: KVClient, namespace: Namespace, request) -> tuple[int, int]:
    """One request as an engine serves it: (hit blocks, full blocks)."""
    full = request.input_length // BLOCK_TOKENS
    tokens = [t for key in request.hash_ids[:full] for t in (key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF)]
    blocks = namespace.blocks(tokens)
    hit = len(client.get(blocks[: client.lookup(blocks)])) if blocks else 0
    if blocks[hit:]:
        client.put([(block, bytes(namespace.block_bytes)) for block in blocks[hit:]], 1, request.traffic_class)
    return hit, len(blocks)


def until(condition, timeout_s: float = 30.0) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError("the client did not see the membership change")
        time.sleep(0.005)
    return time.monotonic() - started


def replay(requests, folder: Path, changing: bool, handoff: bool = True, drain_s: float = 0.0) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    namespace = Namespace("membership-hitrate", KVLayout(1, 1, 256, "float16"), block_tokens=2)
    etcd = EtcdServer(folder) if changing else None
    started: list[DaemonProcess] = []

    def daemon(i: int, *args: str) -> DaemonProcess:
        process = DaemonProcess(folder / f"daemon{i}", folder, list(args))
        started.append(process.start())
        return process

    try:
        target = f"etcd://{etcd.endpoint}/kvstore/members" if etcd else None
        register = ["--register", target] if target else []
        cluster = [daemon(i, *register) for i in range(3)]
        servers = target or ",".join(d.address for d in cluster)
        config = ClientConfig(servers, timeout_s=30, handoff_s=600.0 if handoff else 1e-9)
        hits, blocks, seen = [], [], {}
        join_at, leave_at = len(requests) // 3, 2 * len(requests) // 3
        with KVClient(config) as client:
            until(lambda: len(client._async.shards) == 3)
            fourth = None
            for number, request in enumerate(requests):
                if changing and number == join_at:
                    t0 = time.monotonic()
                    fourth = daemon(3, *register, "--leave-drain-s", str(drain_s))  # returns once it serves
                    until(lambda: fourth.address in client._async.shards)
                    seen["join_s"] = time.monotonic() - t0
                if changing and number == leave_at:
                    t0 = time.monotonic()
                    fourth.proc.send_signal(15)
                    until(lambda: fourth.address not in client._async.shards)
                    seen["leave_s"] = time.monotonic() - t0
                hit, full = serve(client, namespace, request)
                hits.append(hit)
                blocks.append(full)
        return {"hits": hits, "blocks": blocks, **seen}
    finally:
        for process in started:
            try:
                process.stop(timeout_s=60)
            except Exception:  # noqa: BLE001 - stopped already, or it must die anyway
                process.kill()
        if etcd is not None:
            etcd.stop()


def rate(run: dict, begin: int, end: int) -> float:
    return sum(run["hits"][begin:end]) / max(1, sum(run["blocks"][begin:end]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12031)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    requests = list(itertools.islice(read_trace(CONVERSATION_TRACE), args.requests))
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        base = replay(requests, Path(folder) / "baseline", changing=False)
        for name, handoff, drain_s in (("no handoff", False, 0.0), ("handoff", True, 0.0),
                                       ("handoff + drain", True, 30.0)):
            runs[name] = replay(requests, Path(folder) / name.replace(" ", "_"), True, handoff, drain_s)
    n = len(requests)
    join, leave = n // 3, 2 * n // 3
    phases = {"N=3 (before)": (0, join), "N=4 (joined)": (join, leave), "N=3 (left)": (leave, n),
              f"first {WINDOW} after the join": (join, join + WINDOW),
              f"first {WINDOW} after the leave": (leave, leave + WINDOW), "whole trace": (0, n)}
    out = {"requests": n, "seen_s": {name: {"join": r["join_s"], "leave": r["leave_s"]} for name, r in runs.items()},
           "phases": {}}
    print(f"{n} requests of the conversation trace; a fourth daemon joins at request {join} and leaves at {leave}")
    for name, run in runs.items():
        print(f"{name}: the client saw the join {run['join_s'] * 1000:.0f} ms after the daemon was started, "
              f"the leave {run['leave_s'] * 1000:.0f} ms after its SIGTERM")
    print(f"{'prefix hit rate':32} {'baseline':>9} " + " ".join(f"{name:>22}" for name in runs))
    for phase, (begin, end) in phases.items():
        theirs = rate(base, begin, end)
        row = {"baseline": theirs}
        cells = []
        for name, run in runs.items():
            ours = rate(run, begin, end)
            row[name] = {"hit_rate": ours, "over_baseline": ours / theirs if theirs else None}
            cells.append(f"{ours:.4f} ({ours / theirs if theirs else float('nan'):.3f}x)")
        out["phases"][phase] = row
        print(f"{phase:32} {theirs:9.4f} " + " ".join(f"{cell:>22}" for cell in cells))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        plot(base, runs, join, leave, args.plot)


def plot(base: dict, runs: dict[str, dict], join: int, leave: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for label, run in (("3 daemons throughout", base), *((f"3 -> 4 -> 3, {name}", r) for name, r in runs.items())):
        xs = list(range(0, len(run["hits"]) - WINDOW + 1, WINDOW // 5))
        ax.plot([x + WINDOW for x in xs], [rate(run, x, x + WINDOW) for x in xs], label=label)
    for x, what in ((join, "joins"), (leave, "leaves")):
        ax.axvline(x, color="grey", linestyle=":")
        ax.text(x, 0.02, f" 4th daemon {what}", rotation=90, va="bottom", fontsize=8)
    ax.set_xlabel("request")
    ax.set_ylabel(f"prefix hit rate, last {WINDOW} requests")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
