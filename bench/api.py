"""Concurrent streaming clients against the HTTP API, beside the engines driven directly, on the real model.

    python bench/api.py [--clients 32] [--duration-s 60] [--max-tokens 16] [--repeats 3] [--json out.json]

One store daemon and one `kvstore-api` process (the real Gemma 3 270M, on the daemon) are started. Each
repeat runs two phases of the same closed-loop workload, one after the other, so they never share the cores:

    api      --clients official `openai` clients (AsyncOpenAI), each streaming chat completions one after
             another until --duration-s has passed (no new request after it; those in flight finish):
             a chat session's system prompt (about 1.9k tokens, shared by all), its worked exchange and a
             question about a standard-library docstring, greedy, --max-tokens tokens, with usage
    engines  the same prompts (encoded as the server encodes them) kept --clients deep in a DecodeEngine
             of this process on the same daemon: what the engines give without HTTP, SSE, the event
             loop and the tokenizer processes, the limit the API layer is measured against

Before each phase one request stores the shared system prompt, as it is in a serving deployment. Reported
per phase: requests, errors, incomplete streams, time to first token (p50/p99, request sent to
the first text), output tokens/s over the phase, medians (min..max) over repeats, and the ratios
api / engines. The API phase must end with no error and every stream complete ([DONE] after a finish
reason and the usage chunk), or the benchmark fails.
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

from engine.text.real_text import TOPICS, chat_question, example_exchange, system_prompt  # noqa: E402

MODEL = "gemma-3-270m"
KV_PAGES = 320  # of 256 tokens, for the server's engines and the direct ones alike: 32 prompts of ~2.1k tokens fit


def conversations(count: int) -> list[list[dict]]:
    """Distinct one-question chats sharing the system prompt and the worked exchange."""
    head = [{"role": "system", "content": system_prompt()}, *example_exchange()]
    return [head + [{"role": "user", "content": chat_question(TOPICS[i % len(TOPICS)])}] for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(ttfts: list[float], tokens: int, seconds: float, requests: int, errors: int, incomplete: int) -> dict:
    return {"requests": requests, "errors": errors, "incomplete": incomplete, "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99), "tokens_per_s": tokens / seconds}


async def api_phase(url: str, chats: list[list[dict]], clients: int, duration_s: float, max_tokens: int) -> dict:
    import httpx
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600,
                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4)))
    ttfts: list[float] = []
    counts = {"tokens": 0, "requests": 0, "errors": 0, "incomplete": 0}
    # the shared system prompt is hot in a serving deployment: stored once before the clock starts
    await client.chat.completions.create(model=MODEL, messages=chats[0], max_tokens=1, temperature=0)
    started = time.monotonic()

    async def one_client(number: int) -> None:
        turn = 0
        while time.monotonic() - started < duration_s:
            messages = chats[(number + turn * clients) % len(chats)]
            turn += 1
            sent, first, finished, usage = time.monotonic(), None, None, None
            try:
                stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                              temperature=0, stream=True,
                                                              stream_options={"include_usage": True})
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for choice in chunk.choices:
                        if choice.delta.content and first is None:
                            first = time.monotonic() - sent
                        finished = choice.finish_reason or finished
            except Exception as exc:  # counted, and the benchmark fails at the end
                counts["errors"] += 1
                print(f"  client {number}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            counts["requests"] += 1
            if finished is None or usage is None:
                counts["incomplete"] += 1
                continue
            counts["tokens"] += usage.completion_tokens
            if first is not None:
                ttfts.append(first)

    await asyncio.gather(*(one_client(n) for n in range(clients)))
    seconds = time.monotonic() - started
    await client.close()
    return summary(ttfts, counts["tokens"], seconds, counts["requests"], counts["errors"], counts["incomplete"])


def engine_phase(service, prompts: list[list[int]], clients: int, duration_s: float, max_tokens: int) -> dict:
    """The closed loop of the API phase, on a DecodeEngine of this process."""
    from engine.decode import DecodeRequest, SamplingParams
    from engine.prefill import PrefillRequest

    engine, stops = service["engine"], service["stops"]
    ttfts, tokens, requests, submitted = [], 0, 0, 0
    engine.submit(DecodeRequest(PrefillRequest(prompts[0]), SamplingParams(max_tokens=1)))  # warm, as the API's
    engine.run()
    started = time.monotonic()

    def submit() -> None:
        nonlocal submitted
        request = PrefillRequest(prompts[submitted % len(prompts)], traffic_class="chat")
        engine.submit(DecodeRequest(request, SamplingParams(max_tokens=max_tokens, stop_token_ids=stops)))
        submitted += 1

    for _ in range(clients):
        submit()
    while engine.pending:
        for result in engine.step():
            requests += 1
            tokens += len(result.tokens)
            ttfts.append(result.token_times_s[0] if result.token_times_s else float("nan"))
            if time.monotonic() - started < duration_s:
                submit()
    return summary(ttfts, tokens, time.monotonic() - started, requests, 0, 0)


def start_stack(workdir: Path) -> tuple[list[subprocess.Popen], str, str]:
    from kvstore.server.process import DaemonProcess

    daemon = DaemonProcess(workdir / "daemon", workdir).start()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "engine.api.server", "--port", str(port), "--servers",
                               daemon.address, "--kv-pages", str(KV_PAGES),
                               "--block-tokens", "256"], env={**os.environ, "OMP_NUM_THREADS": "2"})
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the API server did not start")
        time.sleep(1)
    return [daemon, server], url, daemon.address


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from engine.checkpoints.real_model import load_real_model
    from engine.decode import DecodeConfig, DecodeEngine
    from engine.prefill import PrefillConfig, PrefillEngine
    from engine.text.chat_prompt import encode_chat
    from engine.text.real_text import stop_token_ids
    from kvstore.client import KVClient

    chats = conversations(64)
    with tempfile.TemporaryDirectory() as tmp:
        print("starting a daemon and kvstore-api (the model loads in about a minute) ...", flush=True)
        processes, url, address = start_stack(Path(tmp))
        try:
            folder, tokenizer = load_real_model()
            prompts = [encode_chat(tokenizer, chat) for chat in chats]
            prefill = PrefillEngine.from_pretrained(folder, KVClient([address]), PrefillConfig(block_tokens=256,
                                                                                              kv_pages=KV_PAGES))
            engine = DecodeEngine(prefill.model, prefill, DecodeConfig(max_running=32))
            direct = {"engine": engine, "stops": tuple(stop_token_ids(tokenizer))}
            print(f"{args.clients} clients, {args.duration_s:.0f} s per phase, {args.max_tokens} tokens per reply, "
                  f"prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens", flush=True)
            runs: dict[str, list[dict]] = {"api": [], "engines": []}
            for repeat in range(args.repeats):
                runs["api"].append(asyncio.run(api_phase(url, chats, args.clients, args.duration_s, args.max_tokens)))
                runs["engines"].append(engine_phase(direct, prompts, args.clients, args.duration_s, args.max_tokens))
                print(f"  repeat {repeat + 1}: api {runs['api'][-1]}\n            engines {runs['engines'][-1]}",
                      flush=True)
        finally:
            processes[1].terminate()
            processes[1].wait(30)
            processes[0].stop()
    report(runs, args)


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    def med(phase: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[phase])

    def spread(phase: str, key: str) -> str:
        values = [r[key] for r in runs[phase]]
        return f"{min(values):.3f}..{max(values):.3f}"

    out = {"clients": args.clients, "duration_s": args.duration_s, "max_tokens": args.max_tokens,
           "repeats": args.repeats}
    print(f"\n{'phase':<8} {'requests':>8} {'errors':>6} {'incomplete':>10} {'TTFT p50 s':>18} {'TTFT p99 s':>18} "
          f"{'tokens/s':>18}")
    for phase in ("api", "engines"):
        print(f"{phase:<8} {sum(r['requests'] for r in runs[phase]):8d} {sum(r['errors'] for r in runs[phase]):6d} "
              f"{sum(r['incomplete'] for r in runs[phase]):10d} "
              + " ".join(f"{med(phase, k):6.3f} ({spread(phase, k)})"
                         for k in ("ttft_p50_s", "ttft_p99_s", "tokens_per_s")))
        for key in ("ttft_p50_s", "ttft_p99_s", "tokens_per_s"):
            out[f"{phase}_{key}"] = med(phase, key)
    out["errors"] = sum(r["errors"] for r in runs["api"])
    out["incomplete_streams"] = sum(r["incomplete"] for r in runs["api"])
    out["tokens_per_s_vs_engines"] = med("api", "tokens_per_s") / med("engines", "tokens_per_s")
    out["ttft_p50_vs_engines"] = med("api", "ttft_p50_s") / med("engines", "ttft_p50_s")
    print(f"\napi / engines: tokens/s {out['tokens_per_s_vs_engines']:.2f}x, "
          f"TTFT p50 {out['ttft_p50_vs_engines']:.2f}x (medians of {args.repeats})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    if out["errors"] or out["incomplete_streams"]:
        raise SystemExit(f"{out['errors']} errors, {out['incomplete_streams']} incomplete streams")


if __name__ == "__main__":
    main()
