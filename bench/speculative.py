"""Speculative decoding (issue 25) in the decode engine on the real Gemma 3 270M: DSpark against fixed draft
counts and against no speculation.

    python bench/speculative.py [--batches 1,8,32] [--prompt-tokens 400] [--tokens 48] [--json out.json]

Two kinds of real prompts (`engine.text.real_text`): chat (a question about a standard-library object with
its documentation) and agent (a tool result, the documentation, that the base model quotes back: the
traffic that repeats its context). For each kind and batch size B: B prompts (the ends of different
sessions' first prompts, --prompt-tokens each), greedy, --tokens reply tokens each, decoded by

    nospec     DecodeConfig(speculative=False)
    fixed<k>   the n-gram drafter's drafts, min(k, proposed) verified every step, k = 1, 3, 5
    dspark     the DSpark schedule over the SPS(B) profile measured on this machine (cached)

Reported per run: decode tokens/s (the reply tokens after every request has its first one, over the time
from then to the last), the mean accepted drafts per verification and tokens per request step; and
`dspark_vs_fixed5_<kind>_b<B>`, `dspark_vs_nospec_<kind>_b<B>`. Every run's tokens are checked against
nospec's (speculation is lossless: greedy tokens must be identical). The SPS profile is printed first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, DecodeResult, SamplingParams  # noqa: E402
from engine.model.decoder import Decoder  # noqa: E402
from engine.speculative.profile import SpsProfile, format_profile, load_or_measure  # noqa: E402

MODES = ("nospec", "fixed1", "fixed3", "fixed5", "dspark")


def prompts(tokenizer, kind: str, count: int, length: int) -> list[list[int]]:
    """`count` prompts of one kind, the last `length` tokens of different sessions' first prompts (the
    user turn with its documentation is at the end); sessions start their topics at different places."""
    from engine.text.real_text import SHORT_REFERENCE, TOPICS, Session, system_prompt

    system = system_prompt(SHORT_REFERENCE)
    out = []
    for number in range(count):
        start = number % len(TOPICS)
        session = Session(tokenizer, f"{kind}{number}", kind, TOPICS[start:] + TOPICS[:start], system)
        cut = length - 7 * (number // len(TOPICS))  # a second round of topics: cut elsewhere, so prompts differ
        out.append(session.next_prompt()[-cut:])
    return out


def config(mode: str, profile: SpsProfile) -> DecodeConfig:
    common = dict(kv_pages=512, block_tokens=64, max_running=64)
    if mode == "nospec":
        return DecodeConfig(**common)
    if mode == "dspark":
        return DecodeConfig(speculative=True, sps=profile, **common)
    return DecodeConfig(speculative=True, fixed_drafts=int(mode.removeprefix("fixed")), **common)


def run(model: Decoder, batch: list[list[int]], tokens: int, mode: str, profile: SpsProfile) -> dict:
    engine = DecodeEngine(model, None, config(mode, profile))
    for prompt in batch:
        engine.submit(DecodeRequest(prompt, SamplingParams(max_tokens=tokens)))
    began = time.perf_counter()
    results: list[DecodeResult] = sorted(engine.run(), key=lambda r: r.id)
    # token times count from each request's submit, and all were submitted together, before `began`
    first_all = max(r.token_times_s[0] for r in results)  # every request decoding from here on
    last = max(r.token_times_s[-1] for r in results)
    after = sum(sum(1 for t in r.token_times_s if t > first_all) for r in results)
    records = list(engine.draft_records)
    verified = len(records)
    accepted = sum(r.accepted for r in records)
    return {"tokens_per_s": after / max(last - first_all, 1e-9), "decode_s": last - first_all,
            "wall_s": time.perf_counter() - began, "verifications": verified,
            "mean_accepted": accepted / verified if verified else 0.0,
            "drafted": sum(r.drafted for r in results), "accepted": sum(r.accepted_drafts for r in results),
            "tokens": [r.tokens for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--kinds", default="chat,agent")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from engine.checkpoints.real_model import load_real_model

    folder, tokenizer = load_real_model()
    model = Decoder.from_pretrained(folder)
    profile, measured = load_or_measure(model)
    print(f"SPS(B) profile ({'measured' if measured else 'cached'}):\n{format_profile(profile)}", flush=True)
    report: dict = {"profile": profile.to_dict(), "runs": {}}
    modes = args.modes.split(",")
    for kind in args.kinds.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            batch = prompts(tokenizer, kind, b, args.prompt_tokens)
            runs = {}
            for mode in modes:
                runs[mode] = run(model, batch, args.tokens, mode, profile)
                r = runs[mode]
                same = "" if mode == modes[0] else \
                    f" same_tokens={r['tokens'] == runs[modes[0]]['tokens']}"
                print(f"{kind} b{b} {mode:>7}: {r['tokens_per_s']:7.2f} tok/s, mean accepted "
                      f"{r['mean_accepted']:.2f} over {r['verifications']} verifications, "
                      f"{r['accepted']}/{r['drafted']} drafts{same}", flush=True)
            for mode in modes[1:]:
                if runs[mode]["tokens"] != runs[modes[0]]["tokens"]:
                    print(f"LOSSLESS CHECK FAILED: {kind} b{b} {mode} differs from {modes[0]}", flush=True)
            for name, run_ in runs.items():
                report["runs"][f"{kind}_b{b}_{name}"] = {k: v for k, v in run_.items() if k != "tokens"}
            for base in ("fixed5", "nospec"):
                if "dspark" in runs and base in runs:
                    ratio = runs["dspark"]["tokens_per_s"] / runs[base]["tokens_per_s"]
                    report[f"dspark_vs_{base}_{kind}_b{b}"] = ratio
                    print(f"dspark_vs_{base}_{kind}_b{b} = {ratio:.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
