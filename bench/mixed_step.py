"""One forward a step, or two: a long prompt prefilled beside running decodes, on the real Gemma 3 270M.

    python bench/mixed_step.py [--running 8] [--prompt-tokens 2048] [--chunk 512] [--repeats 5] [--json out.json]

A store-backed prompt is prefilled by the prefill engine of the decode engine's process (docs/engines.md,
"One forward a step"). Two ways to cut a step, on the same engines:

    two     the prefill engine steps on its own (its forward), then the decode engine steps (its forward):
            two forwards a step, the result handed over in place (`DecodeRequest(PrefillResult)`)
    one     `DecodeRequest(PrefillRequest)`: the decode engine puts the prefill engine's planned chunks into its
            own step's forward beside the decode tokens

Each repeat, for each arm (interleaved): --running real-text prompts of 64 tokens decode (greedy, speculation
off); once all of them decode, one real-text prompt of --prompt-tokens arrives, prefilled --chunk tokens a step
(the prefill engine's cost model is set so that its planner takes exactly --chunk). Until its first token:

    ttft_s            the long prompt's time to first token
    decode_step_ms    the running sequences' time per token meanwhile (one step: one or two forwards)

The prefill engine runs without a store (nothing to load: both arms compute the same tokens). Reported:
medians (min..max) over repeats, and two/one ratios (above 1: the single forward is faster).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams  # noqa: E402
from engine.model.decoder import Decoder  # noqa: E402
from engine.prefill import PrefillConfig, PrefillEngine, PrefillRequest  # noqa: E402
from engine.prefill.cost import ChunkCost  # noqa: E402

BLOCK_TOKENS = 256
SHORT_PROMPT = 64
SECONDS_PER_TOKEN = 1e-3  # the planner's fixed cost model: a budget of (chunk + 0.5) ms plans exactly `chunk`


def texts(tokenizer, running: int, prompt_tokens: int) -> tuple[list[list[int]], list[int]]:
    """`running` short prompts and one long one, real text (engine.text.real_text)."""
    from engine.text.real_text import demo_sessions

    sessions = demo_sessions(tokenizer, running + 1)
    prompts = [session.next_prompt() for session in sessions]
    long_prompt = list(prompts[-1])
    for other in itertools.cycle(prompts[:-1]):  # other sessions' text after it until it is long enough
        if len(long_prompt) >= prompt_tokens:
            break
        long_prompt += other
    return [p[-SHORT_PROMPT:] for p in prompts[:-1]], long_prompt[:prompt_tokens]


def engines(model: Decoder, arm: str, chunk: int, pages: int) -> tuple[PrefillEngine, DecodeEngine]:
    """The prefill engine and a decode engine on its page pool: built on the prefill engine ("one": it steps it
    inside its own steps), or beside it ("two": the caller steps it)."""
    prefill = PrefillEngine(model, None, PrefillConfig(
        block_tokens=BLOCK_TOKENS, kv_pages=pages, window_tier_bytes=0, store_windows=False,
        cost=ChunkCost(0.0, SECONDS_PER_TOKEN, 0.0), step_budget_s=(chunk + 0.5) * SECONDS_PER_TOKEN), "bench")
    decode = DecodeEngine(model, prefill if arm == "one" else prefill.pool,
                          DecodeConfig(speculative=False, prefill_tokens_per_step=chunk))
    return prefill, decode


def measure(model: Decoder, arm: str, short: list[list[int]], long_prompt: list[int], chunk: int) -> dict:
    reply = len(long_prompt) // chunk + 16  # the running sequences outlast the long prompt's prefill
    pages = len(short) * -(-(SHORT_PROMPT + reply) // BLOCK_TOKENS) + len(long_prompt) // BLOCK_TOKENS + 2
    prefill, decode = engines(model, arm, chunk, pages)
    for prompt in short:
        decode.submit(DecodeRequest(prompt, SamplingParams(max_tokens=reply)))
    while decode.waiting or decode.kv_tokens < len(short) * SHORT_PROMPT:  # until every one decodes
        decode.step()
    start = time.perf_counter()
    steps: list[float] = []
    if arm == "one":
        rid = decode.submit(DecodeRequest(PrefillRequest(long_prompt), SamplingParams(max_tokens=1)))
        while True:
            began = time.perf_counter()
            done = decode.step()
            steps.append(time.perf_counter() - began)
            if any(r.id == rid for r in done):
                break
    else:
        prefill.submit(PrefillRequest(long_prompt))
        while True:
            began = time.perf_counter()
            (result, *_) = prefill.step() or (None,)
            decode.step()
            steps.append(time.perf_counter() - began)
            if result is not None:
                result.kv.release()  # its first token is the figure; the engines are dropped after
                break
    ttft = time.perf_counter() - start
    decode.close()
    return {"ttft_s": ttft, "decode_step_ms": statistics.median(steps) * 1e3, "steps": len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.chunk % BLOCK_TOKENS:
        parser.error(f"--chunk must be a multiple of the block size, {BLOCK_TOKENS}")
    from engine.checkpoints.real_model import load_real_model

    folder, tokenizer = load_real_model()
    model = Decoder.from_pretrained(folder)
    short, long_prompt = texts(tokenizer, args.running, args.prompt_tokens)
    print(f"{args.running} decoding, one prompt of {len(long_prompt)} tokens arriving, {args.chunk} tokens a step; "
          f"{args.repeats} repeats")
    measure(model, "one", short, long_prompt, args.chunk)  # warm-up: first forwards, allocator
    runs: dict[str, list[dict]] = {"two": [], "one": []}
    for _ in range(args.repeats):
        for arm in runs:
            runs[arm].append(measure(model, arm, short, long_prompt, args.chunk))
    summary: dict[str, float] = {}
    for figure in ("ttft_s", "decode_step_ms"):
        for arm, rows in runs.items():
            values = [row[figure] for row in rows]
            summary[f"{figure}_{arm}"] = statistics.median(values)
            print(f"  {figure:15s} {arm}: {statistics.median(values):9.3f} ({min(values):.3f}..{max(values):.3f})")
        ratios = [two[figure] / one[figure] for two, one in zip(runs["two"], runs["one"])]
        summary[f"{figure}_two_over_one"] = statistics.median(ratios)
        print(f"  {figure:15s} two/one = {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary,
                                         "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
