"""What each KV codec buys and costs, on the real Gemma 3 270M in the KV width the engine runs (bf16 here).

    python bench/compression.py [--json out.json] [--plot out.png] [--sessions N] [--quick]

Workload: held-out multi-turn sessions of real text (`engine.text.real_text.long_sessions`, as in
bench/swa_replay_quality.py). In each session, a request resumes at stored prefixes P in 1k, 2k and 4k
tokens (block-aligned) and brings the next turn, [P, end).

For each codec (kvstore/codec.py), from the exact KV of those prefixes:
- bytes per block (64 tokens, the stored full layers) and per window record (the sliding layers' last 512
  positions), each as a ratio to raw;
- encode and decode rates on one core, GB/s of raw KV (median and spread over the blocks' layers, repeated);
- quality over the next turn (`engine.window.quality.session_variant_quality`): the exact run's KV of
  [0, P), full layers and sliding window alike, sent through the codec and back as a store would, then the
  next turn computed on it and compared with the same turn computed, in the same batch, on the exact KV
  unchanged: top-1 agreement at every position and at the prompt's end, KL(exact || codec) mean and p99,
  max |Δlogit|, and how many of 32 greedy tokens match. (Against the exact run computed alone, bf16's
  rounding of another batch shape alone gives a KL near 1e-3: `--against-alone` shows it);
- the load time of a 90%-cached 4,096-token prompt (57 blocks) from one daemon into the engine's paged KV,
  `client.load` to the last layer, beside raw, interleaved repeats: from its DRAM tier, and with no DRAM
  tier from its SSD segments (O_DIRECT where aligned, else the page cache);
- the hit rate it buys: `kvstore analytics replay` on traces/conversation_trace.jsonl (512-token blocks) at
  SSD budgets in bytes, each codec's bytes per block against raw's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.checkpoints.real_model import load_real_model  # noqa: E402
from engine.model.decoder import (
    Chunk,  # noqa: E402
    Decoder,  # noqa: E402
)
from engine.model.dtype import resolve  # noqa: E402
from engine.model.kv import RequestKV, WindowState  # noqa: E402
from engine.prefill.config import BLOCK_TOKENS  # noqa: E402
from engine.prefill.engine import stored_layout  # noqa: E402
from engine.text import real_text  # noqa: E402
from engine.window import record as window_records  # noqa: E402
from engine.window.quality import (  # noqa: E402
    ReplayQuality,
    Span,
    clone_kv,
    new_kv,
    session_variant_quality,
    spans_at,
    summarize,
)
from kvstore.block import Namespace  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.client.torch_kv import PagedKV  # noqa: E402
from kvstore.codec import CODECS, BlockCodec, LayerGeometry  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

CODEC_NAMES = ("zstd", "int8", "int4")  # against raw
PREFIXES = (1024, 2048, 4096)
MIN_NEW_TOKENS = 64
SESSIONS = 4
QUICK = dict(sessions=1, prefixes=(1024,))
LOAD_PROMPT_TOKENS = 4096
LOAD_REPEATS = 15
TRACE = Path(__file__).resolve().parent.parent / "traces" / "conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512
SSD_BUDGETS_GIB = (2, 8, 32)  # of Gemma 3 270M's KV: 1.5 MiB per raw 512-token block
AIMS = {"zstd": "ratio >= 1.3", "int8": "ratio >= 2, top-1 >= 99.5%, KL <= 1e-3",
        "int4": "ratio >= 3.5 at top-1 >= 99%"}


def block_payloads(model: Decoder, kv: RequestKV, blocks: int) -> list[bytes]:
    """The stored payload of each of the first `blocks` pages of `kv`: its full layers, layer-major."""
    return [b"".join(layer[kv.block_table[b]].contiguous().view(torch.uint8).numpy().tobytes()
                     for layer in kv.pool.layers) for b in range(blocks)]


def through_codec(model: Decoder, exact: RequestKV, prefix: int, codec: BlockCodec, name: str) -> RequestKV:
    """A copy of `exact` (holding [0, prefix)) whose full-layer blocks and window went into the store with
    `codec` and came back: what an engine resuming at `prefix` would compute on."""
    kv = clone_kv(model, exact)
    raw = codec.geometry.raw_bytes
    for b in range(prefix // kv.block_tokens):
        page = kv.block_table[b]
        stored, slot = codec.encode(b"".join(
            layer[page].contiguous().view(torch.uint8).numpy().tobytes() for layer in kv.pool.layers),
            len(kv.pool.layers))
        for i, layer in enumerate(kv.pool.layers):
            out = bytearray(raw)
            codec.decode(memoryview(stored)[i * slot : (i + 1) * slot], memoryview(out))
            layer[page] = torch.frombuffer(out, dtype=torch.uint8).view(layer.dtype).view(layer[page].shape)
    if kv.rings is not None:
        payload = window_records.encode(WindowState(prefix, kv.rings, kv.window_from), 0, name)
        state, _ = window_records.decode(payload, prefix, kv.rings, exact=False, codec=name)
        kv.rings.copy_(state.rings)
    return kv


def rates(codec: BlockCodec, payloads: list[bytes], layers: int, repeats: int = 5) -> dict:
    """Encode and decode GB/s of raw KV on this core, per pass over every block (median and range)."""
    raw = sum(len(p) for p in payloads)
    encode_s, decode_s = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        stored = [codec.encode(p, layers) for p in payloads]
        encode_s.append(time.perf_counter() - started)
        out = memoryview(bytearray(codec.geometry.raw_bytes))
        started = time.perf_counter()
        for data, slot in stored:
            for i in range(layers):
                codec.decode(memoryview(data)[i * slot : (i + 1) * slot], out)
        decode_s.append(time.perf_counter() - started)
    return {"encode_GBps": raw / statistics.median(encode_s) / 1e9,
            "encode_GBps_range": [raw / max(encode_s) / 1e9, raw / min(encode_s) / 1e9],
            "decode_GBps": raw / statistics.median(decode_s) / 1e9,
            "decode_GBps_range": [raw / max(decode_s) / 1e9, raw / min(decode_s) / 1e9]}


def load_times(model: Decoder, payloads: list[bytes], repeats: int, hot_tier: str) -> dict[str, list[float]]:
    """Seconds to load the leading 90% of a prompt's blocks (`payloads`) from one daemon into paged KV, per
    codec, interleaved: from its DRAM tier, or with none (`hot_tier` 0) from its SSD segments."""
    hit = len(payloads)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-compression-bench-"))
    daemon = DaemonProcess(workdir / "data", workdir, ["--hot-tier-bytes", hot_tier])
    times: dict[str, list[float]] = {name: [] for name in ("raw", *CODEC_NAMES)}
    try:
        daemon.start()
        with KVClient(ClientConfig((daemon.address,), timeout_s=60)) as client:
            spaces = {name: Namespace("bench-compression", stored_layout(model, name), BLOCK_TOKENS)
                      for name in times}
            chains = {name: space.blocks(range(hit * BLOCK_TOKENS)) for name, space in spaces.items()}
            for name, blocks in chains.items():
                assert client.put(list(zip(blocks, payloads)), len(model.config.full_layers)).stored == hit
            page = (hit, 2, BLOCK_TOKENS, model.config.num_kv_heads, model.config.head_dim)
            kv = [torch.zeros(page, dtype=model.dtype) for _ in model.config.full_layers]  # the engine's pages
            for round_ in range(repeats + 1):
                for name, blocks in chains.items():
                    started = time.perf_counter()
                    handle = client.load(blocks, PagedKV(kv, list(range(hit))), hit)
                    assert handle.wait(timeout=60) == hit * BLOCK_TOKENS
                    if round_:  # the first round warms connections and buffers
                        times[name].append(time.perf_counter() - started)
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return times


def hit_rates(bytes_per_block: dict[str, float]) -> dict:
    """Token hit rate of the shipped trace at each SSD budget, per codec (prefix-reuse, the daemons' reuse-aware
    policy), from `kvstore analytics replay`."""
    budgets = ",".join(f"{g}GiB" for g in SSD_BUDGETS_GIB)
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, block_bytes in bytes_per_block.items():
            report = Path(tmp) / f"{name}.json"
            subprocess.run([sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(TRACE), "--policies",
                            "prefix-reuse", "--capacity", budgets, "--block-bytes", str(int(block_bytes)),
                            "--block-tokens", str(TRACE_BLOCK_TOKENS), "--jobs", "1", "--json", str(report)],
                           check=True, stdout=subprocess.DEVNULL)
            rows = json.loads(report.read_text())["rows"]
            out[name] = {row["capacity"]: {"blocks": row["capacity_blocks"],
                                           "token_hit_rate": row["prefix-reuse"]["token_hit_rate"]} for row in rows}
    return out


def table(figures: dict) -> str:
    lines = [f"{'codec':>6} {'block':>7} {'window':>7} {'enc GB/s':>16} {'dec GB/s':>16} "
             f"{'load from DRAM, ms':>24} {'load from SSD, ms':>24}"]
    for name, f in figures.items():
        cells = [f"{name:>6} {f['block_ratio']:6.2f}x {f['window_ratio']:6.2f}x"]
        for rate in ("encode_GBps", "decode_GBps"):
            low, high = f.get(f"{rate}_range", (0.0, 0.0))
            cells.append(f"{f[rate]:5.2f} [{low:.2f}-{high:.2f}]" if rate in f else f"{'-':>16}")
        for tier in ("dram", "ssd"):
            load = f[f"load_{tier}_ms"]
            cells.append(f"{load['median']:6.1f} [{load['min']:.1f}-{load['max']:.1f}] {load['over_raw']:4.2f}x")
        lines.append(" ".join(cells))
    lines += ["", f"{'codec':>6} {'top1/turn':>9} {'top1@end':>8} {'KL mean':>9} {'KL p99':>8} {'max|dl|':>8} "
                  f"{'greedy/32':>9} {'all 32':>6}"]
    for name, f in figures.items():
        if q := f.get("quality"):
            lines.append(f"{name:>6} {q['top1_turn']:9.3%} {q['top1_end']:8.0%} {q['kl_mean']:9.2e} "
                         f"{q['kl_p99']:8.1e} {q['max_dlogit']:8.2f} {q['greedy_match']:9.1f} {q['greedy_full']:6.0%}")
    return "\n".join(lines)


def plot(figures: dict, hits: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, f in figures.items():
        if f.get("quality"):
            left.scatter(f["block_ratio"], f["quality"]["kl_mean"] + 1e-9, s=40)
            left.annotate(name, (f["block_ratio"], f["quality"]["kl_mean"] + 1e-9), fontsize=9)
        right.plot(SSD_BUDGETS_GIB, [hits[name][f"{g}GiB"]["token_hit_rate"] for g in SSD_BUDGETS_GIB],
                   marker="o", label=f"{name} ({f['block_ratio']:.2f}x)")
    left.set_yscale("log")
    left.axhline(1e-3, color="red", linewidth=0.8)
    left.set_xlabel("bytes per block, raw / codec")
    left.set_ylabel("mean KL(exact || codec), next turn (+1e-9)")
    right.set_xscale("log", base=2)
    right.set_xlabel("SSD budget (GiB)")
    right.set_ylabel("token hit rate, conversation trace")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("KV codecs on Gemma 3 270M (bf16): size, quality, hit rate", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--sessions", type=int, default=SESSIONS)
    parser.add_argument("--quick", action="store_true", help="one session, P = 1k")
    parser.add_argument("--against-alone", action="store_true",
                        help="compare with the exact run computed alone, and show an unchanged copy's figures too")
    args = parser.parse_args()
    sessions = QUICK["sessions"] if args.quick else args.sessions
    prefixes = QUICK["prefixes"] if args.quick else PREFIXES
    if sessions < 1:
        parser.error("--sessions must be at least 1")
    torch.set_num_threads(1)  # one core computes: the rates are per core, the load has the other

    began = time.perf_counter()
    folder, tokenizer = load_real_model()
    model = Decoder.from_pretrained(folder, resolve("auto"))
    width = str(model.dtype).removeprefix("torch.")
    layers = len(model.config.full_layers)
    geometry = LayerGeometry(2, BLOCK_TOKENS, model.config.num_kv_heads * model.config.head_dim, width)
    codecs = {name: BlockCodec(CODECS[name], geometry) for name in CODEC_NAMES}
    workload = real_text.long_sessions(tokenizer, sessions, max(max(prefixes), LOAD_PROMPT_TOKENS) + MIN_NEW_TOKENS)
    print(f"{sessions} held-out sessions, P in {list(prefixes)}, KV in {width}, {layers} full layers stored, "
          f"window {model.config.sliding_window}", flush=True)

    # Rates and loads first, in a process that holds nothing else yet: the first session's leading blocks
    hit = LOAD_PROMPT_TOKENS * 9 // 10 // BLOCK_TOKENS
    kv = new_kv(model, hit * BLOCK_TOKENS, BLOCK_TOKENS)
    ids = torch.tensor(workload[0].tokens[: hit * BLOCK_TOKENS])
    for start in range(0, len(ids), 1024):
        model.forward([Chunk(kv, ids[start : start + 1024], start)])
    first = block_payloads(model, kv, hit)
    del kv
    figures: dict[str, dict] = {"raw": {"block_ratio": 1.0, "window_ratio": 1.0}}
    for name, codec in codecs.items():
        figures[name] = rates(codec, first, layers)
    print("measuring loads ...", flush=True)
    for tier, hot_tier in (("dram", "1GiB"), ("ssd", "0")):
        loads = load_times(model, first, LOAD_REPEATS, hot_tier)
        raw_load = statistics.median(loads["raw"])
        for name, values in loads.items():
            figures[name][f"load_{tier}_ms"] = {
                "median": statistics.median(values) * 1e3, "min": min(values) * 1e3, "max": max(values) * 1e3,
                "over_raw": statistics.median(values) / raw_load, "all": [v * 1e3 for v in values]}

    payloads: list[bytes] = []  # the stored blocks of every session's longest prefix
    windows: list[tuple[WindowState, int]] = []
    compared = ("copy", *CODEC_NAMES) if args.against_alone else CODEC_NAMES
    results: dict[str, list[ReplayQuality]] = {name: [] for name in compared}
    for number, session in enumerate(workload, 1):
        def variants(exact: RequestKV, span: Span) -> list[RequestKV]:
            if span.prefix == max(prefixes):
                payloads.extend(block_payloads(model, exact, span.prefix // BLOCK_TOKENS))
                if exact.rings is not None:
                    windows.append((WindowState(span.prefix, exact.rings.clone(), exact.window_from), span.prefix))
            # the reference: the exact KV unchanged, computed in the same batch as the codecs' (bf16 rounds a
            # batch of four otherwise than a batch of one)
            return [clone_kv(model, exact)] + [through_codec(model, exact, span.prefix, codecs[name], name)
                                               for name in CODEC_NAMES]

        def report(span: Span, measured: list[ReplayQuality], number: int = number) -> None:
            cells = "  ".join(f"{name}: KL {q.kl.mean():.1e} top1 {q.top1.double().mean():.3f} greedy {q.greedy_match}"
                              for name, q in zip(compared, measured))
            print(f"[{number}/{sessions}] P={span.prefix} T={span.new_tokens}  {cells}  "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)

        spans = spans_at(session.prompt_ends, prefixes, MIN_NEW_TOKENS)
        measured = session_variant_quality(model, session.tokens, spans, variants, list(range(len(compared))),
                                           block_tokens=BLOCK_TOKENS, on_span=report,
                                           against_first=not args.against_alone)
        for q in measured:
            results[compared[q.replay_tokens]].append(q)

    raw_block = len(payloads[0])
    raw_window = sum(len(window_records.encode(state)) for state, _ in windows)
    for name, codec in codecs.items():
        stored = sum(len(codec.encode(p, layers)[0]) for p in payloads)
        figures[name].update({
            "block_ratio": raw_block * len(payloads) / stored,
            "block_bytes": stored / len(payloads),
            "window_ratio": raw_window / sum(len(window_records.encode(s, 0, name)) for s, _ in windows),
            "quality": summarize(results[name]),
        })
    figures["raw"]["block_bytes"] = raw_block
    if args.against_alone:
        figures["raw"]["quality"] = summarize(results["copy"])  # bf16's batch-shape rounding alone
    print("replaying the conversation trace ...", flush=True)
    per_trace_block = {name: f["block_bytes"] * TRACE_BLOCK_TOKENS / BLOCK_TOKENS for name, f in figures.items()}
    hits = hit_rates(per_trace_block)

    print(f"\nper codec: stored bytes as a ratio to raw {width} (block: {raw_block} B raw, {BLOCK_TOKENS} tokens x "
          f"{layers} layers; window record: the last {model.config.sliding_window} positions of "
          f"{len(model.config.sliding_layers)} sliding layers); encode/decode GB/s of raw KV on one core, median "
          f"[range]; load of a 90%-cached {LOAD_PROMPT_TOKENS}-token prompt ({hit} blocks) from daemon DRAM, median "
          f"[range] of {LOAD_REPEATS} and the ratio to raw, from the daemon's DRAM tier and (with none) from its "
          f"SSD; quality over the next turn against exact KV "
          f"({'computed alone' if args.against_alone else 'computed in the same batch'}), "
          f"{len(results[CODEC_NAMES[0]])} resumed requests")
    print(table(figures))
    print(f"\nhit rate of {TRACE.name} (prefix-reuse, {TRACE_BLOCK_TOKENS}-token blocks) by SSD budget")
    print(f"{'codec':>6} " + " ".join(f"{g:>6}GiB" for g in SSD_BUDGETS_GIB))
    for name, by_budget in hits.items():
        print(f"{name:>6} " + " ".join(f"{by_budget[f'{g}GiB']['token_hit_rate']:9.2%}" for g in SSD_BUDGETS_GIB))
    print("\naims: " + "; ".join(f"{name} {aim}" for name, aim in AIMS.items()))
    elapsed = time.perf_counter() - began
    print(f"measured in {elapsed:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"model": folder.name, "dtype": width, "prefixes": list(prefixes),
                                         "sessions": sessions, "codecs": figures, "hit_rates": hits,
                                         "ssd_budgets_gib": list(SSD_BUDGETS_GIB), "elapsed_s": elapsed}, indent=2))
    if args.plot:
        plot(figures, hits, args.plot)


if __name__ == "__main__":
    main()
