"""Reading ahead of a session's next turn, and decoding while the store stalls, on the real Gemma 3 270M.

    python bench/prefetch.py [--json out.json] [--agents 2] [--chats 4] [--turns 4] [--pause 0.5]
                             [--tier-mib 8] [--daemon-tier-mib M] [--window-tier-mib 32] [--no-stall]

Sessions on real text (`engine.text.real_text`: one shared short system prompt, then each session's own user
turns; an agent's turns carry long tool results), served round robin through one prefill engine and one
daemon. A turn is a prefill of the whole conversation so far (its TTFT is measured; the reply is a short
fixed text, added to the next turn's prompt), its blocks and window record saved. Every agent turn ends in
a tool call: the next one starts after `--pause` (the tool's run) and after every other session's turn.
Before each turn the daemon's segment files are dropped from the page cache (posix_fadvise DONTNEED), so a
block the daemon holds only on SSD is read from the disk. Three ways, each on a fresh daemon and client:

    none     the daemon's DRAM tier and the client's host tier each hold `--tier-mib` MiB, and the engine's
             window tier `--window-tier-mib`, less than the sessions' blocks and windows: round robin, most
             continued turns find their blocks and window record on SSD only
    advice   the same tiers; each agent reply is advised as going on, as `kvstore-api` does: the daemon
             promotes the chain into its DRAM tier, the client prefetches it into its host tier and the
             engine reads the window record ahead (`PrefillEngine.prefetch`)
    advice_daemon_only
             as advice, without a host tier in the client (kvstore-api's default): only the daemon's
             promotion and the window's read ahead serve the next turn
    dram     tiers that hold the whole working set (1 GiB each), no advice

Reported per way, for the continued agent turns (the first turn is cold everywhere) and for the chat turns
(never advised: the control): TTFT median and min..max; `ssd_turn_ttft_over_dram` = median TTFT of a way's
continued turns over the dram way's (aim <= 1.1 with advice); cold reads from SSD during a turn (the
daemon's Get hits served from SSD; aim 0 for advised turns); and what was read ahead: blocks promoted,
prefetched and window records read ahead, used and wasted, and bytes wasted per byte used.

The stall: 8 sequences decode (greedy, 256-token prompts) in a decode engine on the store; after a few
steps the daemon is paused (SIGSTOP) for 2 s while a ninth request, the next turn of a stored conversation,
resumes from it. Reported: the running sequences' step times while the daemon is paused, beside the same
engine's steps without a store (median, max) and the ratio; and what happened to the ninth.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams  # noqa: E402
from engine.model.decoder import Decoder  # noqa: E402
from engine.model.weights import model_identity  # noqa: E402
from engine.prefill.config import PrefillConfig  # noqa: E402
from engine.prefill.engine import PrefillEngine  # noqa: E402
from engine.prefill.request import PrefillRequest  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

MIB = 2**20
WAYS = ("none", "advice", "advice_daemon_only", "dram")
BLOCK_TOKENS = 64
REPLIES = {"agent": "I will call the tool for that.", "chat": "Understood; thank you, go on."}


def conversations(tokenizer, agents: int, chats: int, turns: int) -> list[tuple[str, str, list[list[int]]]]:
    """(name, kind, the prompt of each turn): each prompt holds the previous one, the reply and a user turn."""
    from engine.text.real_text import AGENT, CHAT, TOPICS, Session, system_prompt

    system = system_prompt(reference_docs=1)  # shared by every session; short, so their own turns weigh
    out = []
    for number, kind in enumerate([AGENT] * agents + [CHAT] * chats):
        start = (5 * number) % len(TOPICS)
        session = Session(tokenizer, f"{kind}{number}", kind, TOPICS[start:] + TOPICS[:start], system)
        prompts = []
        for _ in range(turns):
            prompts.append(session.next_prompt())
            session.add_reply(REPLIES[kind])
        out.append((session.name, kind, prompts))
    return out


def drop_page_cache(daemon_dir: Path) -> None:
    """Have the kernel forget the daemon's segment files, so a read of them goes to the disk."""
    for path in (daemon_dir / "segments").glob("*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ssd_hits(client: KVClient) -> float:
    return sum(stats.value("kvstore_hits_total", tier="ssd") for stats in client.server_stats().values() if stats)


def daemon_counts(client: KVClient) -> dict[str, float]:
    """The daemon's promotion counters (kvstore_promoted_*), summed over labels."""
    out: dict[str, float] = {}
    for stats in client.server_stats().values():
        for sample in stats or ():
            if sample.name.startswith("kvstore_promot") and sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0) + sample.value
    return out


