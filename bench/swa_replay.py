"""What bounded replay saves, and what it costs in quality, on the real Gemma 3 270M serving real sessions.

    python bench/swa_replay.py [--sessions 4] [--turns 8] [--tier-states 2] [--repeats 2] [--json out.json]

A multi-turn workload of real-text chat sessions (`engine.text.real_text`: standard-library documentation
through the chat template, replies of real text), every turn of every session in a shuffled order per
round, through one daemon. The window tier holds the sliding-window state of `--tier-states` sessions,
fewer than are active, so states are evicted. Served three ways in one run, each in its own tenant:

    today     the small window tier; a resumed prompt whose state is gone is recomputed whole
    replay    the small window tier; where the state is gone, bounded replay (the engine's default R)
    ideal     a window tier that holds every state: each resumed prompt computes only its new tokens

Reported per way, over the resumed requests (turn >= 1): prefill compute in FLOPs (counted from the
model's shape: projections, MLPs, attention over the keys each token sees, the head once) and in wall
time (summed TTFT, medians over repeats); `compute_saved_frac` = 1 - replay / today (FLOPs), beside the
ideal's 1 - ideal / today. Quality: each replay-way request whose KV descends from a replay beside the
ideal way's logits for the same prompt (exact): `top1_agreement_R<R>` and `kl_R<R>` (mean KL(exact ‖
replay) of the next-token distribution), over the replayed requests and over all approximate ones.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.model.config import SLIDING, ModelConfig  # noqa: E402
from engine.prefill.config import PrefillConfig  # noqa: E402
from engine.prefill.engine import PrefillEngine  # noqa: E402
from engine.prefill.request import REPLAYED, PrefillRequest  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

WAYS = ("today", "replay", "ideal")
BLOCK_TOKENS = 64


def prefill_flops(config: ModelConfig, start: int, end: int, window_from: int = 0) -> float:
    """Multiply-adds × 2 of computing positions [start, end) with the KV of [0, start) in place.

    Per token and layer: the q/k/v/o projections and the gated MLP (2·params), and attention over the
    keys the token sees (QKᵀ and PV: 4·heads·head_dim per key): every earlier position in a full layer,
    at most the window (and nothing before `window_from`, where a replay began) in a sliding one. The
    head runs on the last token only, as in prefill."""
    c = config
    projections = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size * (c.experts_per_token if c.num_experts else 1)
    positions = torch.arange(start, end, dtype=torch.float64)
    full_keys = (positions + 1).sum().item()
    sliding_keys = torch.minimum(positions + 1 - window_from, torch.tensor(float(c.sliding_window or 0))).sum().item()
    per_key = 4 * c.num_heads * c.head_dim
    flops = 0.0
    for kind in c.layer_types:
        flops += 2 * (projections + mlp) * (end - start) + per_key * (sliding_keys if kind == SLIDING else full_keys)
    return flops + 2 * c.hidden_size * c.vocab_size


def workload(tokenizer, sessions: int, turns: int, seed: int) -> list[tuple[str, int, list[int]]]:
    """(session, turn, prompt) in serving order: round by round, the sessions shuffled in each."""
    from engine.text.real_text import TOPICS, demo_sessions, docstring

    chats = demo_sessions(tokenizer, sessions)
    prompts = {chat.name: [] for chat in chats}
    for chat in chats:
        for turn in range(turns):
            prompts[chat.name].append(chat.next_prompt())
            reply_topic = TOPICS[(turn * 7 + len(chat.name)) % len(TOPICS)]
            chat.add_reply(docstring(reply_topic).split("\n\n")[0])  # real text as the assistant's reply
    order, rng = [], random.Random(seed)
    for turn in range(turns):
        names = list(prompts)
        rng.shuffle(names)
        order += [(name, turn, prompts[name][turn]) for name in names]
    return order


def serve(engine: PrefillEngine, client: KVClient, requests, salt: str) -> list[dict]:
    records = []
    for name, turn, prompt in requests:
        result = engine.prefill(PrefillRequest(prompt, salt=salt, session_id=f"{salt}/{name}", turn=turn))
        result.kv.release()
        client.write_behind.flush(timeout=120)  # saves would otherwise run beside the next request
        start = result.loaded_tokens - result.replayed_tokens
        records.append({
            "session": name, "turn": turn, "prompt_tokens": len(prompt), "path": result.path,
            "loaded_tokens": result.loaded_tokens, "replayed_tokens": result.replayed_tokens, "exact": result.exact,
            "flops": prefill_flops(engine.model.config, start, len(prompt), start if result.replayed_tokens else 0),
            "ttft_s": result.ttft_s, "logits": result.logits,
        })
    return records


def kl(exact: torch.Tensor, approximate: torch.Tensor) -> float:
    """KL(exact ‖ approximate) of the next-token distributions, in nats."""
    p, q = torch.log_softmax(exact.double(), -1), torch.log_softmax(approximate.double(), -1)
    return float((p.exp() * (p - q)).sum())


def summarise(runs: list[dict[str, list[dict]]], replay_tokens: int) -> dict:
    resumed = lambda records: [r for r in records if r["turn"] >= 1]  # noqa: E731
    flops = {way: sum(r["flops"] for r in resumed(runs[0][way])) for way in WAYS}
    wall = {way: [sum(r["ttft_s"] for r in resumed(run[way])) for run in runs] for way in WAYS}
    paths = {way: {} for way in WAYS}
    for way in WAYS:
        for r in resumed(runs[0][way]):
            paths[way][r["path"]] = paths[way].get(r["path"], 0) + 1
    replayed, approximate, per_request, replays_so_far = [], [], [], {}
    for ours, exact in zip(runs[0]["replay"], runs[0]["ideal"]):
        replays = replays_so_far[ours["session"]] = replays_so_far.get(ours["session"], 0) + (ours["path"] == REPLAYED)
        if ours["exact"]:
            continue
        pair = (int(exact["logits"].argmax()) == int(ours["logits"].argmax()), kl(exact["logits"], ours["logits"]),
                (exact["logits"] - ours["logits"]).abs().max().item())
        approximate.append(pair)
        if ours["path"] == REPLAYED:
            replayed.append(pair)
        per_request.append({"session": ours["session"], "turn": ours["turn"], "path": ours["path"],
                            "replays_in_conversation": replays, "top1_agrees": pair[0], "kl": pair[1]})
    by_replays = {}
    for record in per_request:  # does the error compound as a conversation is replayed again and again?
        by_replays.setdefault(min(record["replays_in_conversation"], 4), []).append(record["kl"])
    exact_gap = max((a["logits"] - b["logits"]).abs().max().item()
                    for a, b in zip(runs[0]["today"], runs[0]["ideal"]))

    def quality(pairs):
        return {"requests": len(pairs), "top1_agreement": sum(p[0] for p in pairs) / len(pairs) if pairs else None,
                "kl_mean": statistics.fmean(p[1] for p in pairs) if pairs else None,
                "max_abs_logit_diff": max(p[2] for p in pairs) if pairs else None}

    R = replay_tokens
    summary = {
        "replay_tokens": R, "resumed_requests": len(resumed(runs[0]["today"])), "paths": paths,
        "flops": flops, "wall_s_median": {way: statistics.median(wall[way]) for way in WAYS},
        "wall_s_runs": wall,
        "compute_saved_frac": 1 - flops["replay"] / flops["today"],
        "ideal_saved_frac": 1 - flops["ideal"] / flops["today"],
        "wall_saved_frac": 1 - statistics.median(wall["replay"]) / statistics.median(wall["today"]),
        "quality_replayed": quality(replayed), "quality_approximate": quality(approximate),
        "exact_ways_max_abs_logit_diff": exact_gap,
        "kl_mean_by_replays_in_conversation": {f"{n}+" if n == 4 else str(n): statistics.fmean(v)
                                               for n, v in sorted(by_replays.items())},
        "approximate_requests": per_request,
    }
    summary[f"top1_agreement_R{R}"] = summary["quality_replayed"]["top1_agreement"]
    summary[f"kl_R{R}"] = summary["quality_replayed"]["kl_mean"]
    return summary


def report(summary: dict, args) -> None:
    R = summary["replay_tokens"]
    print(f"\n{args.sessions} sessions x {args.turns} turns of real text, window tier for {args.tier_states} "
          f"sessions' states, R = {R}; {summary['resumed_requests']} resumed requests; "
          f"wall time: medians of {args.repeats}")
    print(f"{'way':>7} {'TFLOP':>8} {'vs today':>9} {'wall s':>8} {'vs today':>9}  paths")
    for way in WAYS:
        flops, wall = summary["flops"][way], summary["wall_s_median"][way]
        print(f"{way:>7} {flops / 1e12:8.2f} {flops / summary['flops']['today']:9.3f} {wall:8.2f} "
              f"{wall / summary['wall_s_median']['today']:9.3f}  {summary['paths'][way]}")
    for label in ("replayed", "approximate"):
        q = summary[f"quality_{label}"]
        if q["requests"]:
            print(f"quality, {label} requests ({q['requests']}): top-1 agreement {q['top1_agreement']:.3f}, "
                  f"mean KL {q['kl_mean']:.5f}, max |dlogit| {q['max_abs_logit_diff']:.3f}")
    print("mean KL by the replays the conversation has been through: " + ", ".join(
        f"{n}: {v:.5f}" for n, v in summary["kl_mean_by_replays_in_conversation"].items()))
    print(f"today vs ideal (both exact): max |dlogit| {summary['exact_ways_max_abs_logit_diff']:.2e}")
    print(f"\ncompute_saved_frac = {summary['compute_saved_frac']:.3f} (aim >= 0.45; the ideal tier saves "
          f"{summary['ideal_saved_frac']:.3f})   top1_agreement_R{R} = {summary[f'top1_agreement_R{R}']}   "
          f"kl_R{R} = {summary[f'kl_R{R}']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tier-states", type=int, default=2, help="window states the small tier holds")
    parser.add_argument("--replay-tokens", type=int, default=None, help="R (default: the engine's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.sessions, args.turns, args.tier_states, args.repeats) < 1 or args.tier_states >= args.sessions:
        parser.error("sessions, turns, tier-states and repeats must be >= 1, and tier-states < sessions")
    from engine.checkpoints.real_model import load_real_model

    folder, tokenizer = load_real_model()
    requests = workload(tokenizer, args.sessions, args.turns, args.seed)
    longest = max(len(prompt) for _, _, prompt in requests)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-replay-bench-"))
    daemon = DaemonProcess(workdir / "daemon", workdir, ["--hot-tier-bytes", "1GiB"])
    try:
        daemon.start()
        with KVClient(ClientConfig(servers=(daemon.address,))) as client:
            base = PrefillConfig(block_tokens=BLOCK_TOKENS, kv_pages=2 * -(-longest // BLOCK_TOKENS),
                                 step_budget_s=3600.0, replay_tokens=args.replay_tokens)
            print(f"{len(requests)} requests, prompts of {min(len(p) for _, _, p in requests)} to {longest} "
                  "tokens; fitting the chunk cost model ...", flush=True)
            probe = PrefillEngine.from_pretrained(folder, client, base)
            mc = probe.model.config
            state_bytes = len(mc.sliding_layers) * 2 * mc.sliding_window * mc.num_kv_heads * mc.head_dim * 4
            small = replace(base, cost=probe.cost, window_tier_bytes=args.tier_states * state_bytes)
            configs = {"today": replace(small, replay_tokens=0), "replay": small,
                       "ideal": replace(small, replay_tokens=0, window_tier_bytes=4 * len(requests) * state_bytes)}
            runs = []
            for repeat in range(args.repeats):
                run = {}
                for way in WAYS:
                    engine = PrefillEngine(probe.model, client, configs[way], probe.model_id)
                    run[way] = serve(engine, client, requests, salt=f"{way}-{repeat}-{args.seed}")
                    total = sum(r["ttft_s"] for r in run[way])
                    print(f"  repeat {repeat + 1}/{args.repeats} {way:>6}: {total:6.1f} s of prefill", flush=True)
                runs.append(run)
            summary = summarise(runs, probe.replay_tokens)
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report(summary, args)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=2))


if __name__ == "__main__":
    main()
