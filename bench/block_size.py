"""Tokens per block for chat: hit rate and time to first token through `kvstore-api`, at several block sizes.

    python bench/block_size.py [--sizes 32,64,128,256] [--sessions 4] [--turns 5] [--reply-tokens 32]
                               [--repeats 2] [--json out.json] [--plot out.png]

A chat workload of real text (`engine.text.real_text`: one shared system prompt and worked example, then
standard-library documentation, sessions interleaved round by round), sent to the HTTP API (streamed
Chat Completions, greedy replies of `--reply-tokens` tokens that become the assistant's turns) over one
daemon, once per block size, each on a server of its own; and once with no store, the recompute peer.

Per block size, over the turns after the first: the hit rate (cached prompt tokens over prompt tokens, as
the API reports them) beside the ideal (every token the turn shares with the conversation before it, a
token-granular cache's), and the median TTFT (request sent to the first streamed text) beside the no-store
server's on the same turns, as a ratio; medians over repeats, with their spread.

A block is cached once full, so a turn leaves up to a block of its prompt (and of its reply) uncached:
smaller blocks cache more of each turn, at more records, lookups and loads per token.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.server.process import DaemonProcess  # noqa: E402

KV_TOKENS = 65_536  # the engines' KV capacity at every block size (kv_pages = KV_TOKENS / block tokens)


class Server:
    """`kvstore-api` in this process, on a thread (as its tests run it)."""

    def __init__(self, servers: tuple[str, ...], block_tokens: int, chunk_cost: tuple[float, float, float]) -> None:
        import uvicorn

        from engine.api.config import ApiConfig
        from engine.api.server import build, create_app

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = ApiConfig(servers=servers, port=port, block_tokens=block_tokens, kv_pages=KV_TOKENS // block_tokens,
                           tokenize_workers=1, chunk_cost=chunk_cost)
        self.service = build(config)
        self.http = uvicorn.Server(uvicorn.Config(create_app(self.service, config), host="127.0.0.1", port=port,
                                                  log_level="warning"))
        self.thread = threading.Thread(target=self.http.run, daemon=True)
        self.thread.start()
        while not self.http.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}/v1"

    def close(self) -> None:
        self.http.should_exit = True
        self.thread.join(30)
        self.service.close()


def conversations(sessions: int, turns: int) -> list[list[str]]:
    """Each session's user turns: a worked question on a standard-library topic, in a different order each."""
    from engine.text.real_text import TOPICS, docstring

    out = []
    for number in range(sessions):
        start = (3 * number) % len(TOPICS)
        topics = (TOPICS[start:] + TOPICS[:start])[:turns]
        out.append([docstring(t).split("\n\n")[0] + "\n\nExplain this to a new Python programmer." for t in topics])
    return out


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def serve(server: Server, questions: list[list[str]], reply_tokens: int, tokenizer) -> list[dict]:
    from openai import OpenAI

    from engine.text.chat_prompt import encode_chat
    from engine.text.real_text import system_prompt

    client = OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=600)
    histories = [[{"role": "system", "content": system_prompt()}] for _ in questions]
    records = []
    for turn in range(len(questions[0])):
        for session, history in enumerate(histories):
            before = encode_chat(tokenizer, history) if turn else []  # the conversation so far, reply included
            history.append({"role": "user", "content": questions[session][turn]})
            ids = encode_chat(tokenizer, history)
            sent = time.perf_counter()
            ttft, text, usage = None, [], None
            stream = client.chat.completions.create(model="gemma-3-270m", messages=history, stream=True,
                                                    max_tokens=reply_tokens, temperature=0,
                                                    stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        ttft = ttft or time.perf_counter() - sent
                        text.append(choice.delta.content)
            history.append({"role": "assistant", "content": "".join(text)})
            if server.service.runner.prefill.client is not None:  # the next turn finds what this one saved
                server.service.runner.prefill.client.write_behind.flush(60)
            records.append({"session": session, "turn": turn, "prompt_tokens": usage.prompt_tokens,
                            "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                            "shared_tokens": _common(ids, before), "ttft_s": ttft})
    return records


def summarise(runs: list[dict[str, list[dict]]], sizes: list[int]) -> dict:
    resumed = lambda records: [r for r in records if r["turn"] >= 1]  # noqa: E731
    out = {}
    for size in sizes:
        key = str(size)
        first = resumed(runs[0][key])
        hit = sum(r["cached_tokens"] for r in first) / sum(r["prompt_tokens"] for r in first)
        ideal = sum(r["shared_tokens"] for r in first) / sum(r["prompt_tokens"] for r in first)
        ttft = [statistics.median(r["ttft_s"] for r in resumed(run[key])) for run in runs]
        over = [statistics.median(r["ttft_s"] for r in resumed(run[key]))
                / statistics.median(r["ttft_s"] for r in resumed(run["none"])) for run in runs]
        out[key] = {"hit_rate": hit, "ideal_hit_rate": ideal, "hit_over_ideal": hit / ideal,
                    "ttft_s": {"median": statistics.median(ttft), "min": min(ttft), "max": max(ttft)},
                    "ttft_over_recompute": {"median": statistics.median(over), "min": min(over), "max": max(over)}}
    none = [statistics.median(r["ttft_s"] for r in resumed(run["none"])) for run in runs]
    out["none"] = {"ttft_s": {"median": statistics.median(none), "min": min(none), "max": max(none)}}
    return out


def report(summary: dict, sizes: list[int], args) -> None:
    print(f"\n{args.sessions} sessions x {args.turns} turns, replies of {args.reply_tokens} tokens; turns after "
          f"the first; TTFT medians (min-max) over {args.repeats} repeats")
    print(f"{'block':>6} {'hit rate':>9} {'ideal':>7} {'of ideal':>9} {'TTFT s':>20} {'vs recompute':>13}")
    for size in sizes:
        s = summary[str(size)]
        t, r = s["ttft_s"], s["ttft_over_recompute"]
        print(f"{size:>6} {s['hit_rate']:9.3f} {s['ideal_hit_rate']:7.3f} {s['hit_over_ideal']:9.3f} "
              f"{t['median']:8.3f} ({t['min']:.3f}-{t['max']:.3f}) {r['median']:8.3f} ({r['min']:.2f}-{r['max']:.2f})")
    t = summary["none"]["ttft_s"]
    print(f"{'none':>6} {'':>9} {'':>7} {'':>9} {t['median']:8.3f} ({t['min']:.3f}-{t['max']:.3f})   (no store)")


def plot(summary: dict, sizes: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(9, 3.5))
    hits.plot(sizes, [summary[str(s)]["hit_rate"] for s in sizes], "o-", label="hit rate")
    hits.plot(sizes, [summary[str(s)]["ideal_hit_rate"] for s in sizes], "--", label="ideal (token-granular)")
    ttft.plot(sizes, [summary[str(s)]["ttft_s"]["median"] for s in sizes], "o-", label="with the store")
    ttft.axhline(summary["none"]["ttft_s"]["median"], linestyle="--", color="grey", label="no store")
    for ax, label in ((hits, "prompt tokens cached"), (ttft, "median TTFT, s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("tokens per block")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="32,64,128,256")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",")})
    except ValueError:
        parser.error(f"--sizes takes block sizes like 32,64,128,256, got {args.sizes!r}")
    if min(sizes) < 1 or min(args.sessions, args.turns - 1, args.reply_tokens, args.repeats) < 1:
        parser.error("sizes, sessions, reply tokens and repeats must be >= 1, and turns >= 2")
    from engine.checkpoints.real_model import load_real_model
    from engine.prefill import PrefillConfig, PrefillEngine

    folder, tokenizer = load_real_model()
    print("fitting the chunk cost model once, for every server ...", flush=True)
    cost = PrefillEngine.from_pretrained(folder, None, PrefillConfig()).cost
    questions = conversations(args.sessions, args.turns)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-block-size-bench-"))
    runs = []
    try:
        for repeat in range(args.repeats):
            run = {}
            for key in [str(s) for s in sizes] + ["none"]:
                daemon = DaemonProcess(workdir / f"daemon-{repeat}-{key}", workdir).start() if key != "none" else None
                server = Server((daemon.address,) if daemon else (), int(key) if daemon else 256,
                                (cost.a, cost.b, cost.c))
                try:
                    run[key] = serve(server, questions, args.reply_tokens, tokenizer)
                finally:
                    server.close()
                    if daemon:
                        daemon.stop()
                took = statistics.median(r["ttft_s"] for r in run[key] if r["turn"])
                print(f"  repeat {repeat + 1}/{args.repeats} block {key:>4}: median TTFT {took:.3f} s", flush=True)
            runs.append(run)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarise(runs, sizes)
    report(summary, sizes, args)
    if args.plot:
        plot(summary, sizes, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary,
                                         "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
