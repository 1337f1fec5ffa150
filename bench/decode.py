"""Decode throughput of the decode engine beside `transformers` `generate`, on the real Gemma 3 270M.

    python bench/decode.py [--batches 1,8,32] [--prompt-tokens 256] [--tokens 24] [--repeats 3] [--json out.json]
                           [--router-requests 200] [--router-speedup 4] [--no-router]

For each batch size B: B real-text prompts (chat sessions of standard-library documentation through the
chat template, `engine.text.real_text`, each cut to --prompt-tokens so no padding is needed), greedy, the same
weights in the engine's dtype (bf16 where the CPU has it; transformers loads them in the same), in one
process, interleaved per repeat:

    ours      DecodeEngine: the prompts submitted together, prefilled in the engine's steps, then decoded
              one batched forward per step, one token per sequence (speculation, on by default, is off here:
              bench/speculative.py measures it); the decode phase is from the first sampled token to the last
    theirs    `generate(do_sample=False)` on the batch, timed with --tokens new tokens and with 1 (the
              prefill and first token); the decode phase is the difference

Reported: decode tokens/s (B x (tokens - 1) / decode phase) and time per output token, medians (and
min..max) over repeats; `decode_vs_transformers_b<B>` = our tokens/s / theirs (aim >= 1.0 at batch 1,
>= 2.0 at batch 8). Both runs' greedy tokens are compared.

The idle gap between steps (`DecodeEngine.idle_gaps_s`: from one forward's end to the next one's start,
the device's idle time: sampling, bookkeeping, preparing the next step), median over the decode steps, at
batch 1 and 8, greedy and sampled (temperature 0.8, top-p 0.9), with `DecodeConfig.overlap` off and on,
and for sampled batches also with the sampler sorting the whole vocabulary (what it did before it took
`torch.topk` candidates), all in the same run.

The router: `bench/decode_router.py`'s `measure_routers` (three instance processes on a tiny random model,
the conversation trace's lengths and arrivals): `router_kv_imbalance_<policy>` for round-robin,
least-requests and KV-aware, medians over its repeats.
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
from engine.model.decoder import Decoder  # noqa: E402


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` different real-text prompts of `length` tokens: the end of each session's first prompt,
    which differ in their user turns (the shared system prompt is at the start)."""
    from engine.text.real_text import demo_sessions

    out = []
    for session in demo_sessions(tokenizer, count):
        prompt = session.next_prompt()
        out.append(prompt[-length:])
    return out


