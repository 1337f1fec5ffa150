"""How close bf16 is to fp32 on the real Gemma 3 270M: our engine beside transformers', in one run.

    python bench/bf16_fidelity.py [--sessions 4] [--forward] [--json out.json]

Workload: the demo's real-text sessions (`engine.text.real_text.demo_sessions`: standard-library docstrings
through Gemma 3's chat template, chat and agent alternating, one shared system prompt; first prompts of
2,000-2,350 tokens), each's first prompt followed by the next turn's reply, of real text as
`real_text.long_session` writes one (a chat: the first paragraph of the asked docstring; an agent: which
function it looks up next and that one's first paragraph), and the template's <end_of_turn>: 14 to 85 tokens.
Teacher-forced: every position that predicts a reply token is scored, the reply's own tokens fed. By default
as serving computes them: the prompt in one forward, then one reply token per forward against the KV (our
decode steps; transformers' KV cache, as `generate` decodes); with --forward, prompt and reply in one forward.

Four models on the same converted weights: our `Decoder` in fp32 and in bf16 (weights, activations and KV),
transformers' `Gemma3ForCausalLM` in fp32 and in bf16 (its default sdpa attention). Per session, for ours
(bf16 against our fp32) and for transformers (bf16 against its fp32): the top-1 agreement rate over the
reply's positions, and KL(fp32 || bf16) per position, its mean and max over them (nats, from the logits in
float64). Printed per session, then the median and min..max over sessions and the figures pooled over every
position; `ratio` is ours / transformers' (medians): KL at or under 1.0 means our bf16 strays from fp32 no
more than transformers' bf16 does, and for top-1 the ratio of the disagreement rates (1 - agreement). Also
reported, for scale: our fp32 against transformers' fp32, and our bf16 against transformers' bf16.
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

from engine.model.decoder import Chunk, Decoder  # noqa: E402
from engine.model.kv import PagePool, RequestKV  # noqa: E402

SESSIONS = 4  # ~35 s each on 2 cores (four models: a ~2,200-token prompt and ~50 decode steps each)
PAIRS = {  # name: (the fp32 side, the bf16 side)
    "ours": ("ours fp32", "ours bf16"),
    "transformers": ("transformers fp32", "transformers bf16"),
    "fp32 ours vs transformers": ("transformers fp32", "ours fp32"),
    "bf16 ours vs transformers": ("transformers bf16", "ours bf16"),
}


def workload(tokenizer, count: int) -> list[dict]:
    """Per demo session: its name, first prompt and the next turn's reply tokens (real text, then the
    template's <end_of_turn>), checked to be what the template writes when the conversation goes on."""
    from engine.text.real_text import CHAT, demo_sessions, first_paragraph

    items = []
    for session in demo_sessions(tokenizer, count):
        prompt = session.next_prompt()
        topic, following = session.topics[0], session.topics[1]
        text = first_paragraph(topic) if session.kind == CHAT else f"Next I look up `{following}`: " \
                                                                   f"{first_paragraph(following)}"
        reply = tokenizer(text + "<end_of_turn>", add_special_tokens=False)["input_ids"]
        session.add_reply(text)
        if session.next_prompt()[:len(prompt) + len(reply)] != prompt + reply:
            raise RuntimeError(f"the reply's tokens of {session.name} are not what the chat template writes")
        items.append({"name": session.name, "prompt": prompt, "reply": reply})
    return items


