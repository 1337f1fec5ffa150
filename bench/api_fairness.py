"""One tenant floods the HTTP API while another asks one question at a time: the second's time to first token.

    python bench/api_fairness.py [--flood 64] [--flood-tokens 120] [--questions 8] [--repeats 3] [--json out.json]

One store daemon and one `kvstore-api` (the real Gemma 3 270M) with two API keys, tenants `flood` and
`interactive`. Per repeat, three phases on the same server, one after the other:

    alone      the interactive tenant streams --questions chat questions, one after another (greedy, 16
               tokens each): its time to first token with the server otherwise idle
    flooded    the same, while the flood tenant keeps --flood streams of --flood-tokens tokens in flight
               (closed loop, started before the questions and running until they are done)
    unfair     as flooded, on a second server started with --fair-reserve 0: the flood may hold every engine
               slot, so a question waits for one of its replies to end (still first in line then: before
               the fair gate it also queued behind the rest of the flood), measured in the same run

Reported: the interactive tenant's TTFT p50 and p99 per phase, medians (min..max) over repeats, and the
ratios flooded / alone (aim <= 2) and unfair / alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.text.real_text import TOPICS, chat_question  # noqa: E402

MODEL = "gemma-3-270m"
KEYS = {"key-flood": "flood", "key-interactive": "interactive"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_server(daemon_address: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    keys = [arg for key, tenant in KEYS.items() for arg in ("--api-key", f"{key}={tenant}")]
    server = subprocess.Popen([sys.executable, "-m", "engine.api.server", "--port", str(port), "--servers",
                               daemon_address, *keys, *extra], env={**os.environ, "OMP_NUM_THREADS": "2"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the API server did not start")
        time.sleep(1)


async def stream_once(client, question: str, max_tokens: int) -> float:
    """Seconds from sending to the first text of one streamed chat completion."""
    sent, first = time.monotonic(), None
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                  max_tokens=max_tokens, temperature=0, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content and first is None:
                first = time.monotonic() - sent
    if first is None:
        raise RuntimeError("a stream ended without text")
    return first


async def phase(url: str, questions: int, flood: int, flood_tokens: int) -> list[float]:
    """The interactive tenant's TTFTs, with `flood` streams of the other tenant in flight (0: alone)."""
    import httpx
    from openai import AsyncOpenAI

    def client(key: str, connections: int):
        return AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=900,
                           http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=connections)))

    interactive, flooding = client("key-interactive", 4), client("key-flood", flood + 4)
    done = asyncio.Event()

    async def flooder(number: int) -> None:
        turn = 0
        while not done.is_set():
            turn += 1
            await stream_once(flooding, f"Write a long story, part {number}.{turn}.", flood_tokens)

    floods = [asyncio.ensure_future(flooder(n)) for n in range(flood)]
    if flood:
        await asyncio.sleep(10)  # the flood has taken what the server gives it
    ttfts = []
    for i in range(questions):
        ttfts.append(await stream_once(interactive, chat_question(TOPICS[i % len(TOPICS)]), 16))
    done.set()
    for task in floods:
        task.cancel()
    await asyncio.gather(*floods, return_exceptions=True)
    await interactive.close()
    await flooding.close()
    return ttfts


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=64, help="the flooding tenant's streams in flight")
    parser.add_argument("--flood-tokens", type=int, default=120)
    parser.add_argument("--questions", type=int, default=8, help="the interactive tenant's questions per phase")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.flood, args.flood_tokens, args.questions, args.repeats) < 1:
        parser.error("--flood, --flood-tokens, --questions and --repeats must be >= 1")
    from kvstore.server.process import DaemonProcess

    workdir = Path(tempfile.mkdtemp(prefix="kvstore-api-fairness-"))
    daemon = DaemonProcess(workdir / "daemon", workdir).start()
    runs: dict[str, dict[str, list[float]]] = {p: {"p50": [], "p99": []} for p in ("alone", "flooded", "unfair")}
    servers = []
    try:
        fair, fair_url = start_server(daemon.address, [])
        unfair, unfair_url = start_server(daemon.address, ["--fair-reserve", "0"])
        servers = [fair, unfair]
        for repeat in range(args.repeats):
            for name, url, flood in (("alone", fair_url, 0), ("flooded", fair_url, args.flood),
                                     ("unfair", unfair_url, args.flood)):
                ttfts = asyncio.run(phase(url, args.questions, flood, args.flood_tokens))
                runs[name]["p50"].append(percentile(ttfts, 0.5))
                runs[name]["p99"].append(percentile(ttfts, 0.99))
                print(f"  repeat {repeat + 1}/{args.repeats} {name:<8} TTFT p50 {runs[name]['p50'][-1]:.2f} s, "
                      f"p99 {runs[name]['p99'][-1]:.2f} s", flush=True)
    finally:
        for server in servers:
            server.terminate()
            server.wait(60)
        daemon.stop()
    result = {"flood": args.flood, "flood_tokens": args.flood_tokens, "questions": args.questions,
              "repeats": args.repeats}
    print(f"\nthe interactive tenant's TTFT (s) beside {args.flood} streams of {args.flood_tokens} tokens of another "
          f"tenant; medians (min..max) of {args.repeats}")
    for name in runs:
        result[name] = {q: spread(runs[name][q]) for q in ("p50", "p99")}
        for q in ("p50", "p99"):
            s = result[name][q]
            print(f"  {name:<8} {q}: {s['median']:.2f} ({s['min']:.2f}..{s['max']:.2f})")
    for name in ("flooded", "unfair"):
        for q in ("p50", "p99"):
            ratio = spread([a / b for a, b in zip(runs[name][q], runs["alone"][q], strict=True)])
            result[f"{name}_over_alone_{q}"] = ratio
            aim = "  (aim <= 2)" if name == "flooded" else ""
            print(f"  {name}_over_alone_{q}: {ratio['median']:.2f} ({ratio['min']:.2f}..{ratio['max']:.2f}){aim}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