def ours(model: Decoder, batch: list[list[int]], tokens: int, block_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds of the decode phase, and the tokens."""
    pages = len(batch) * -(-(len(batch[0]) + tokens) // block_tokens) + 1
    engine = DecodeEngine(model, None, DecodeConfig(kv_pages=pages, block_tokens=block_tokens,
                                                    max_running=len(batch), speculative=False))
    for prompt in batch:
        engine.submit(DecodeRequest(prompt, SamplingParams(max_tokens=tokens)))
    results = sorted(engine.run(), key=lambda r: r.id)
    first = max(r.token_times_s[0] for r in results)  # every sequence has its first token: prefill is over
    last = max(r.token_times_s[-1] for r in results)
    return last - first, [r.tokens for r in results]


def idle_gap_ms(model: Decoder, batch: list[list[int]], tokens: int, block_tokens: int, overlap: bool,
                sampling: dict) -> float:
    """The median gap between consecutive decode steps' forwards, ms (the first two steps, prefill, left out)."""
    pages = len(batch) * -(-(len(batch[0]) + tokens) // block_tokens) + 1
    engine = DecodeEngine(model, None, DecodeConfig(kv_pages=pages, block_tokens=block_tokens,
                                                    max_running=len(batch), overlap=overlap, speculative=False))
    for i, prompt in enumerate(batch):
        engine.submit(DecodeRequest(prompt, SamplingParams(max_tokens=tokens, seed=i, **sampling)))
    engine.run()
    engine.close()
    return 1000 * statistics.median(list(engine.idle_gaps_s)[2:])


def sorted_candidates(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler as it was: temperature -> top-k -> top-p by sorting the whole vocabulary."""
    scores = logits.float() / p.temperature
    if 0 < p.top_k < scores.numel():
        scores = scores.masked_fill(scores < torch.topk(scores, p.top_k).values[-1], float("-inf"))
    ordered, order = torch.softmax(scores, dim=-1).sort(descending=True)
    ordered[ordered.cumsum(0) - ordered >= p.top_p] = 0
    return order, ordered


def idle_gaps(model: Decoder, texts: list[list[int]], tokens: int, block_tokens: int, repeats: int) -> dict:
    """Median idle gaps (ms, medians over repeats) by case: batch, sampling, overlap, sampler."""
    import engine.decode.sampling as sampling_module

    cases = [(b, kind, overlap, sorter) for b in (1, 8) for kind in ("greedy", "sampled") for overlap in (False, True)
             for sorter in (("topk", "sort") if kind == "sampled" and not overlap else ("topk",))]
    gaps: dict[str, list[float]] = {}
    fast = sampling_module.candidates
    for _ in range(repeats):
        for b, kind, overlap, sorter in cases:
            sampling = {} if kind == "greedy" else {"temperature": 0.8, "top_p": 0.9}
            sampling_module.candidates = sorted_candidates if sorter == "sort" else fast
            try:
                gap = idle_gap_ms(model, texts[:b], tokens, block_tokens, overlap, sampling)
            finally:
                sampling_module.candidates = fast
            gaps.setdefault(f"b{b} {kind} overlap={'on' if overlap else 'off'} sampler={sorter}", []).append(gap)
    return {case: statistics.median(values) for case, values in gaps.items()}


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
    parser.add_argument("--router-requests", type=int, default=200)
    parser.add_argument("--router-speedup", type=float, default=4.0)
    parser.add_argument("--no-router", action="store_true", help="skip the router measurement")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if min(batches) < 1 or args.tokens < 2 or args.prompt_tokens < 1 or args.repeats < 1:
        parser.error("batches >= 1, --tokens >= 2, --prompt-tokens >= 1, --repeats >= 1")
    import transformers

    from engine.checkpoints.real_model import load_real_model

    folder, tokenizer = load_real_model()
    model = Decoder.from_pretrained(folder)
    reference = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=model.dtype).eval()  # the same dtype
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
    print(f"\nGemma 3 270M {model.dtype}, CPU, {torch.get_num_threads()} threads; {args.prompt_tokens}-token prompts, "
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

    print("\nidle gap between decode steps (forward end -> next forward start), median ms:")
    gaps = idle_gaps(model, texts, args.tokens, args.block_tokens, args.repeats)
    for case, gap in gaps.items():
        print(f"  {case:<44} {gap:8.2f}")
    summary["idle_gap_ms"] = gaps

    if not args.no_router:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from decode_router import measure_routers

        print("\nrouter: three decode instance processes, the conversation trace (bench/decode_router.py)")
        routers = measure_routers(args.router_requests, speedup=args.router_speedup)
        for policy, figures in routers.items():
            if policy != "setup":
                summary[f"router_kv_imbalance_{policy}"] = figures["router_kv_imbalance"]
                low, high = figures["router_kv_imbalance_range"]
                print(f"  router_kv_imbalance_{policy} = {figures['router_kv_imbalance']:.3f} ({low:.3f}..{high:.3f})"
                      f"   TPOT p50 {figures['tpot_p50_ms']:.2f} ms, p99 {figures['tpot_p99_ms']:.2f} ms")
        summary["router"] = routers
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary,
                                         "runs": {str(b): r for b, r in runs.items()}}, indent=2))


if __name__ == "__main__":
    main()
