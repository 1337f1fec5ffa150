"""Prefill → decode across processes through the store: the continuation record (docs/protocol.md).

A decode instance continues a prompt of n tokens from the KV of its positions [0, n-1) and feeds the last
token itself, so that it samples the first reply token from its own logits with its own parameters and
seed, exactly as when it continues a prompt it prefilled in process. Of that KV, the full blocks
[0, F·B), F = (n-1) // B, are the conversation's ordinary blocks, which the prefill saves anyway; the rest
travels as one record of its own kind:

* the full layers' KV of positions [F·B, n-1): less than one block (the "partial last block");
* the sliding layers' window as of position n-1: positions [n-1-w, n-1), w = min(W, n-1 - window_from)
  (a window rebuilt by bounded replay holds nothing before `window_from`).

Its identity commits to the whole prompt and to this kind: tokens = the prompt's tokens from F·B to the
end (1..B of them, the last one included, since it is what the decode side feeds), parent = H(digest of
the handoff namespace ‖ key of block F-1, or the chain's namespace digest when F = 0), where the handoff
namespace is the chain's namespace under the model identity + HANDOFF_SUFFIX. So it can never be taken
for a block of the chain, and a replayed chain (`PrefillResult.exact` False) has continuation records of
its own. It is stored in the traffic class HANDOFF_CLASS, whose TTL is short (daemon config `classes`).

Payload, one layer (the record's layers are equal-sized; this one is read whole):

    prelude (20 bytes, little-endian): magic b"KVH1", version u16, reserved u16, position n-1 u32,
                                       window_from u32, window positions w u32
    full layers:    (n_full, 2, n-1 - F·B, kv_heads, head_dim)   in the namespace's dtype
    sliding layers: (n_sliding, 2, w, kv_heads, head_dim)        positions n-1-w .. n-2, in order

The same record carries a preempted decode sequence's state to its resumption (`engine.decode`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from engine.model.kv import RequestKV, WindowState
from engine.window.record import ring_slots, tensor_bytes, view_tensor, window_positions
from kvstore.block import Block, Namespace, chain_hash

HANDOFF_CLASS = "handoff"  # the traffic class of continuation records: a short TTL, they are read once
HANDOFF_SUFFIX = "#handoff"  # the model identity suffix of the namespace continuation records are keyed in
_PRELUDE = struct.Struct("<4sHHIII")  # magic, version, reserved, position, window_from, window positions
_MAGIC, _VERSION = b"KVH1", 1


class CorruptContinuation(ValueError):
    """A continuation record that does not describe the prompt and model it was read for."""


@dataclass(frozen=True)
class Continuation:
    """Where a prompt's continuation state lives: its record's block, and the chain's leading full blocks."""

    record: Block
    blocks: list[Block]  # the chain's blocks of [0, F·B)

    @property
    def position(self) -> int:
        """n-1: the KV covers [0, position); the token at `position` is fed by the decode side."""
        return self.blocks_tokens + len(self.record.tokens) - 1

    @property
    def blocks_tokens(self) -> int:
        return sum(len(b.tokens) for b in self.blocks)


def continuation(chain: Namespace, tokens: Sequence[int]) -> Continuation:
    """The continuation record of `tokens` (at least one) in `chain`, the namespace of the prompt's blocks."""
    if not len(tokens):
        raise ValueError("a continuation needs at least one token: the one the decode side feeds")
    full = (len(tokens) - 1) // chain.block_tokens
    blocks = chain.blocks(tokens[: full * chain.block_tokens])
    space = chain.with_model_id(chain.model_id + HANDOFF_SUFFIX)
    parent = xxhash.xxh3_128_digest(space.digest + (blocks[-1].key if blocks else chain.digest))
    tail = tuple(int(t) for t in tokens[full * chain.block_tokens :])
    record = Block(space.digest, chain_hash(parent, tail, chain.tenant), parent, tail, chain.tenant)
    return Continuation(record, blocks)


