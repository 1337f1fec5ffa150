"""The prefill engine's one config."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.prefill.cost import ChunkCost
from kvstore.codec import DEFAULT as DEFAULT_CODEC
from kvstore.codec import codec_named

# Tokens per KV page and per stored block: the default of every engine process (the prefill and decode engines,
# kvstore-api, decode instances). The block size is part of the store's namespace, so processes that differ in it
# share no cached block. 64: each chat turn leaves about half a block of its prompt and of its reply uncached; at
# 64 tokens a multi-turn chat cached 0.987 of what a token-granular cache would, at a TTFT within the spread of
# 32-token blocks and half their records and lookups per token; 256-token blocks cached 0.884 of it at twice
# the TTFT (bench/block_size.py, docs/performance.md "Block size for chat").
BLOCK_TOKENS = 64
KV_PAGES = 2048  # of BLOCK_TOKENS each: 131,072 tokens of KV per full layer


@dataclass(frozen=True)
class PrefillConfig:
    block_tokens: int = BLOCK_TOKENS  # the store's block size: one KV page
    kv_pages: int = KV_PAGES  # pages in the engine's pool (per full layer)
    step_budget_s: float = 0.25  # what one step's chunks may cost, by the fitted model
    window_tier_bytes: int = 256 * 2**20  # host memory for sliding-window states of active sessions
    # Save each session's latest window state in the store too (engine.window.record), so that a restarted
    # engine or another instance resumes it exactly
    store_windows: bool = True
    cost: ChunkCost | None = None  # None: fit at start-up on this machine
    load_timeout_s: float = 30.0  # a layer not loaded within this is treated as a failed load
    # A prefill `from_handoff` first waits (off the engine thread) up to this long for the store writes this
    # process queued before it: the continuation record of a sequence it preempted may still be on its way
    handoff_wait_s: float = 2.0
    model_id: str | None = None  # the namespace's model identity; None: directory name + weights digest
    # The form stored blocks and window records take (kvstore/codec.py): raw, zstd (lossless), int8 or int4
    # (quantised; docs/performance.md states what each costs in quality). Part of the namespace
    kv_codec: str = DEFAULT_CODEC
    # Bounded replay (engine.window) where a hybrid model's window state is gone:
    replay_tokens: int | None = None  # R; None: the default for the model's window; 0: never replay
    replay_min_prefix_factor: float = 2.0  # replay only a prefix at least this many times R long
    exact_tenants: frozenset[str] = field(default_factory=frozenset)  # tenants (hex, `kvstore tenant`) never replayed

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.kv_pages < 1:
            raise ValueError("PrefillConfig: block_tokens and kv_pages must be >= 1")
        if self.step_budget_s <= 0 or self.load_timeout_s <= 0 or self.handoff_wait_s < 0:
            raise ValueError("PrefillConfig: step_budget_s and load_timeout_s must be positive, handoff_wait_s >= 0")
        codec_named(self.kv_codec, "PrefillConfig")
        if self.window_tier_bytes < 0:
            raise ValueError("PrefillConfig: window_tier_bytes must be >= 0")
        replay = self.replay_tokens
        if replay is not None and (not isinstance(replay, int) or isinstance(replay, bool) or replay < 0):
            raise ValueError("PrefillConfig: replay_tokens must be an integer >= 0 (0: never replay), "
                             "or None for the default")
        if self.replay_min_prefix_factor < 1:
            raise ValueError("PrefillConfig: replay_min_prefix_factor must be >= 1 "
                             "(a replay no longer than the prefix)")
        if not isinstance(self.exact_tenants, (set, frozenset)):
            raise ValueError("PrefillConfig: exact_tenants must be a set of tenant digests (hex strings)")
        object.__setattr__(self, "exact_tenants", frozenset(self.exact_tenants))  # frozen: hashable
        for tenant in self.exact_tenants:
            if not isinstance(tenant, str) or len(tenant) != 32 or any(c not in "0123456789abcdef" for c in tenant):
                raise ValueError(f"PrefillConfig: exact_tenants holds {tenant!r}, not a tenant digest; give the "
                                 "32 hex digits `kvstore tenant SALT` prints")
