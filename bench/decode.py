"""Decode throughput of the decode engine beside `transformers` `generate`, on the real Gemma 3 270M.

    python bench/decode.py [--batches 1,8,32] [--prompt-tokens 256] [--tokens 24] [--repeats 3] [--json out.json]

For each batch size B: B real-text prompts (chat sessions of standard-library documentation through the
chat template, `engine.real_text`, each cut to --prompt-tokens so no padding is needed), greedy, the same
fp32 weights, in one process, interleaved per repeat:

    ours      DecodeEngine: the prompts submitted together, prefilled in the engine's steps, then decoded
              one batched forward per step; the decode phase is from the first sampled token to the last
    theirs    `generate(do_sample=False)` on the batch, timed with --tokens new tokens and with 1 (the
              prefill and first token); the decode phase is the difference

Reported: decode tokens/s (B x (tokens - 1) / decode phase) and time per output token, medians (and
min..max) over repeats; `decode_vs_transformers_b<B>` = our tokens/s / theirs (aim >= 1.0 at batch 1,
>= 2.0 at batch 8). Both runs' greedy tokens are compared. The router's imbalance and the overlap's idle
gap are not measured here yet (the serve processes and the overlap are still to be built).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams  # noqa: E402
from engine.model import Decoder  # noqa: E402


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` different real-text prompts of `length` tokens: the end of each session's first prompt,
    which differ in their user turns (the shared system prompt is at the start)."""
    from engine.real_text import demo_sessions

    out = []
    for session in demo_sessions(tokenizer, count):
        prompt = session.next_prompt()
        out.append(prompt[-length:])
    return out


def ours(model: Decoder, batch: list[list[int]], tokens: int, block_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds of the decode phase, and the tokens."""
    pages = len(batch) * -(-(len(batch[0]) + tokens) // block_tokens) + 1
    engine = DecodeEngine(model, None, DecodeConfig(kv_pages=pages, block_tokens=block_tokens,
                                                    max_running=len(batch)))
    for prompt in batch:
        engine.submit(DecodeRequest(prompt, SamplingParams(max_tokens=tokens)))
    results = sorted(engine.run(), key=lambda r: r.id)
    first = max(r.token_times_s[0] for r in results)  # every sequence has its first token: prefill is over
    last = max(r.token_times_s[-1] for r in results)
    return last - first, [r.tokens for r in results]


def theirs(reference, batch: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(batch)  # (B, prompt)
    mask = torch.ones_like(ids)  # explicit: generate would take prompt tokens equal to pad_token_id for padding

    def timed(new: int) -> tuple[float, torch.Tensor]:
        began = time.perf_counter()
        with torch.inference_mode():
            out = reference.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False)
        return time.perf_counter() - began, out

    one, _ = timed(1)
    whole, out = timed(tokens)
    return whole - one, out[:, ids.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if min(batches) < 1 or args.tokens < 2 or args.prompt_tokens < 1 or args.repeats < 1:
        parser.error("batches >= 1, --tokens >= 2, --prompt-tokens >= 1, --repeats >= 1")
    import transformers

    from engine.real_model import load_real_model

    folder, tokenizer = load_real_model()
    model = Decoder.from_pretrained(folder)
    reference = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = prompts(tokenizer, max(batches), args.prompt_tokens)
    runs = {b: {"ours": [], "theirs": []} for b in batches}
    agree = {}
    for repeat in range(args.repeats):
        for b in batches:
            batch = texts[:b]
            ours_s, our_tokens = ours(model, batch, args.tokens, args.block_tokens)
            theirs_s, their_tokens = theirs(reference, batch, args.tokens)
            runs[b]["ours"].append(ours_s)
            runs[b]["theirs"].append(theirs_s)
            agree[b] = sum(a == t for a, t in zip(our_tokens, their_tokens))
            print(f"  repeat {repeat + 1}/{args.repeats} batch {b:>2}: decode phase ours {ours_s:6.2f} s, "
                  f"transformers {theirs_s:6.2f} s; identical replies {agree[b]}/{b}", flush=True)
    summary = {}
    print(f"\nGemma 3 270M fp32, CPU, {torch.get_num_threads()} threads; {args.prompt_tokens}-token prompts, "
          f"{args.tokens} greedy tokens; medians of {args.repeats}")
    print(f"{'batch':>5} {'ours tok/s':>11} {'(min..max)':>14} {'TPOT ms':>8} {'theirs tok/s':>13} {'TPOT ms':>8} "
          f"{'ratio':>6}  same tokens")
    for b in batches:
        decoded = b * (args.tokens - 1)
        ours_rates = [decoded / s for s in runs[b]["ours"]]
        their_rates = [decoded / s for s in runs[b]["theirs"]]
        ratio = statistics.median(ours_rates) / statistics.median(their_rates)
        summary[f"decode_vs_transformers_b{b}"] = ratio
        summary[f"tokens_per_s_b{b}"] = {"ours": statistics.median(ours_rates),
                                         "transformers": statistics.median(their_rates)}
        summary[f"identical_replies_b{b}"] = f"{agree[b]}/{b}"
        print(f"{b:>5} {statistics.median(ours_rates):11.1f} {min(ours_rates):6.1f}..{max(ours_rates):<6.1f} "
              f"{1000 * statistics.median(runs[b]['ours']) / (args.tokens - 1):8.1f} "
              f"{statistics.median(their_rates):13.1f} "
              f"{1000 * statistics.median(runs[b]['theirs']) / (args.tokens - 1):8.1f} {ratio:6.2f}  {agree[b]}/{b}")
    print("\n" + "   ".join(f"{k} = {v:.2f}" for k, v in summary.items() if k.startswith("decode_vs")))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary,
                                         "runs": {str(b): r for b, r in runs.items()}}, indent=2))


if __name__ == "__main__":
    main()