def serve(way: str, model: Decoder, model_id: str, cost, block_bytes: int, sessions, args,
          workdir: Path) -> dict:
    """Every session's turns, round robin, through a fresh daemon, client and engine set up `way`'s way."""
    tier = 1024 * MIB if way == "dram" else args.tier_mib * MIB
    dram = 1024 * MIB if way == "dram" else (args.daemon_tier_mib or args.tier_mib) * MIB
    daemon_dir = workdir / f"daemon-{way}"
    daemon = DaemonProcess(daemon_dir, workdir, ["--hot-tier-bytes", str(dram), "--promote-bytes", str(dram // 2)])
    rows = []
    daemon.start()
    try:
        host = {} if way == "advice_daemon_only" else {"host_tier_bytes": tier, "host_block_bytes": block_bytes}
        config = ClientConfig(servers=(daemon.address,), prefetch_bytes=tier, **host)
        with KVClient(config) as client, ThreadPoolExecutor(1, thread_name_prefix="advise") as advising:
            windows = 1024 * MIB if way == "dram" else args.window_tier_mib * MIB
            engine = PrefillEngine(model, client, PrefillConfig(block_tokens=BLOCK_TOKENS, kv_pages=512, cost=cost,
                                                                window_tier_bytes=windows), model_id)
            for turn in range(args.turns):
                for name, kind, prompts in sessions:
                    if kind == "agent" and turn:
                        time.sleep(args.pause)  # the tool runs
                    advising.submit(lambda: None).result()  # what was advised has been sent (not: is done)
                    assert client.write_behind.flush(60)
                    drop_page_cache(daemon_dir)
                    before = ssd_hits(client)
                    started = time.perf_counter()
                    result = engine.prefill(PrefillRequest(prompts[turn], traffic_class=kind, session_id=name,
                                                           turn=turn))
                    ttft = time.perf_counter() - started
                    result.kv.release()
                    rows.append({"session": name, "kind": kind, "turn": turn, "ttft_s": ttft,
                                 "prompt_tokens": len(prompts[turn]), "loaded_tokens": result.loaded_tokens,
                                 "path": result.path, "window_source": result.window_source,
                                 "sources": result.sources, "ssd_reads": ssd_hits(client) - before})
                    print(f"  {way:>6} turn {turn} {name:>7}: {ttft:.3f} s, {result.path}, loaded "
                          f"{result.loaded_tokens}/{len(prompts[turn])}, window {result.window_source}, "
                          f"{rows[-1]['ssd_reads']:.0f} SSD reads", flush=True)
                    if way.startswith("advice") and kind == "agent":  # as kvstore-api's: the reply ends in a tool call
                        blocks = engine.namespace().blocks(prompts[turn])
                        advising.submit(client.advise, blocks, True)
                        advising.submit(engine.prefetch, blocks)
            stats = client.stats
            prefetched = {"client_prefetched": stats.prefetched, "client_used": stats.prefetch_used,
                          "client_wasted": stats.prefetch_wasted, "client_refused": stats.prefetch_refused,
                          **{f"window_records_{k}": v for k, v in engine.windows.prefetches.items()},
                          **{f"window_holds_{k}": v for k, v in engine.windows.tier.holds.items()},
                          **daemon_counts(client)} if engine.windows is not None else {}
            engine.close()
    finally:
        daemon.stop()
    return {"rows": rows, "read_ahead": prefetched}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(runs: dict[str, dict], block_bytes: int, record_bytes: int) -> dict:
    out: dict = {}
    for way, run in runs.items():
        for kind in ("agent", "chat"):
            rows = [r for r in run["rows"] if r["kind"] == kind and r["turn"] > 0]
            out[f"{way}_{kind}_ttft_s"] = _spread([r["ttft_s"] for r in rows])
            out[f"{way}_{kind}_ssd_reads_per_turn"] = _spread([r["ssd_reads"] for r in rows])
        out[f"{way}_read_ahead"] = run["read_ahead"]
    dram = out["dram_agent_ttft_s"]["median"]
    for way in ("none", "advice", "advice_daemon_only"):
        out[f"ssd_turn_ttft_over_dram_{way}"] = out[f"{way}_agent_ttft_s"]["median"] / dram
        out[f"chat_ttft_over_dram_{way}"] = out[f"{way}_chat_ttft_s"]["median"] / out["dram_chat_ttft_s"]["median"]
    for way in ("advice", "advice_daemon_only"):  # per level: the daemon's DRAM, the host tier, window records
        ahead = runs[way]["read_ahead"]
        levels = {"daemon": (ahead.get("kvstore_promoted_wasted_bytes_total", 0),
                             ahead.get("kvstore_promoted_used_bytes_total", 0)),
                  "host": (ahead.get("client_wasted", 0) * block_bytes, ahead.get("client_used", 0) * block_bytes),
                  "window_records": (ahead.get("window_records_wasted", 0) * record_bytes,
                                     ahead.get("window_records_used", 0) * record_bytes)}
        for level, (wasted, used) in levels.items():
            out[f"{way}_{level}_wasted_bytes_per_used_byte"] = wasted / used if used else None
    return out


def stall(model: Decoder, model_id: str, cost, workdir: Path, tokenizer) -> dict:
    """Step times of 8 decoding sequences: without a store, and with the daemon paused 2 s while a ninth
    request resumes from it."""
    from engine.text.real_text import demo_sessions

    prompts = [session.next_prompt()[-256:] for session in demo_sessions(tokenizer, 8)]
    config = PrefillConfig(block_tokens=BLOCK_TOKENS, kv_pages=1024, cost=cost)

    def decode_steps(engine: PrefillEngine, ninth=None, daemon: DaemonProcess | None = None) -> dict:
        decode = DecodeEngine(model, engine, DecodeConfig(speculative=False))
        running = [decode.submit(DecodeRequest(PrefillRequest(prompt), SamplingParams(max_tokens=512)))
                   for prompt in prompts]
        while decode.running < 8:
            decode.step()
        for _ in range(3):
            decode.step()  # past the prefills
        times, resumed = [], None
        if daemon is not None:
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGSTOP)
            resumed = decode.submit(DecodeRequest(ninth, SamplingParams(max_tokens=8)))
        waiting: list[float] = []  # steps taken while the ninth waited on the paused daemon
        try:
            deadline = time.perf_counter() + 2.0
            while time.perf_counter() < deadline:
                on_store = engine.waiting_on_store
                started = time.perf_counter()
                decode.step()
                times.append(time.perf_counter() - started)
                if on_store:
                    waiting.append(times[-1])
        finally:
            if daemon is not None and daemon.proc is not None:
                daemon.proc.send_signal(signal.SIGCONT)
        out = {"steps": len(times), "step_s": _spread(times)}
        if waiting:
            out["while_waiting_on_store_s"] = _spread(waiting)
        if resumed is not None:
            done = {}
            while resumed not in done:
                done.update((r.id, r) for r in decode.step())
            result = done[resumed]
            out["ninth"] = {"path": result.prefill_path, "window_source": result.window_source,
                            "cached_tokens": result.cached_tokens,
                            "first_token_s": result.token_times_s[0] if result.token_times_s else None,
                            "daemon_paused_s": 2.0}
        for request_id in running:
            decode.cancel(request_id)
        decode.step()  # returns the cancelled
        decode.close()
        return out

    without = decode_steps(PrefillEngine(model, None, config, model_id))
    daemon = DaemonProcess(workdir / "daemon-stall", workdir)
    daemon.start()
    try:
        with KVClient(ClientConfig(servers=(daemon.address,))) as client:
            first = PrefillEngine(model, client, config, model_id)
            conversation = demo_sessions(tokenizer, 9)[8]
            prompt = conversation.next_prompt()
            first.prefill(PrefillRequest(prompt, session_id="ninth")).kv.release()
            assert client.write_behind.flush(60)
            conversation.add_reply(REPLIES["chat"])
            ninth = PrefillRequest(conversation.next_prompt(), session_id="ninth", turn=1)
            engine = PrefillEngine(model, client, config, model_id)  # another instance: nothing in its tiers
            paused = decode_steps(engine, ninth, daemon)
            engine.close()
    finally:
        daemon.stop()
    waiting = paused.get("while_waiting_on_store_s", paused["step_s"])
    return {"without_store": without, "daemon_paused": paused,
            "waiting_max_over_without_median": waiting["max"] / without["step_s"]["median"],
            "waiting_median_over_without_median": waiting["median"] / without["step_s"]["median"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.5, help="seconds a tool runs between agent turns")
    parser.add_argument("--tier-mib", type=int, default=8,
                        help="the daemon's DRAM tier and the client's host tier, in the none and advice ways")
    parser.add_argument("--daemon-tier-mib", type=int, default=0,
                        help="the daemon's DRAM tier instead, where given (promotion may fill half of it)")
    parser.add_argument("--window-tier-mib", type=int, default=32,
                        help="the engine's window tier in the none and advice ways (Gemma 3 270M's window is "
                             "7.5 MiB in bf16: 32 MiB holds four sessions' windows)")
    parser.add_argument("--no-stall", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from engine.checkpoints.real_model import load_real_model

    folder, tokenizer = load_real_model()
    model = Decoder.from_pretrained(folder)
    model_id = model_identity(folder)
    print(f"{model.dtype}; measuring the chunk cost ...", flush=True)
    cost = PrefillEngine(model, None, PrefillConfig(block_tokens=BLOCK_TOKENS, kv_pages=256), model_id).cost
    sessions = conversations(tokenizer, args.agents, args.chats, args.turns)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-prefetch-bench-"))
    layout = PrefillEngine(model, None, PrefillConfig(block_tokens=BLOCK_TOKENS, kv_pages=4, cost=cost), model_id)
    block_bytes = layout.block_bytes
    mc = model.config
    record_bytes = len(mc.sliding_layers) * 2 * (mc.sliding_window or 0) * mc.num_kv_heads * mc.head_dim * \
        model.dtype.itemsize
    try:
        working = sum(len(prompts[-1]) for _, _, prompts in sessions) // BLOCK_TOKENS * block_bytes
        print(f"{len(sessions)} sessions, {args.turns} turns; blocks {block_bytes // 1024} KiB, window records "
              f"{record_bytes / MIB:.1f} MiB; working set {working / MIB:.0f} MiB of blocks and "
              f"{len(sessions) * record_bytes / MIB:.0f} MiB of windows; tiers {args.tier_mib} MiB, window tier "
              f"{args.window_tier_mib} MiB", flush=True)
        runs = {way: serve(way, model, model_id, cost, block_bytes, sessions, args, workdir) for way in WAYS}
        summary = summarise(runs, block_bytes, record_bytes)
        if not args.no_stall:
            summary["stall"] = stall(model, model_id, cost, workdir, tokenizer)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "summary": summary,
                                         "runs": runs}, indent=1, default=str))


def report(summary: dict) -> None:
    def spread(d: dict) -> str:
        return f"{d['median']:.3f} ({d['min']:.3f}..{d['max']:.3f}, n={d['n']})"

    print("\ncontinued turns      TTFT s, agent (advised)        TTFT s, chat (never advised)   "
          "SSD reads/turn agent, chat")
    for way in WAYS:
        print(f"  {way:<8} {spread(summary[f'{way}_agent_ttft_s']):>32}  {spread(summary[f'{way}_chat_ttft_s']):>32}"
              f"  {summary[f'{way}_agent_ssd_reads_per_turn']['median']:>6.0f}, "
              f"{summary[f'{way}_chat_ssd_reads_per_turn']['median']:.0f}")
    for way in ("none", "advice", "advice_daemon_only"):
        print(f"ssd_turn_ttft_over_dram_{way}: {summary[f'ssd_turn_ttft_over_dram_{way}']:.3f} (agent turns; "
              f"chat turns {summary[f'chat_ttft_over_dram_{way}']:.3f})")
    for way in ("advice", "advice_daemon_only"):
        print(f"read ahead ({way}): {summary[f'{way}_read_ahead']}")
    print("read ahead, bytes wasted per byte used: " + ", ".join(
        f"{k.removesuffix('_wasted_bytes_per_used_byte')} {v if v is None else round(v, 2)}"
        for k, v in summary.items() if k.endswith("_wasted_bytes_per_used_byte")))
    if "stall" in summary:
        s = summary["stall"]
        paused = s["daemon_paused"]
        print(f"stall: step s without a store {spread(s['without_store']['step_s'])}; daemon paused, all steps "
              f"{spread(paused['step_s'])}, while the ninth waited on the store "
              f"{spread(paused.get('while_waiting_on_store_s', paused['step_s']))}: max / median without a store "
              f"{s['waiting_max_over_without_median']:.2f}, median / median "
              f"{s['waiting_median_over_without_median']:.2f}"
              f"; ninth {paused.get('ninth')}")


if __name__ == "__main__":
    main()
