"""Speculative decoding in the decode engine on the real Gemma 3 270M: DSpark against fixed draft
counts and against no speculation.

    python bench/speculative.py [--batches 1,8,32] [--prompt-tokens 400] [--tokens 48] [--json out.json]

Two kinds of real prompts (`engine.text.real_text`): chat (a question about a standard-library object with
its documentation) and agent (a tool result, the documentation, that the base model quotes back: the
traffic that repeats its context). For each kind and batch size B: B prompts (the ends of different
sessions' first prompts, --prompt-tokens each), greedy, --tokens reply tokens each, decoded by

    nospec     DecodeConfig(speculative=False)
    fixed<k>   the n-gram drafter's drafts, min(k, proposed) verified every step, k = 1, 3, 5
    dspark     the DSpark schedule over SPS(B): the profile measured on this machine (cached), corrected by
               the forwards the runs time (`ObservedSps`, shared by every run as by a server's steps)
    hindsight  the same schedule told, for each draft, whether it will be accepted (confidence 1 while the
               drafts match nospec's reply, 0 from the first that does not): the most any calibration of
               these drafts could get from DSpark's rule on this machine's SPS(B), so `hindsight_vs_fixed5`
               bounds what `dspark_vs_fixed5` can reach with this drafter

Reported per mode: the median over --repeats interleaved runs (and their spread) of decode tokens/s (the
reply tokens after every request has its first one, over the time from then to the last), the mean accepted
drafts per verification and tokens per request step; and `dspark_vs_fixed5_<kind>_b<B>`,
`dspark_vs_nospec_<kind>_b<B>` and `hindsight_vs_fixed5_<kind>_b<B>`. Every run's tokens are checked against
nospec's (speculation is lossless: greedy tokens must be identical). The SPS profile is printed first,
then the calibration DSpark runs with: per-position temperatures fitted on fixed-5 verifications of other
prompts (other sessions' topics, 8 of each kind), with each position's ECE before and after and AUROC.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, DecodeResult, SamplingParams  # noqa: E402
from engine.decode.sequence import DecodeSequence  # noqa: E402
from engine.model.decoder import Decoder  # noqa: E402
from engine.speculative.calibration import Calibration, Record, fit, report  # noqa: E402
from engine.speculative.drafter import DraftToken, NGramDrafter  # noqa: E402
from engine.speculative.profile import ObservedSps, format_profile, load_or_measure  # noqa: E402

MODES = ("nospec", "fixed1", "fixed3", "fixed5", "dspark", "hindsight")


class HindsightDrafter(NGramDrafter):
    """The n-gram drafter's drafts, each with the confidence hindsight gives it: 1 while the drafts are the
    tokens greedy decoding produces next (`full`: prompt + nospec's reply), 0 from the first that is not."""

    def __init__(self, full: list[int], gamma: int) -> None:
        super().__init__(gamma)
        self.full = full

    def propose(self, limit: int | None = None) -> list[DraftToken]:
        at, right, out = self.index.length, True, []
        for k, draft in enumerate(super().propose(limit)):
            right = right and at + k < len(self.full) and self.full[at + k] == draft.token
            out.append(replace(draft, confidence=1.0 if right else 0.0))
        return out


class HindsightEngine(DecodeEngine):
    """A decode engine whose drafters know the reply (`replies`: prompt -> nospec's reply tokens)."""

    def __init__(self, model: Decoder, config: DecodeConfig, replies: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(model, None, config)
        self.replies = replies

    def _sequence(self, request: DecodeRequest) -> DecodeSequence:
        sequence = super()._sequence(request)
        prompt = list(request.prompt)
        sequence.drafter = HindsightDrafter(prompt + self.replies[tuple(prompt)], self.config.gamma)
        sequence.drafter.extend(sequence.tokens)
        return sequence


def prompts(tokenizer, kind: str, count: int, length: int, first: int = 0) -> list[list[int]]:
    """`count` prompts of one kind, the last `length` tokens of different sessions' first prompts (the
    user turn with its documentation is at the end); sessions start their topics at different places
    (from topic `first` on)."""
    from engine.text.real_text import SHORT_REFERENCE, TOPICS, Session, system_prompt

    system = system_prompt(SHORT_REFERENCE)
    out = []
    for number in range(count):
        start = (first + number) % len(TOPICS)
        session = Session(tokenizer, f"{kind}{number}", kind, TOPICS[start:] + TOPICS[:start], system)
        cut = length - 7 * (number // len(TOPICS))  # a second round of topics: cut elsewhere, so prompts differ
        out.append(session.next_prompt()[-cut:])
    return out


def config(mode: str, sps: ObservedSps, calibration: Calibration | None = None) -> DecodeConfig:
    """Every mode's engine times its forwards into the one `sps` (as a server's engine would over its life:
    the DSpark schedule then knows what a B costs in these steps, not only in the start-up profile)."""
    common = dict(kv_pages=512, block_tokens=64, max_running=64, sps=sps)
    if mode == "nospec":
        return DecodeConfig(speculative=False, **common)
    if mode == "dspark":
        return DecodeConfig(speculative=True, calibration=calibration, **common)
    if mode == "hindsight":  # confidences of 0 and 1 are survivals as they are: no calibration
        return DecodeConfig(speculative=True, calibration=Calibration(()), **common)
    return DecodeConfig(speculative=True, fixed_drafts=int(mode.removeprefix("fixed")), **common)


def run(model: Decoder, batch: list[list[int]], tokens: int, mode: str, sps: ObservedSps,
        calibration: Calibration | None = None, replies: list[list[int]] | None = None) -> dict:
    """One decode of `batch`; `replies` (nospec's, in batch order) for the hindsight mode."""
    if mode == "hindsight":
        if replies is None:
            raise ValueError("the hindsight mode needs nospec's replies: run nospec first")
        engine = HindsightEngine(model, config(mode, sps), {tuple(p): r for p, r in zip(batch, replies)})
    else:
        engine = DecodeEngine(model, None, config(mode, sps, calibration))
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
            "tokens": [r.tokens for r in results], "records": records}


def calibrate(model: Decoder, tokenizer, kinds: list[str], length: int, tokens: int,
              sps: ObservedSps) -> tuple[Calibration, dict]:
    """Per-position temperatures fitted on fixed-5 verifications of prompts the measured runs do not use
    (8 of each kind, other sessions' topics), and the per-position ECE and AUROC before and after."""
    records: list[Record] = []
    for kind in kinds:
        records += run(model, prompts(tokenizer, kind, 8, length + 13, first=5), tokens, "fixed5", sps)["records"]
    calibration = fit(records, 5)
    rows = {"temperatures": list(calibration.temperatures), "records": len(records), "positions": []}
    print(f"calibration on {len(records)} verifications: temperatures "
          f"{', '.join(f'{t:.2f}' for t in calibration.temperatures)}")
    print(f"{'k':>2} {'n':>5} {'accept':>7} {'ECE raw':>8} {'ECE cal':>8} {'AUROC':>6}")
    for raw, cal in zip(report(Calibration(()), records, 5), report(calibration, records, 5)):
        print(f"{raw.position:>2} {raw.samples:>5} {raw.accept_rate:>7.3f} {raw.ece:>8.3f} {cal.ece:>8.3f} "
              f"{cal.auroc:>6.3f}", flush=True)
        rows["positions"].append({"k": raw.position, "samples": raw.samples, "accept_rate": raw.accept_rate,
                                  "ece_raw": raw.ece, "ece_calibrated": cal.ece, "auroc": cal.auroc})
    return calibration, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--kinds", default="chat,agent")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved; medians reported")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    from engine.checkpoints.real_model import load_real_model

    folder, tokenizer = load_real_model()
    model = Decoder.from_pretrained(folder)
    profile, measured = load_or_measure(model)
    print(f"SPS(B) profile ({'measured' if measured else 'cached'}):\n{format_profile(profile)}", flush=True)
    out: dict = {"profile": profile.to_dict(), "runs": {}}
    sps = ObservedSps(profile)
    modes = args.modes.split(",")
    kinds = args.kinds.split(",")
    calibration = None
    if "dspark" in modes:
        calibration, out["calibration"] = calibrate(model, tokenizer, kinds, args.prompt_tokens, args.tokens, sps)
    for kind in kinds:
        for b in (int(x) for x in args.batches.split(",")):
            batch = prompts(tokenizer, kind, b, args.prompt_tokens)
            repeats: dict[str, list[dict]] = {mode: [] for mode in modes}
            for repeat in range(args.repeats):  # interleaved, so a slow spell of the machine hits every mode
                for mode in modes:
                    replies = repeats["nospec"][0]["tokens"] if repeats.get("nospec") else None
                    r = run(model, batch, args.tokens, mode, sps, calibration, replies)
                    repeats[mode].append(r)
                    same = repeats[modes[0]][0]["tokens"] == r["tokens"]
                    print(f"{kind} b{b} #{repeat + 1} {mode:>9}: {r['tokens_per_s']:7.2f} tok/s, mean accepted "
                          f"{r['mean_accepted']:.2f} over {r['verifications']} verifications, "
                          f"{r['accepted']}/{r['drafted']} drafts, same tokens as {modes[0]}: {same}", flush=True)
                    if not same:
                        print(f"LOSSLESS CHECK FAILED: {kind} b{b} {mode} differs from {modes[0]}", flush=True)
            median = {}
            for mode, runs in repeats.items():
                speeds = sorted(r["tokens_per_s"] for r in runs)
                median[mode] = statistics.median(speeds)
                last = {k: v for k, v in runs[-1].items() if k not in ("tokens", "records", "tokens_per_s")}
                out["runs"][f"{kind}_b{b}_{mode}"] = {**last, "tokens_per_s": median[mode],
                                                      "tokens_per_s_min": speeds[0], "tokens_per_s_max": speeds[-1]}
                print(f"{kind} b{b} {mode:>9}: median {median[mode]:7.2f} tok/s (spread {speeds[0]:.2f}-"
                      f"{speeds[-1]:.2f} over {len(speeds)})", flush=True)
            for ours, base in (("dspark", "fixed5"), ("dspark", "nospec"), ("hindsight", "fixed5")):
                if ours in median and base in median:
                    ratio = median[ours] / median[base]
                    out[f"{ours}_vs_{base}_{kind}_b{b}"] = ratio
                    print(f"{ours}_vs_{base}_{kind}_b{b} = {ratio:.3f}", flush=True)
    print("forward ms by B: profiled, then as the runs' forwards showed it (observed / profiled, per stretch)")
    for b in profile.tokens:
        print(f"{b:>5} {1e3 * profile.step_seconds(b):>9.1f} {1e3 * sps.step_seconds(b):>9.1f}", flush=True)
    out["observed_ratios"] = {str(k): v for k, v in sorted(sps.ratios.items())}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
