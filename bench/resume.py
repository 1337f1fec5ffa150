"""Resuming a hybrid model's conversations from the store: after restarts and across engine instances.

    python bench/resume.py [--sessions 4] [--turns 5] [--restart-after 3] [--block-tokens 256]
                           [--repeats 3] [--json out.json]

Real-text chat sessions on the real Gemma 3 270M (`bench/swa_replay.py`'s workload: standard-library
documentation through the chat template, sessions interleaved, shuffled per round), one daemon, each way
in a tenant of its own. A round is one turn of every session; the restart comes before round
`--restart-after` (counted from 0), and the turns of that round are the ones compared:

    A  host          one engine throughout: the windows come from its host tier
    B  engines       the engine (and its client, host tier included) restarted; the daemon kept
    C  all           the engine, its client and the daemon restarted
    D  two engines   two engines on one daemon, each session's turns alternating between them
    replay only      as B, without window records: where the window is gone, bounded replay (today)
    recompute only   as B, with neither: the whole prompt recomputed

Each way prints, over the compared turns, median TTFT and prefill FLOPs per turn (`bench/swa_replay.py`'s
count from the model's shape), the paths taken and where the windows came from; D also over every turn
after the first (all of them land on the engine that did not serve the turn before). Exactness: the
largest logit difference from A on the same turns. Figures, medians over repeats with their spread:

    resume_store_over_host       B's TTFT over A's (aim <= 1.3)
    resume_store_over_recompute  B's TTFT over recompute-only's (aim <= 0.25)
    store_bytes_per_session      one live window record per session, beside its chain's blocks
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.swa_replay import prefill_flops, workload  # noqa: E402
from engine.prefill.config import PrefillConfig  # noqa: E402
from engine.prefill.engine import PrefillEngine  # noqa: E402
from engine.prefill.request import PrefillRequest  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

WAYS = ("A host", "B engines", "C all", "D two engines", "replay only", "recompute only")


class Way:
    """One way of serving the workload: its engines, and what happens at the restart."""

    def __init__(self, name: str, model, model_id: str, config: PrefillConfig, daemon: DaemonProcess) -> None:
        self.name, self.model, self.model_id, self.daemon = name, model, model_id, daemon
        self.config = config
        if name == "replay only":
            self.config = replace(config, store_windows=False)
        elif name == "recompute only":
            self.config = replace(config, store_windows=False, replay_tokens=0)
        self.engines = [self._engine() for _ in range(2 if name.startswith("D") else 1)]

    def _engine(self) -> PrefillEngine:
        client = KVClient(ClientConfig(servers=(self.daemon.address,)))
        return PrefillEngine(self.model, client, self.config, self.model_id)

    def restart(self) -> None:
        if self.name.startswith(("A", "D")):
            return
        self.close()
        if self.name.startswith("C"):
            self.daemon.stop()
            self.daemon.start()
        self.engines = [self._engine()]

    def engine_for(self, turn: int) -> PrefillEngine:
        return self.engines[turn % len(self.engines)]

    def close(self) -> None:
        for engine in self.engines:
            engine.client.close()


def serve(way: Way, requests, restart_at: int, salt: str) -> list[dict]:
    records = []
    for name, turn, prompt in requests:
        if turn == restart_at and not any(r["turn"] == turn for r in records):
            way.restart()
        engine = way.engine_for(turn)
        result = engine.prefill(PrefillRequest(prompt, salt=salt, session_id=f"{salt}/{name}", turn=turn))
        result.kv.release()
        engine.client.write_behind.flush(timeout=120)  # saves would otherwise run beside the next request
        start = result.loaded_tokens - result.replayed_tokens
        records.append({
            "session": name, "turn": turn, "prompt_tokens": len(prompt), "path": result.path,
            "window": result.window_source, "window_bytes": result.window_bytes,
            "loaded_tokens": result.loaded_tokens, "replayed_tokens": result.replayed_tokens, "exact": result.exact,
            "flops": prefill_flops(engine.model.config, start, len(prompt), start if result.replayed_tokens else 0),
            "ttft_s": result.ttft_s, "logits": result.logits, "blocks": len(result.blocks),
        })
    return records


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def summarise(runs: list[dict[str, list[dict]]], restart_at: int, block_bytes: int) -> dict:
    def compared(records, all_resumed=False):
        return [r for r in records if (r["turn"] >= 1 if all_resumed else r["turn"] == restart_at)]

    by_way = {}
    for way in WAYS:
        sets = {"restart round": False} | ({"every resumed turn": True} if way.startswith("D") else {})
        by_way[way] = {}
        for label, every in sets.items():
            first = compared(runs[0][way], every)
            reference = {(r["session"], r["turn"]): r for r in runs[0]["A host"]}
            by_way[way][label] = {
                "turns": len(first),
                "ttft_s": _spread([statistics.median(r["ttft_s"] for r in compared(run[way], every)) for run in runs]),
                "flops_per_turn": statistics.median(r["flops"] for r in first),
                "paths": dict(Counter(f"{r['path']}/{r['window'] or '-'}" for r in first)),
                "max_abs_logit_diff_vs_A": max(
                    (r["logits"] - reference[(r["session"], r["turn"])]["logits"]).abs().max().item() for r in first),
            }

    def ratio(numerator: str, denominator: str) -> dict:
        return _spread([statistics.median(r["ttft_s"] for r in compared(run[numerator]))
                        / statistics.median(r["ttft_s"] for r in compared(run[denominator])) for run in runs])

    stored = [r for r in runs[0]["B engines"] if r["window"] == "store"]
    record_bytes = statistics.median(r["window_bytes"] for r in stored) if stored else 0
    last = {}
    for r in runs[0]["A host"]:
        last[r["session"]] = r  # each session's latest turn: its chain's blocks in the store
    chain_bytes = statistics.median(r["blocks"] * block_bytes for r in last.values())
    return {
        "ways": by_way,
        "resume_store_over_host": ratio("B engines", "A host"),
        "resume_store_over_recompute": ratio("B engines", "recompute only"),
        "resume_all_restarted_over_host": ratio("C all", "A host"),
        "resume_replay_over_recompute": ratio("replay only", "recompute only"),
        "store_bytes_per_session": {"window_record": record_bytes, "chain_blocks": chain_bytes,
                                    "record_over_blocks": record_bytes / chain_bytes if chain_bytes else None},
    }


def report(summary: dict, args, block_bytes: int) -> None:
    print(f"\n{args.sessions} sessions x {args.turns} turns of real text, {args.block_tokens}-token blocks "
          f"({block_bytes / 2**20:.2f} MiB); restart before round {args.restart_after + 1}; "
          f"TTFT: median per turn, medians (min-max) over {args.repeats} repeats")
    print(f"{'way':>15} {'turns':>18} {'TTFT s':>18} {'GFLOP/turn':>11} {'|dlogit| vs A':>14}  paths/window")
    for way in WAYS:
        for label, s in summary["ways"][way].items():
            t = s["ttft_s"]
            print(f"{way:>15} {label + ' (' + str(s['turns']) + ')':>18} "
                  f"{t['median']:7.3f} ({t['min']:.3f}-{t['max']:.3f}) {s['flops_per_turn'] / 1e9:11.1f} "
                  f"{s['max_abs_logit_diff_vs_A']:14.2e}  {s['paths']}")
    for name, aim in (("resume_store_over_host", 1.3), ("resume_store_over_recompute", 0.25),
                      ("resume_all_restarted_over_host", None), ("resume_replay_over_recompute", None)):
        r = summary[name]
        print(f"{name} = {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" + (f"  (aim <= {aim})" if aim else ""))
    b = summary["store_bytes_per_session"]
    print(f"store_bytes_per_session: window record {b['window_record'] / 2**20:.1f} MiB beside "
          f"{b['chain_blocks'] / 2**20:.1f} MiB of chain blocks ({b['record_over_blocks']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--restart-after", type=int, default=3, help="rounds served before the restart")
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.sessions, args.repeats, args.block_tokens) < 1 or not 1 <= args.restart_after < args.turns:
        parser.error("sessions, repeats and block tokens must be >= 1, and 1 <= restart-after < turns")
    from engine.checkpoints.real_model import load_real_model

    folder, tokenizer = load_real_model()
    requests = workload(tokenizer, args.sessions, args.turns, args.seed)
    longest = max(len(prompt) for _, _, prompt in requests)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-resume-bench-"))
    daemon = DaemonProcess(workdir / "daemon", workdir)
    try:
        daemon.start()
        print(f"{len(requests)} requests, prompts of {min(len(p) for _, _, p in requests)} to {longest} tokens; "
              "fitting the chunk cost model ...", flush=True)
        base = PrefillConfig(block_tokens=args.block_tokens, kv_pages=2 * -(-longest // args.block_tokens),
                             step_budget_s=3600.0)
        probe = PrefillEngine.from_pretrained(folder, None, base)
        config = replace(base, cost=probe.cost)
        runs = []
        for repeat in range(args.repeats):
            run = {}
            for name in WAYS:
                way = Way(name, probe.model, probe.model_id, config, daemon)
                try:
                    run[name] = serve(way, requests, args.restart_after, salt=f"{name}-{repeat}-{args.seed}")
                finally:
                    way.close()
                took = statistics.median(r["ttft_s"] for r in run[name] if r["turn"] == args.restart_after)
                print(f"  repeat {repeat + 1}/{args.repeats} {name:>15}: {took:6.3f} s median TTFT after the restart",
                      flush=True)
            runs.append(run)
        summary = summarise(runs, args.restart_after, probe.block_bytes)
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report(summary, args, probe.block_bytes)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=2))


if __name__ == "__main__":
    main()
