"""Bounded replay's output quality against the exact state, on the real Gemma 3 270M (window 512).

    python bench/swa_replay_quality.py [--json out.json] [--plot out.png] [--sessions N] [--quick]

Workload: held-out multi-turn sessions of real text (`engine.text.real_text.long_sessions`: docstrings of
standard-library modules the demo does not use, chat and agent alternating, replies of real text), each
8k+ tokens. In each session, a request resumes at each stored prefix P in 1k, 2k, 4k, 8k tokens: P is
block-aligned, as the store's prefixes are, and the new tokens [P, P + T) run to the end of the first user
turn ending 64+ tokens after P (the template's generation prompt included), so the prompt ends where the
model replies.

For each R in 128, 256, 512, 1024 and each (session, P), against the exact state
(`engine.window.quality`): top-1 agreement at the prompt's end and over the next turn's positions,
KL(exact || replay) mean and p99 over those positions, max |Δlogit|, how many of 32 greedy tokens match
exact's, and the perplexity of the next turn's real tokens under both; overall, per P, and over the
items where P > R only (with R >= P the "replay" recomputes the whole prefix exactly). Beside each R: the share of the
prefix it recomputes (R/P) and the share of a resumed request's prefill tokens it saves against
recomputing the whole prompt, 1 - (R + T)/(P + T) (tokens, not FLOPs: attention makes late tokens
costlier, so the FLOPs saved are somewhat fewer; bench/swa_replay.py measures those).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.checkpoints.real_model import load_real_model  # noqa: E402
from engine.model.decoder import Decoder  # noqa: E402
from engine.text import real_text  # noqa: E402
from engine.window.quality import CONTINUATION, ReplayQuality, session_replay_quality, spans_at, summarize  # noqa: E402

REPLAY_TOKENS = (128, 256, 512, 1024)
PREFIXES = (1024, 2048, 4096, 8192)
MIN_NEW_TOKENS = 64  # the next turn's span is at least this long
SESSIONS = 8  # ~80 s each on 2 cores
QUICK = dict(sessions=1, prefixes=(1024, 2048), replay_tokens=(128, 512))
TOP1_AIM = 0.99  # the default R is chosen to reach it: top-1 agreement of the replayed state with the exact one

COLUMNS = (("P", 6), ("items", 5), ("T", 4), ("R/P", 5), ("saved", 6), ("top1@end", 8), ("top1/turn", 9),
           ("KL mean", 8), ("KL p99", 7), ("max|dlogit|", 11), ("greedy/32", 9), ("all 32", 6),
           ("ppl exact", 9), ("ppl replay", 10))


def request_saved_frac(results: Sequence[ReplayQuality]) -> float:
    """Mean share of a resumed request's prefill tokens replay saves against recomputing its whole prompt."""
    return sum(1 - (min(r.replay_tokens, r.span.prefix) + r.span.new_tokens) / r.span.end
               for r in results) / len(results)


def figures(results: Sequence[ReplayQuality]) -> dict:
    return {**summarize(results), "new_tokens_mean": sum(r.span.new_tokens for r in results) / len(results),
            "request_saved_frac": request_saved_frac(results)}


def cells(f: dict) -> list[str]:
    """The table's cells after P and items, matching COLUMNS[2:]."""
    return [f"{f['new_tokens_mean']:.0f}", f"{f['recomputed_frac']:.1%}", f"{f['request_saved_frac']:.1%}",
            f"{f['top1_end']:.1%}", f"{f['top1_turn']:.2%}", f"{f['kl_mean']:.4f}", f"{f['kl_p99']:.3f}",
            f"{f['max_dlogit']:.2f}", f"{f['greedy_match']:.1f}", f"{f['greedy_full']:.0%}", f"{f['ppl_exact']:.2f}",
            f"{f['ppl_replay']:.2f}"]


def line(values: Sequence[str], columns: Sequence[tuple[str, int]] = COLUMNS) -> str:
    return "  ".join(f"{value:>{width}}" for value, (_, width) in zip(values, columns))


def tables(by_r: dict) -> str:
    lines = []
    for r, entry in by_r.items():
        lines += [f"\nR = {r}", line([name for name, _ in COLUMNS]), line(["all", str(entry["all"]["items"]),
                                                                          *cells(entry["all"])])]
        if entry["replayed"] is not None:
            lines.append(line(["P>R", str(entry["replayed"]["items"]), *cells(entry["replayed"])]))
        lines += [line([str(p), str(f["items"]), *cells(f)]) for p, f in entry["by_prefix"].items()]
    lines.append(f"\noverall, by R (aim: top-1 >= {TOP1_AIM:.0%} at >= 45% of a resumed request's prefill saved)")
    columns = (("R", 6), ("items", 5), *COLUMNS[2:])
    lines.append(line([name for name, _ in columns], columns))
    lines += [line([str(r), str(entry["all"]["items"]), *cells(entry["all"])], columns) for r, entry in by_r.items()]
    lines.append("only where P > R (R >= P recomputes the whole prefix, exactly: nothing replayed, nothing saved)")
    lines += [line([str(r), str(entry["replayed"]["items"]), *cells(entry["replayed"])], columns)
              for r, entry in by_r.items() if entry["replayed"] is not None]
    return "\n".join(lines)


