"""`make demo`: a real model (Gemma 3 270M) served through the prefill engine and two daemons, turn after turn.

Chat and agent sessions built from the standard library's documentation (`engine.text.real_text`: Gemma 3's
chat template, one shared system prompt, each turn's prompt the whole conversation so far) go through
the engine. Per request it prints how many prompt tokens came from the cache, from which tier (this
process's host tier, a daemon's DRAM or its SSD), the path the prompt took and where its sliding window came
from (`host`: this process's window tier; `store`: the session's window record in the store), the time to first
token beside the same prompt computed without the cache, and the start of the reply (12 greedy tokens from
the decode engine, decoded), which becomes the assistant's turn. The reply is compared with the reply
computed cold (the whole prompt recomputed without the cache, then the same greedy decoding): the column
"= exact" counts its leading tokens that agree, "12/12" where the whole reply is the same. Half-way, both
daemons, the client and the engine restart: hits then come from SSD, and the sliding-window states the
engine kept in host memory are gone, so each session's next turn reads its window from the record the engine
saved in the store beside the blocks (`engine.window.record`) and resumes exactly. Where neither holds
the window (the record expired), a turn rebuilds it by bounded replay (`replayed`: the stored prefix loaded,
its last R tokens recomputed). Exact paths (`cold`, `cached`, `window_missing`) give the cold reply token for
token; a replayed window is an approximation, so a replayed turn's reply, and that of a later turn whose KV
descends from the replay (marked "~"), may leave the exact one after some tokens: once one greedy token
differs, the rest continue a different text.

`--random` runs the earlier demo instead: a random-weight gpt-oss-style hybrid (sliding-window and full
layers alternating, MoE; `engine.checkpoints.random_model.DEMO`) on random token ids, with no model to install.
`--quick` is a shortened real run (two sessions, two turns, shorter replies) for the test suite.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from engine.checkpoints.random_model import DEMO, write_random_model
from engine.prefill.config import BLOCK_TOKENS, PrefillConfig
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import PrefillRequest
from kvstore.client import ClientConfig, KVClient
from kvstore.demo import restarted, tier_hits
from kvstore.server.process import DaemonProcess

REPLY_TOKENS = 12  # greedy tokens decoded per turn: enough to read the start of the reply


def run_real(sessions: int, turns: int, workdir: Path, reply_tokens: int = REPLY_TOKENS) -> None:
    # imported here so that --random needs neither the models extra nor the tokenizer
    from engine.checkpoints.real_model import load_real_model
    from engine.decode import DecodeEngine, DecodeRequest, SamplingParams
    from engine.text.real_text import demo_sessions, stop_token_ids

    began = time.perf_counter()
    print("loading Gemma 3 270M (converted once from the packaged GGUF, then cached) ...", flush=True)
    folder, tokenizer = load_real_model()
    daemons, cold_engine, config, client, engine = _serve(folder, workdir)
    block_bytes = cold_engine.block_bytes
    mc = engine.model.config
    stops = stop_token_ids(tokenizer)
    decoder = DecodeEngine(engine.model, engine)  # continues each prefill in its own KV pages: no recompute
    cold_decoder = DecodeEngine(cold_engine.model, cold_engine)  # the exact reference: no store, nothing reused
    conversations = demo_sessions(tokenizer, sessions)
    shared = _common_prefix([c.next_prompt() for c in conversations])
    print(f"model: {folder.name}, {mc.num_layers} layers ({len(mc.full_layers)} full, {len(mc.sliding_layers)} "
          f"sliding, window {mc.sliding_window}), vocabulary {mc.vocab_size:,}; {BLOCK_TOKENS}-token blocks of "
          f"{block_bytes / 2**20:.2f} MiB; host tier {config.host_tier_bytes // 2**20} MiB; ready in "
          f"{time.perf_counter() - began:.0f} s")
    print(f"{sessions} sessions of standard-library documentation through Gemma 3's chat template, sharing a "
          f"{shared}-token prefix (system prompt and a worked example); replies: {reply_tokens} greedy tokens "
          "from the decode engine, compared with the reply computed without the cache (= exact; ~: the KV "
          "descends from a bounded replay)\n")
    print(f"{'turn':>4} {'session':>9} {'prompt':>6} {'hit':>6}  {'path':<14} {'window':<6} {'host':>4} "
          f"{'DRAM':>4} {'SSD':>4} {'ttft':>7} {'no cache':>8} {'speed-up':>8}  = exact")
    totals: Counter[str] = Counter()
    try:
        for turn in range(turns):
            if turn == turns // 2 and turn:
                client = restarted(client, daemons, config)
                engine = PrefillEngine(engine.model, client, engine.config, engine.model_id)
                decoder = DecodeEngine(engine.model, engine)
                print("     -- both daemons, the client and the engine restarted: the store's blocks and window "
                      "records remain on SSD, the host tier's window states are gone --")
            for conversation in conversations:
                prompt = conversation.tokens if turn == 0 else conversation.next_prompt()
                before = tier_hits(client)
                result = engine.prefill(PrefillRequest(prompt, traffic_class=conversation.kind,
                                                       session_id=conversation.name, turn=turn))
                client.write_behind.flush(timeout=60)
                served = {k: v - before[k] for k, v in tier_hits(client).items()}
                cold = cold_engine.prefill(PrefillRequest(prompt))
                # each reply continues its prefill's KV (handed over in this process), one step per token
                sampling = SamplingParams(max_tokens=reply_tokens, stop_token_ids=stops)
                decoder.submit(DecodeRequest(result, sampling))
                (decoded,) = decoder.run()
                cold_decoder.submit(DecodeRequest(cold, sampling))
                (exact,) = cold_decoder.run()
                reply = decoded.tokens
                agree, length = _agreeing(reply, exact.tokens), max(len(reply), len(exact.tokens))
                kind = "exact" if result.exact else "replay"  # does this KV descend from a replay?
                text = tokenizer.decode([t for t in reply if t not in stops], skip_special_tokens=True)
                print(f"{turn + 1:>4} {conversation.name:>9} {len(prompt):>6} {result.loaded_tokens:>6}  "
                      f"{result.path:<14} {result.window_source or '-':<6} {served['host']:>4.0f} "
                      f"{served['daemon DRAM']:>4.0f} "
                      f"{served['daemon SSD']:>4.0f} {result.ttft_s:>6.2f}s {cold.ttft_s:>7.2f}s "
                      f"{cold.ttft_s / result.ttft_s:>7.1f}x  {agree}/{length}{'' if result.exact else ' ~'}")
                print(f"{'':>16}reply: {_one_line(text)}")
                totals.update({"prompt": len(prompt), "hit": result.loaded_tokens, "ttft": result.ttft_s,
                               f"window {result.window_source}": 1,
                               "cold": cold.ttft_s, kind: 1, f"{kind} same": agree == length,
                               "first": reply[0] == exact.tokens[0], "requests": 1})
                conversation.add_reply(text)  # the start of the reply stands for the whole answer
        print(f"\nall turns: {totals['hit']:,} of {totals['prompt']:,} prompt tokens from the cache "
              f"({totals['hit'] / totals['prompt']:.0%}); time to first token {totals['ttft']:.1f} s in all, "
              f"{totals['cold']:.1f} s without the cache ({totals['cold'] / totals['ttft']:.1f}x); "
              f"whole replies equal to the exact ones in {totals['exact same']} of {totals['exact']} requests "
              f"with exact KV and {totals['replay same']} of {totals['replay']} with KV from a replay; first "
              f"tokens agree in {totals['first']} of {totals['requests']} requests; windows resumed from the host tier "
              f"{totals['window host']} times, from the store's window records {totals['window store']}; "
              f"{time.perf_counter() - began:.0f} s in all")
    finally:
        client.close()
        codes = [daemon.stop() for daemon in daemons]
        print(f"daemons stopped (exit codes {codes})")


def _serve(folder: Path, workdir: Path):
    """Two daemons, a client with a host tier smaller than the working set, the engine over them, and a
    cacheless engine on the same weights for the "no cache" column."""
    daemons = [DaemonProcess(workdir / f"daemon{i}", workdir).start() for i in range(2)]
    print(f"started 2 daemons on {', '.join(d.address for d in daemons)}; fitting the chunk cost model ...",
          flush=True)
    cold_engine = PrefillEngine.from_pretrained(folder, None, PrefillConfig(block_tokens=BLOCK_TOKENS))
    block_bytes = cold_engine.block_bytes
    config = ClientConfig(tuple(d.address for d in daemons), host_tier_bytes=48 * block_bytes,
                          host_block_bytes=block_bytes)
    client = KVClient(config)
    engine = PrefillEngine(cold_engine.model, client, PrefillConfig(block_tokens=BLOCK_TOKENS, cost=cold_engine.cost),
                           cold_engine.model_id)
    return daemons, cold_engine, config, client, engine


def _agreeing(reply: list[int], exact: list[int]) -> int:
    """How many leading tokens of `reply` are those of `exact`."""
    n = 0
    while n < min(len(reply), len(exact)) and reply[n] == exact[n]:
        n += 1
    return n


def _common_prefix(prompts: list[list[int]]) -> int:
    shortest = min(prompts, key=len)
    for i, token in enumerate(shortest):
        if any(p[i] != token for p in prompts):
            return i
    return len(shortest)


def _one_line(text: str, width: int = 90) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[: width - 3] + "...")


def run_random(sessions: int, turns: int, workdir: Path) -> None:
    rng = np.random.default_rng(0)
    write_random_model(workdir / "model", DEMO)
    daemons, cold_engine, config, client, engine = _serve(workdir / "model", workdir)
    block_bytes = cold_engine.block_bytes
    mc = engine.model.config
    print(f"model: {mc.num_layers} layers ({len(mc.full_layers)} full, {len(mc.sliding_layers)} sliding, window "
          f"{mc.sliding_window}), {mc.num_experts} experts; {BLOCK_TOKENS}-token blocks of "
          f"{block_bytes / 2**20:.2f} MiB; host tier {config.host_tier_bytes // 2**20} MiB\n")
    system_prompt = rng.integers(0, mc.vocab_size, 512).tolist()
    conversations = [list(system_prompt) for _ in range(sessions)]
    print(f"{'turn':>4} {'session':>9} {'prompt':>6} {'hit':>6}  {'path':<14} {'host':>4} {'DRAM':>4} {'SSD':>4} "
          f"{'ttft':>7} {'no cache':>8} {'speed-up':>8}  same token")
    totals: Counter[str] = Counter()
    try:
        for turn in range(turns):
            if turn == turns // 2:
                client = engine.client = restarted(client, daemons, config)
                print("     -- both daemons and the client restarted: the store's blocks remain on SSD --")
            for number, conversation in enumerate(conversations):
                traffic_class = "agent" if number % 2 else "chat"
                conversation += rng.integers(0, mc.vocab_size, int(rng.integers(150, 350))).tolist()  # the user
                before = tier_hits(client)
                result = engine.prefill(PrefillRequest(conversation, traffic_class=traffic_class,
                                                       session_id=f"s{number}", turn=turn))
                result.kv.release()
                client.write_behind.flush(timeout=60)
                served = {k: v - before[k] for k, v in tier_hits(client).items()}
                cold = cold_engine.prefill(PrefillRequest(conversation))
                cold.kv.release()
                same = "yes" if cold.first_token == result.first_token else "NO"
                name = traffic_class + str(number)
                print(f"{turn + 1:>4} {name:>9} {len(conversation):>6} {result.loaded_tokens:>6}  "
                      f"{result.path:<14} {served['host']:>4.0f} {served['daemon DRAM']:>4.0f} "
                      f"{served['daemon SSD']:>4.0f} {result.ttft_s:>6.2f}s {cold.ttft_s:>7.2f}s "
                      f"{cold.ttft_s / result.ttft_s:>7.1f}x  {same}")
                totals.update(prompt=len(conversation), hit=result.loaded_tokens, ttft=result.ttft_s,
                              cold=cold.ttft_s, same=same == "yes", requests=1)
                conversation += [result.first_token]  # the reply: its first token, then a stand-in for the rest
                conversation += rng.integers(0, mc.vocab_size, int(rng.integers(50, 150))).tolist()
        print(f"\nall turns: {totals['hit']:,} of {totals['prompt']:,} prompt tokens from the cache "
              f"({totals['hit'] / totals['prompt']:.0%}); time to first token {totals['ttft']:.1f} s in all, "
              f"{totals['cold']:.1f} s without the cache ({totals['cold'] / totals['ttft']:.1f}x); "
              f"first tokens agree in {totals['same']} of {totals['requests']} requests; window tier: "
              f"{engine.window_tier.hits} hits, {engine.window_tier.misses} misses")
    finally:
        client.close()
        codes = [daemon.stop() for daemon in daemons]
        print(f"daemons stopped (exit codes {codes})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random", action="store_true", help="the random-weight model on random ids instead")
    parser.add_argument("--quick", action="store_true", help="a short run: 2 sessions, 2 turns, 4-token replies")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reply-tokens", type=int, default=REPLY_TOKENS)
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.turns, args.reply_tokens = 2, 2, 4
    if args.sessions < 1 or args.turns < 1 or args.reply_tokens < 1:
        parser.error("--sessions, --turns and --reply-tokens must be >= 1")
    torch.manual_seed(0)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-engine-demo-"))
    try:
        if args.random:
            run_random(args.sessions, args.turns, workdir)
        else:
            run_real(args.sessions, args.turns, workdir, args.reply_tokens)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