def ours(model: Decoder, prompt: list[int], reply: list[int], stepwise: bool) -> torch.Tensor:
    """Our logits at the positions that predict `reply`'s tokens, (len(reply), vocab) float32: the prompt in
    one chunk, then (stepwise) one reply token per forward, as the engine decodes, or the reply in the same
    chunk (`logits_for` its positions)."""
    kv = RequestKV(model.config, PagePool(model.config, -(-(len(prompt) + len(reply)) // 256), 256, model.dtype))
    kv.reserve(len(prompt) + len(reply))
    if stepwise:
        (first,) = model.forward([Chunk(kv, torch.tensor(prompt), 0)])
        rows = [first] + [model.forward([Chunk(kv, torch.tensor([token]), len(prompt) + i)])[0]
                          for i, token in enumerate(reply[:-1])]
        logits = torch.stack(rows)
    else:
        (logits,) = model.forward([Chunk(kv, torch.tensor(prompt + reply[:-1]), 0)], logits_for=[len(reply)])
    kv.release()
    return logits.float()


@torch.inference_mode()
def theirs(reference, prompt: list[int], reply: list[int], stepwise: bool) -> torch.Tensor:
    """transformers' logits at the same positions: stepwise, the prompt and then one token per forward with
    its KV cache, as `generate` decodes; else one forward (`logits_to_keep`)."""
    if not stepwise:
        return reference(torch.tensor(prompt + reply[:-1])[None], logits_to_keep=len(reply)).logits[0].float()
    out = reference(torch.tensor(prompt)[None], use_cache=True, logits_to_keep=1)
    rows = [out.logits[0, -1]]
    for token in reply[:-1]:
        out = reference(torch.tensor([[token]]), cache=out.cache, use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.stack(rows).float()


def compare(fp32: torch.Tensor, bf16: torch.Tensor) -> dict:
    """Top-1 agreement and KL(fp32 || bf16) per position (nats) of two (positions, vocab) logit tensors."""
    kl = []
    for rows in range(0, len(fp32), 16):  # float64 over 262,144 columns: a few rows at a time
        p = torch.log_softmax(fp32[rows:rows + 16].double(), dim=-1)
        q = torch.log_softmax(bf16[rows:rows + 16].double(), dim=-1)
        kl += (p.exp() * (p - q)).sum(-1).clamp_min(0).tolist()
    agree = (fp32.argmax(-1) == bf16.argmax(-1)).tolist()
    return {"positions": len(kl), "top1": sum(agree) / len(agree), "kl_mean": statistics.fmean(kl), "kl_max": max(kl),
            "kl": kl, "agree": agree}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(per_session: list[dict]) -> dict:
    """Median and min..max over sessions of each figure, and the figures pooled over every position."""
    kl = [k for s in per_session for k in s["kl"]]
    agree = [a for s in per_session for a in s["agree"]]
    return {"top1": spread([s["top1"] for s in per_session]), "kl_mean": spread([s["kl_mean"] for s in per_session]),
            "kl_max": spread([s["kl_max"] for s in per_session]),
            "pooled": {"positions": len(kl), "top1": sum(agree) / len(agree), "kl_mean": statistics.fmean(kl),
                       "kl_max": max(kl)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=SESSIONS)
    parser.add_argument("--forward", action="store_true",
                        help="score each reply in one teacher-forced forward, not one token per step")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.sessions < 1:
        parser.error("--sessions must be at least 1")
    import transformers

    from engine.checkpoints.real_model import load_real_model

    began = time.perf_counter()
    folder, tokenizer = load_real_model()
    models = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        models[f"ours {name}"] = Decoder.from_pretrained(folder, dtype)
        models[f"transformers {name}"] = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    items = workload(tokenizer, args.sessions)
    print(f"Gemma 3 270M, CPU, {torch.get_num_threads()} threads; {len(items)} demo sessions, first prompts of "
          f"{min(len(i['prompt']) for i in items)}-{max(len(i['prompt']) for i in items)} tokens, replies of "
          f"{min(len(i['reply']) for i in items)}-{max(len(i['reply']) for i in items)} tokens teacher-forced "
          f"({'in one forward' if args.forward else 'one token per step'}); "
          f"models loaded in {time.perf_counter() - began:.0f} s", flush=True)

    results: dict[str, list[dict]] = {pair: [] for pair in PAIRS}
    for number, item in enumerate(items, 1):
        prompt, reply = item["prompt"], item["reply"]  # the last reply token is scored, never fed
        logits = {name: (ours if name.startswith("ours") else theirs)(model, prompt, reply, not args.forward)
                  for name, model in models.items()}
        for pair, (fp32, bf16) in PAIRS.items():
            results[pair].append({"session": item["name"], **compare(logits[fp32], logits[bf16])})
        cells = "   ".join(f"{pair}: top-1 {r[-1]['top1']:6.1%} KL mean {r[-1]['kl_mean']:.2e} "
                           f"max {r[-1]['kl_max']:.2e}" for pair, r in list(results.items())[:2])
        print(f"[{number}/{len(items)} {item['name']:<7} {len(prompt)} + {len(reply)} tokens]  {cells}  "
              f"({time.perf_counter() - began:.0f} s)", flush=True)

    figures = {pair: summary(per_session) for pair, per_session in results.items()}
    print(f"\nbf16 against fp32, per position of the replies; median (min..max) over {len(items)} sessions, "
          "then pooled over all positions")
    print(f"{'':<34} {'top-1 agreement':>26} {'KL mean (nats)':>30} {'KL max (nats)':>30}")

    def cell(f: dict, key: str, form: str) -> str:
        return f"{format(f[key]['median'], form)} ({format(f[key]['min'], form)}..{format(f[key]['max'], form)})"

    for pair, f in figures.items():
        pooled = f["pooled"]
        print(f"{pair:<34} {cell(f, 'top1', '.1%'):>26} {cell(f, 'kl_mean', '.2e'):>30} {cell(f, 'kl_max', '.2e'):>30}")
        print(f"{'  pooled, ' + str(pooled['positions']) + ' positions':<34} {format(pooled['top1'], '.1%'):>26} "
              f"{format(pooled['kl_mean'], '.2e'):>30} {format(pooled['kl_max'], '.2e'):>30}")
    ours_f, their_f = figures["ours"], figures["transformers"]

    def ratio(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    ratios = {"kl_mean": ratio(ours_f["kl_mean"]["median"], their_f["kl_mean"]["median"]),
              "kl_max": ratio(ours_f["kl_max"]["median"], their_f["kl_max"]["median"]),
              "top1_disagreement": ratio(1 - ours_f["top1"]["median"], 1 - their_f["top1"]["median"]),
              "kl_mean_pooled": ratio(ours_f["pooled"]["kl_mean"], their_f["pooled"]["kl_mean"]),
              "top1_disagreement_pooled": ratio(1 - ours_f["pooled"]["top1"], 1 - their_f["pooled"]["top1"])}
    print("\nratio ours / transformers: " + "   ".join(
        f"{name} = {'n/a (theirs 0)' if value is None else f'{value:.2f}'}" for name, value in ratios.items()))
    elapsed = time.perf_counter() - began
    print(f"\n{len(items)} sessions in {elapsed:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "threads": torch.get_num_threads(),
            "scored": "one forward" if args.forward else "one token per step",
            "sessions": [{"name": i["name"], "prompt_tokens": len(i["prompt"]), "reply_tokens": len(i["reply"])}
                         for i in items],
            "summary": {pair: f for pair, f in figures.items()}, "ratio_ours_over_transformers": ratios,
            "per_session": {pair: [{k: v for k, v in r.items() if k not in ("kl", "agree")} for r in per_session]
                            for pair, per_session in results.items()},
            "elapsed_s": elapsed,
        }, indent=2))


if __name__ == "__main__":
    main()
