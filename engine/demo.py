"""`make demo`: a small model served through the prefill engine and two daemons, turn after turn.

A random-weight gpt-oss-style hybrid (sliding-window and full layers alternating, MoE; shapes in
`engine.random_model.DEMO`) serves chat and agent sessions that share a system prompt. Each turn's
prompt is the whole conversation so far. Per request it prints how many prompt tokens came from the
cache, from which tier (this process's host tier, a daemon's DRAM or its SSD), the path the sliding
window took, and the time to first token beside the same prompt computed without the cache (with the
first tokens compared). Half-way, both daemons and the client restart: hits then come from SSD, while
the engine's host-memory window tier (a live process) still resumes sessions exactly.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from engine.prefill.config import PrefillConfig
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import PrefillRequest
from engine.random_model import DEMO, write_random_model
from kvstore.client import ClientConfig, KVClient
from kvstore.demo import demo_main, restarted, tier_hits
from kvstore.server.process import DaemonProcess

BLOCK_TOKENS = 64


def run(sessions: int, turns: int, workdir: Path) -> None:
    rng = np.random.default_rng(0)
    write_random_model(workdir / "model", DEMO)
    daemons = [DaemonProcess(workdir / f"daemon{i}", workdir).start() for i in range(2)]
    print(f"started 2 daemons on {', '.join(d.address for d in daemons)}; fitting the chunk cost model ...")
    cold_engine = PrefillEngine.from_pretrained(workdir / "model", None, PrefillConfig(block_tokens=BLOCK_TOKENS))
    block_bytes = cold_engine.block_bytes
    config = ClientConfig(tuple(d.address for d in daemons), host_tier_bytes=48 * block_bytes,
                          host_block_bytes=block_bytes)
    client = KVClient(config)
    engine = PrefillEngine(cold_engine.model, client, PrefillConfig(block_tokens=BLOCK_TOKENS, cost=cold_engine.cost),
                           cold_engine.model_id)
    mc = engine.model.config
    print(f"model: {mc.num_layers} layers ({len(mc.full_layers)} full, {len(mc.sliding_layers)} sliding, window "
          f"{mc.sliding_window}), {mc.num_experts} experts; {BLOCK_TOKENS}-token blocks of "
          f"{block_bytes / 2**20:.2f} MiB; host tier {config.host_tier_bytes // 2**20} MiB\n")
    system_prompt = rng.integers(0, mc.vocab_size, 512).tolist()
    conversations = [list(system_prompt) for _ in range(sessions)]
    print(f"{'turn':>4} {'session':>9} {'prompt':>6} {'hit':>6}  {'path':<14} {'host':>4} {'DRAM':>4} {'SSD':>4} "
          f"{'ttft':>7} {'no cache':>8} {'speed-up':>8}  same token")
    totals = Counter()
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
                print(f"{turn + 1:>4} {traffic_class + str(number):>9} {len(conversation):>6} {result.loaded_tokens:>6}  "
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


if __name__ == "__main__":
    torch.manual_seed(0)
    demo_main(run, __doc__, sessions=4, turns=4, prefix="kvstore-engine-demo-")
