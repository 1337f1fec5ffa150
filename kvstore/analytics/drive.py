"""`kvstore analytics replay TRACE --servers ...`: the trace through running daemons, for real.

Each request is served as an engine would: Lookup, Get of the hit, Put of the missing full blocks (leaf
first). Block keys come from the trace's hash ids (two synthetic tokens per block name the id, so
equal ids make equal chained keys), payloads are `payload_bytes` of zeros in one layer. The daemons'
own capacity and policy decide what stays, so their hit rate can be set beside the simulator's.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.analytics.simulate import Progress, ReplayResult, continuation_signals
from kvstore.analytics.trace import Request, conversation_turns
from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.eviction import ReuseHint


def replay_through_daemons(requests: Sequence[Request], servers: str, payload_bytes: int = 4096,
                           block_tokens: int = 512, progress: Progress | None = None,
                           continuation_signal: float | None = None, security: dict | None = None) -> ReplayResult:
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=max(1, payload_bytes // 8), dtype="float16")
    namespace = Namespace("kvstore-analytics-replay", layout, block_tokens=2)
    payload = bytes(namespace.block_bytes)
    result = ReplayResult("daemons", None)
    config = ClientConfig(tuple(s for s in servers.split(",") if s), timeout_s=30, **(security or {}))
    turns = conversation_turns(requests, block_tokens)
    signals = None if continuation_signal is None else continuation_signals(requests, continuation_signal, block_tokens)
    with KVClient(config) as client:
        for number, request in enumerate(requests):
            full = request.input_length // block_tokens
            tokens = [t for key in request.hash_ids[:full] for t in (key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF)]
            blocks = namespace.blocks(tokens)
            hit = len(client.get(blocks[: client.lookup(blocks)])) if blocks else 0
            result.requests += 1
            result.blocks += len(request.hash_ids)
            result.hit_blocks += hit
            result.tokens += request.input_length
            result.hit_tokens += hit * block_tokens
            if blocks[hit:]:
                client.put([(block, payload) for block in blocks[hit:]], layout.num_layers, request.traffic_class,
                           ReuseHint(hit, full, turns[number]))
            if signals is not None and blocks:  # the reply is done: the engine says if the conversation goes on
                client.advise(blocks, signals[number])
            if progress is not None:
                progress(number + 1)
        result.evictions = int(sum(s.value("kvstore_evictions_total") for s in client.server_stats().values() if s))
    return result
