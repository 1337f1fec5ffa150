"""The prefill side of the multi-host test, on engine host A: `ip netns exec NS python -m tests.multihost.prefill_host`.

It holds a prefill engine on the real model, a client of the three daemons, and a client of the decode
instance on engine host B. Commands come one JSON object a line on stdin, answers go one a line on stdout:

    {"op": "run", "prompt": [...], "max_tokens": 8, "flush_s": F, "reply_s": R}
        prefill `prompt` with hand_off (its blocks and continuation record to the store), wait for the
        store to have them (at most F s), ask the instance to continue it from the handoff (at most R s):
        the paths, timings and the reply's tokens
    {"op": "lookup", "prompt": [...]}   how many of the prompt's blocks the store holds (leading), and
                                        which daemon owns each by placement over all three
    {"op": "stats"}                     each daemon's Get hits, Lookup hits and blocks (an admin token)

Secrets come in the environment, never argv: KVSTORE_TOKEN (the store's), INSTANCE_TOKEN, OPS_TOKEN. It
ends at the end of stdin (and with its parent: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import TimeoutError as FutureTimeout

import torch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--servers", required=True)
    parser.add_argument("--instance", required=True)
    parser.add_argument("--tls-ca", required=True)
    parser.add_argument("--tls-cert", required=True)
    parser.add_argument("--tls-key", required=True)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--kv-pages", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)  # two cores for five hosts: one torch thread each

    from engine.prefill import PrefillConfig, PrefillEngine, PrefillRequest
    from engine.prefill.cost import ChunkCost
    from engine.serving.client import InstanceClient
    from kvstore.client import ClientConfig, KVClient
    from kvstore.client.placement import place

    servers = tuple(args.servers.split(","))
    tls = dict(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
    client = KVClient(ClientConfig(servers, token=os.environ["KVSTORE_TOKEN"], **tls))
    ops = KVClient(ClientConfig(servers, token=os.environ["OPS_TOKEN"], **tls))
    # a fixed cost model (about this machine's): nothing timed at start-up, and loading a 64-token block
    # (384 KB) always beats computing it, so the paths say what the store held, not what a fit guessed
    config = PrefillConfig(block_tokens=args.block_tokens, kv_pages=args.kv_pages, cost=ChunkCost(1e-9, 2e-3, 5e-3))
    engine = PrefillEngine.from_pretrained(args.model, client, config, torch.float32)  # as the instance's
    instance = InstanceClient(args.instance, token=os.environ["INSTANCE_TOKEN"], **tls)
    print(json.dumps({"ready": True}), flush=True)

    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "run":
            answer = run(engine, instance, PrefillRequest, command)
        elif op == "lookup":
            blocks = engine.namespace().blocks(command["prompt"])
            answer = {"blocks": len(blocks), "stored": client.lookup(blocks),
                      "owners": [place(b.key, servers) for b in blocks]}
        elif op == "stats":
            answer = {}
            for address, stats in ops.server_stats().items():
                answer[address] = None if stats is None else {
                    "hits": stats.value("kvstore_hits_total"), "lookup_hits": stats.value("kvstore_lookup_hits_total"),
                    "blocks": stats.value("kvstore_blocks")}
        else:
            answer = {"error": f"unknown op {op!r}"}
        answer["client_errors"] = client.last_errors()
        print(json.dumps(answer), flush=True)
    instance.close()
    client.close()
    ops.close()
    return 0


def run(engine, instance, PrefillRequest, command: dict) -> dict:
    started = time.monotonic()
    result = engine.prefill(PrefillRequest(command["prompt"], hand_off=True, exact=True))
    result.kv.release()
    prefilled = time.monotonic()
    flushed = engine.flush(command["flush_s"])
    handed = time.monotonic()
    answer = {"prefill_path": result.path, "stored_tokens": result.stored_tokens,
              "loaded_tokens": result.loaded_tokens, "first_token": result.first_token, "flushed": flushed,
              "prefill_s": prefilled - started, "flush_s": handed - prefilled}
    future = instance.generate(command["prompt"], command["max_tokens"], from_handoff=True)
    try:
        reply = future.result(command["reply_s"])
    except FutureTimeout:
        future.cancel()
        answer["hung"] = f"no reply within {command['reply_s']} s"
        return answer
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        answer["error"] = repr(exc)
        return answer
    answer.update(tokens=reply.tokens, instance_path=reply.prefill_path, cached_tokens=reply.cached_tokens,
                  reply_s=time.monotonic() - handed, total_s=time.monotonic() - started)
    return answer


if __name__ == "__main__":
    sys.exit(main())
