"""Time to first token through the prefill engine and a daemon, at cached fractions 0, 50, 90 and 95%.

    python bench/ttft.py [--real] [--tokens 2560] [--block-tokens 32] [--repeats 3] [--json out.json]

The model is random-weight and Qwen3-0.6B-shaped (12 layers; `engine.checkpoints.random_model.BENCH`), big enough
that compute dominates on a CPU, on random token ids. With `--real` it is the real Gemma 3 270M
(`engine.checkpoints.real_model`, the `models` extra) on real text: a chat session of standard-library documentation
through its chat template (`engine.text.real_text`), cut to --tokens, with a line naming the repeat put
before the system prompt so that each prompt is fresh to the store. For each cached fraction f, the first f
of a fresh prompt is put in the store by prefilling it once (so the blocks are the engine's own), then the
whole prompt is prefilled and its TTFT taken. Beside it, in the same repeat, the ideal:

    compute   the uncached tokens alone, with the cached KV already in place
    load      loading the cached blocks alone (the same client and daemon)
    ideal     a two-stage pipeline over L layers: s + c + (L - 1)·max(s, c), s = load/L, c = compute/L
              (the first layer's load and the last layer's compute cannot overlap anything)

Reported: medians (and min..max) over interleaved repeats; `ttft_over_ideal_<f>pct` and
`speedup_<f>pct` = TTFT cold / TTFT at f.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.checkpoints.random_model import BENCH, write_random_model  # noqa: E402
from engine.model.decoder import Chunk  # noqa: E402
from engine.model.kv import RequestKV  # noqa: E402
from engine.prefill.config import PrefillConfig  # noqa: E402
from engine.prefill.engine import PrefillEngine  # noqa: E402
from engine.prefill.request import PrefillRequest  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.client.torch_kv import PagedKV  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

FRACTIONS = (0.0, 0.5, 0.9, 0.95)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2560)
    parser.add_argument("--block-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--real", action="store_true", help="the real Gemma 3 270M on real text")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-ttft-bench-"))
    daemon = DaemonProcess(workdir / "daemon", workdir, ["--hot-tier-bytes", "2GiB"])
    try:
        daemon.start()
        if args.real:
            from engine.checkpoints.real_model import load_real_model

            folder, tokenizer = load_real_model()
            prompt_for = real_prompts(tokenizer)
        else:
            folder = workdir / "model"
            write_random_model(folder, BENCH)
            prompt_for = None
        with KVClient(ClientConfig(servers=(daemon.address,))) as client:
            pages = 3 * -(-args.tokens // args.block_tokens)
            config = PrefillConfig(block_tokens=args.block_tokens, kv_pages=pages, step_budget_s=3600.0)
            print("fitting the chunk cost model on this machine ...", flush=True)
            engine = PrefillEngine.from_pretrained(folder, client, config)
            print(f"  {engine.cost}")
            runs = {f: [] for f in FRACTIONS}
            for repeat in range(args.repeats):
                for f in FRACTIONS:
                    runs[f].append(measure(engine, client, args.tokens, f, seed=1000 * repeat + int(f * 100),
                                          prompt_for=prompt_for))
                    row = runs[f][-1]
                    print(f"  repeat {repeat + 1}/{args.repeats} cached {f:>4.0%}: ttft {row['ttft_s']:.3f} s, "
                          f"ideal {row['ideal_s']:.3f} s", flush=True)
        report(runs, args, engine)
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def real_prompts(tokenizer):
    """`prompt_for(seed, tokens)`: a real-text prompt of `tokens` tokens that no other seed's shares."""
    from engine.text.real_text import CHAT, TOPICS, Session, system_prompt

    def prompt_for(seed: int, tokens: int) -> list[int]:
        session = Session(tokenizer, f"bench{seed}", CHAT, TOPICS, f"Benchmark prompt {seed}.\n\n{system_prompt()}")
        prompt = session.next_prompt()
        while len(prompt) < tokens:
            session.add_reply("Understood; go on.")
            prompt = session.next_prompt()
        return prompt[:tokens]

    return prompt_for