def plot(by_r: dict, prefixes: Sequence[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = list(by_r)
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5), sharex=True)
    panels = (("top1_turn", "top-1 agreement over the next turn", False), ("kl_mean", "mean KL(exact || replay)", True),
              ("greedy_match", f"greedy tokens matching exact (of {CONTINUATION})", False),
              ("request_saved_frac", "resumed request's prefill tokens saved", False))
    for ax, (key, title, log) in zip(axes.flat, panels):
        for p in prefixes:
            ax.plot(rs, [by_r[r]["by_prefix"][p][key] for r in rs], marker="o", label=f"P = {p}")
        ax.plot(rs, [by_r[r]["all"][key] for r in rs], color="black", linestyle="--", marker="s", label="all")
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_xticks(rs, [str(r) for r in rs])
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
    axes[0, 0].axhline(TOP1_AIM, color="red", linewidth=0.8)
    axes[1, 1].axhline(0.45, color="red", linewidth=0.8)
    axes[0, 0].legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("replayed tokens R (window 512)")
    fig.suptitle("Bounded replay vs exact state, Gemma 3 270M, held-out real sessions", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--sessions", type=int, default=SESSIONS)
    parser.add_argument("--quick", action="store_true", help="one session, P in 1k and 2k, R in 128 and 512")
    args = parser.parse_args()
    sessions = QUICK["sessions"] if args.quick else args.sessions
    prefixes = QUICK["prefixes"] if args.quick else PREFIXES
    replay_tokens = QUICK["replay_tokens"] if args.quick else REPLAY_TOKENS
    if sessions < 1:
        parser.error("--sessions must be at least 1")

    began = time.perf_counter()
    folder, tokenizer = load_real_model()
    model = Decoder.from_pretrained(folder, torch.float32)
    workload = real_text.long_sessions(tokenizer, sessions, max(prefixes) + MIN_NEW_TOKENS)
    print(f"{sessions} held-out sessions of {min(len(s.tokens) for s in workload)}-"
          f"{max(len(s.tokens) for s in workload)} tokens; P in {list(prefixes)}, R in {list(replay_tokens)}, "
          f"window {model.config.sliding_window}", flush=True)

    results: list[tuple[str, ReplayQuality]] = []
    for number, session in enumerate(workload, 1):
        def report(span, measured, name=session.name, number=number):
            cells = "  ".join(f"R={r.replay_tokens}: KL {r.kl.mean():.4f} top1 {'=' if r.top1_end else 'x'} "
                              f"greedy {r.greedy_match:>2}" for r in measured)
            print(f"[{number}/{sessions} {name}] P={span.prefix} T={span.new_tokens}  {cells}  "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)

        spans = spans_at(session.prompt_ends, prefixes, MIN_NEW_TOKENS)
        results += [(session.name, r) for r in session_replay_quality(model, session.tokens, spans, replay_tokens,
                                                                      on_span=report)]

    by_r = {}
    for r in replay_tokens:
        of_r = [q for _, q in results if q.replay_tokens == r]
        replayed = [q for q in of_r if q.span.prefix > r]  # R >= P recomputes the prefix exactly: no replay
        by_r[r] = {"all": figures(of_r), "replayed": figures(replayed) if replayed else None,
                   "by_prefix": {p: figures([q for q in of_r if q.span.prefix == p]) for p in prefixes}}
    print(tables(by_r))
    elapsed = time.perf_counter() - began
    print(f"\n{len(results)} replays measured in {elapsed:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "model": str(folder.name), "window": model.config.sliding_window, "continuation": CONTINUATION,
            "min_new_tokens": MIN_NEW_TOKENS, "prefixes": list(prefixes), "replay_tokens": list(replay_tokens),
            "sessions": [{"name": s.name, "tokens": len(s.tokens), "turns": len(s.prompt_ends)} for s in workload],
            "by_r": by_r,
            "items": [{"session": name, **q.summary()} for name, q in results],
            "elapsed_s": elapsed,
        }, indent=2))
    if args.plot:
        plot(by_r, prefixes, args.plot)


if __name__ == "__main__":
    main()