def encode(kv: RequestKV, position: int, window: WindowState | None) -> bytes:
    """The payload of the continuation at `position` of `kv`, whose pages hold positions [0, position) and
    `window` the sliding layers' window as of `position` (None for a model without sliding layers)."""
    B = kv.block_tokens
    page, tail = kv.block_table[position // B] if position % B else 0, position % B
    # (n_full, 2, tail, kv_heads, head_dim): a tail lies inside one page
    full = torch.stack([layer[page, :, :tail] for layer in kv.pool.layers]) if kv.pool.layers else torch.zeros(0)
    window_from, sliding = 0, torch.zeros(0)
    if window is not None:
        assert window.position == position, "the window must be as of the continuation's position"
        window_from = window.window_from
        w = window_positions(position, window_from, kv.window)
        # (n_sliding, 2, w, kv_heads, head_dim), in position order
        sliding = window.rings[:, :, ring_slots(position, w, kv.window, window.rings.device)]
    else:
        w = 0
    prelude = _PRELUDE.pack(_MAGIC, _VERSION, 0, position, window_from, w)
    return prelude + tensor_bytes(full) + tensor_bytes(sliding)


def restore(payload: bytes | bytearray | memoryview, kv: RequestKV, position: int, exact: bool) -> None:
    """Write the continuation at `position` into `kv`: the tail into its pages (already reserved), the window
    into its rings. CorruptContinuation, leaving `kv`'s pages of [0, F·B) untouched, if it does not fit, or
    if it holds a replayed window (`window_from` > 0) for an `exact` chain."""
    view = memoryview(payload).cast("B")
    if len(view) < _PRELUDE.size:
        raise CorruptContinuation(f"{len(view)} bytes: shorter than the prelude")
    magic, version, _, at, window_from, w = _PRELUDE.unpack_from(view)
    if (magic, version) != (_MAGIC, _VERSION):
        raise CorruptContinuation(f"magic {magic!r} version {version}: not a continuation record this engine reads")
    expected_w = window_positions(position, window_from, kv.window) if kv.rings is not None else 0
    if exact and window_from:
        raise CorruptContinuation(f"a replayed window (from {window_from}) in an exact chain's record")
    if at != position or window_from > position or w != expected_w:
        raise CorruptContinuation(f"record at position {at} (window from {window_from}, {w} positions) does not "
                                  f"continue position {position}")
    B, tail = kv.block_tokens, position % kv.block_tokens
    pages = kv.pool.layers  # per full layer (num_pages, 2, block_tokens, kv_heads, head_dim)
    tail_shape = (2, tail, *pages[0].shape[3:]) if pages else ()
    ring_shape = (kv.rings.shape[0], 2, w, *kv.rings.shape[3:]) if kv.rings is not None else ()
    tail_bytes = math.prod(tail_shape) * pages[0].element_size() if pages else 0
    ring_bytes = math.prod(ring_shape) * kv.rings.element_size() if kv.rings is not None else 0
    if len(view) != _PRELUDE.size + len(pages) * tail_bytes + ring_bytes:
        raise CorruptContinuation(f"{len(view)} bytes do not hold the KV of a {tail}-token tail and a "
                                  f"{w}-position window for this model")
    offset = _PRELUDE.size
    if tail:
        page = kv.block_table[position // B]
        for layer in pages:
            layer[page, :, :tail] = view_tensor(view[offset : offset + tail_bytes], layer.dtype, tail_shape,
                                                layer.device)
            offset += tail_bytes
    if kv.rings is not None:
        kv.rings.zero_()
        if w:
            slots = ring_slots(position, w, kv.window, kv.rings.device)
            kv.rings[:, :, slots] = view_tensor(view[offset:], kv.rings.dtype, ring_shape, kv.rings.device)
        kv.window_from = window_from
    kv.length = position