def measure(engine: PrefillEngine, client: KVClient, tokens: int, fraction: float, seed: int,
            prompt_for=None) -> dict:
    if prompt_for is not None:
        prompt = prompt_for(seed, tokens)
    else:
        prompt = torch.randint(0, engine.model.config.vocab_size, (tokens,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
    B = engine.block_tokens
    cached = int(tokens * fraction) // B * B
    if cached:
        engine.prefill(PrefillRequest(prompt[:cached])).kv.release()
        client.write_behind.flush(timeout=120)
    result = engine.prefill(PrefillRequest(prompt))
    result.kv.release()
    client.write_behind.flush(timeout=120)  # its saves would otherwise run beside the parts timed alone
    if result.loaded_tokens != cached:
        raise RuntimeError(f"expected {cached} tokens loaded, got {result.loaded_tokens} ({result.path})")

    # the parts alone: compute of the uncached tokens with the KV in place, and the load of the cached blocks
    kv = RequestKV(engine.model.config, engine.pool)
    kv.reserve(tokens)
    try:
        if cached:
            engine.model.forward([Chunk(kv, torch.tensor(prompt[:cached]), 0)])
        began = time.perf_counter()
        engine.model.forward([Chunk(kv, torch.tensor(prompt[cached:]), cached)])
        compute_s = time.perf_counter() - began
        load_s = 0.0
        if cached:
            blocks = engine.namespace().blocks(prompt[:cached])
            began = time.perf_counter()
            handle = client.load(blocks, PagedKV(engine.pool.layers, kv.block_table[: len(blocks)]),
                                 hit_blocks=len(blocks))
            if handle.wait(timeout=120) != cached:
                raise RuntimeError("the load alone did not deliver every cached block")
            load_s = time.perf_counter() - began
    finally:
        kv.release()
    layers = engine.layout.num_layers
    s, c = load_s / layers, compute_s / layers
    ideal = s + c + (layers - 1) * max(s, c) if cached else compute_s
    return {"ttft_s": result.ttft_s, "ideal_s": ideal, "compute_s": compute_s, "load_s": load_s,
            "cached_tokens": cached, "load_bytes": cached // B * engine.block_bytes}


def report(runs: dict, args, engine: PrefillEngine) -> None:
    def med(f, key):
        return statistics.median(r[key] for r in runs[f])

    def spread(f, key):
        values = [r[key] for r in runs[f]]
        return f"{min(values):.3f}..{max(values):.3f}"

    cold = med(0.0, "ttft_s")
    print(f"\nTTFT, {args.tokens}-token prompt, {engine.model_id}, {args.block_tokens}-token blocks "
          f"({engine.block_bytes / 2**20:.1f} MiB), one daemon on loopback; medians of {args.repeats}")
    print(f"{'cached':>7} {'ttft s':>8} {'(min..max)':>13} {'ideal s':>8} {'compute':>8} {'load':>7} "
          f"{'load GB/s':>9} {'ttft/ideal':>10} {'speed-up':>8}")
    figures: dict = {"tokens": args.tokens, "block_tokens": args.block_tokens, "repeats": args.repeats,
                     "cost_model": vars(engine.cost), "runs": {str(f): runs[f] for f in FRACTIONS}}
    for f in FRACTIONS:
        ttft, ideal, load = med(f, "ttft_s"), med(f, "ideal_s"), med(f, "load_s")
        rate = med(f, "load_bytes") / load / 1e9 if load else 0.0
        tag = f"{round(f * 100)}pct"
        figures[f"ttft_s_{tag}"] = ttft
        figures[f"ideal_s_{tag}"] = ideal
        figures[f"ttft_over_ideal_{tag}"] = ttft / ideal
        figures[f"speedup_{tag}"] = cold / ttft
        print(f"{f:>7.0%} {ttft:>8.3f} {spread(f, 'ttft_s'):>13} {ideal:>8.3f} {med(f, 'compute_s'):>8.3f} "
              f"{load:>7.3f} {rate:>9.2f} {ttft / ideal:>10.2f} {cold / ttft:>8.2f}")
    print(f"\nttft_over_ideal_90pct = {figures['ttft_over_ideal_90pct']:.2f} (aim <= 1.2)   "
          f"speedup_90pct = {figures['speedup_90pct']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
