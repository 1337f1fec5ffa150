"""Bounded replay: rebuild a lost sliding-window state from the last R tokens of a stored prefix.

A hybrid model's full-attention KV is stored, but its sliding layers' window state lives only in the
host tier and, while the session is active, in the store's window record; when a resumed session's
state is gone from both, recomputing the whole prompt is exact but costs as much as a cold start.
Bounded replay (docs/design.md section 8; R = W = 128 in DeepSeek-V4) instead loads the stored prefix
of P tokens and recomputes only [P - R, P): the full layers attend to the whole prefix (they keep the
loaded KV, rather than overwrite it with the replay's), the sliding layers only within the replay
segment. The window it leaves at P is approximate, since the first replayed tokens see a truncated
window; with R >= P it is exact. The quality this costs is measured by `bench/swa_replay_quality.py`;
the engine picks replay only where it saves much (`worth_replaying`).

    start = begin_replay(kv, prefix=P, replay_tokens=R)   # kv holds the full layers' KV of [0, P)
    model.forward([Chunk(kv, tokens[start:], start)])      # the replay and the new tokens, as usual
"""

from __future__ import annotations

from engine.model.kv import RequestKV
from kvstore.block import Namespace

REPLAYED_SUFFIX = "#replayed"  # the model identity of the namespace that holds KV computed after a replay
# The default R, in windows: chosen from the quality measured on Gemma 3 270M (docs/performance.md, "Bounded replay").
REPLAY_WINDOWS = 2


def replayed_namespace(namespace: Namespace) -> Namespace:
    """The twin of `namespace` whose chain holds KV computed after a replay: approximate, so never read by
    exact requests, and followed by later turns of the replayed conversation."""
    return namespace.with_model_id(namespace.model_id + REPLAYED_SUFFIX)


def default_replay_tokens(window: int) -> int:
    """R for a model whose sliding window is `window` tokens."""
    return REPLAY_WINDOWS * window


def begin_replay(kv: RequestKV, prefix: int, replay_tokens: int) -> int:
    """Set `kv`, whose full layers hold the loaded KV of positions [0, prefix), to rebuild its window by
    replaying the last `replay_tokens` of the prefix; returns the position to compute from."""
    if replay_tokens < 1:
        raise ValueError(f"bounded replay needs at least one token to replay, got {replay_tokens}")
    if prefix < 1:
        raise ValueError(f"bounded replay needs a stored prefix, got {prefix} tokens")
    if kv.rings is None:
        raise ValueError("bounded replay rebuilds sliding-window state; this model has no sliding layers")
    if prefix > len(kv.block_table) * kv.block_tokens:
        raise ValueError(f"the prefix of {prefix} tokens is larger than the KV pages reserved "
                         f"({len(kv.block_table) * kv.block_tokens} tokens); reserve them first")
    start = max(0, prefix - replay_tokens)
    kv.window_from = start
    kv.keep_full_before = prefix
    return start


def worth_replaying(prefix: int, exact_resume: int, replay_tokens: int, min_prefix_factor: float) -> bool:
    """Whether replaying to resume at `prefix` beats resuming exactly at `exact_resume` (0: from scratch).

    Replay computes `replay_tokens` more than resuming at the prefix would; it is chosen only where the
    prefix is at least `min_prefix_factor` replays long (so most of the prefix's compute is saved) and
    it recomputes less than the exact resume would."""
    return prefix >= min_prefix_factor * replay_tokens and prefix - replay_tokens > exact_resume
