"""Attention for a step in which every chunk is one token (a decode step), batched over the sequences;
and (`VerifyBatch`) for one of short chunks, a speculative step's verification chunks.

The general path (`Decoder._attention`) attends chunk by chunk: for one token, some twenty small tensor
ops per sequence and layer, which at batch 32 cost more host time than the attention's arithmetic. Here
each layer is one fused attention call over all sequences:

* full layers: each sequence's new K/V written into its page, then its pages gathered into a padded
  (B, L, kv_heads, head_dim) view (L = the longest sequence's pages x block tokens), positions past a
  sequence's own masked;
* sliding layers: the new K/V written into each ring, the rings stacked to (B, W, kv_heads, head_dim),
  slot s holding the latest position p' <= p with p' = s mod W, masked where p' < 0 or before the
  window the KV holds (a replay's start).

Used only where it computes what the general path does: one token per chunk, no attention sinks, no
window to capture in this step (those steps, one per block boundary, take the general path). It computes
it to float rounding, not bit for bit: padded keys change the order of the softmax's sums, so a
sequence's logits move by ~1e-6 with the lengths of the others in its step.

Memory: the full layers' gather is (B, longest sequence) per layer, not the sum of the lengths; for long
contexts at large batches, gathering only each sequence's own pages (a varlen kernel) is the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.model.kv import RequestKV


class DecodeBatch:
    """What every layer of one decode step shares: positions, padded block tables, ring masks."""

    def __init__(self, kvs: Sequence[RequestKV], positions: Sequence[int], device: torch.device) -> None:
        self.kvs = kvs
        self.pos = torch.tensor(positions, device=device)  # (B,)
        self.rows = torch.arange(len(kvs), device=device)
        first = kvs[0]
        if first.pool.layers:
            B = first.block_tokens
            width = max(p // B + 1 for p in positions)
            tables = [kv.block_table[:width] + [0] * (width - min(width, len(kv.block_table))) for kv in kvs]
            self.tables = torch.tensor(tables, device=device)  # (B, pages), padded with page 0
            self.page = self.tables[self.rows, self.pos // B]  # (B,) where each new token goes
            self.offset = self.pos % B
            self.full_mask = torch.arange(width * B, device=device)[None] <= self.pos[:, None]  # (B, L)
        if first.rings is not None:
            W = first.window
            self.slot = self.pos % W  # (B,)
            self.slots = min(W, max(positions) + 1)  # before the window fills, slots past the newest are empty
            held = self.pos[:, None] - (self.pos[:, None] - torch.arange(self.slots, device=device)[None]) % W
            lower = torch.tensor([kv.window_from for kv in kvs], device=device).clamp(min=0)
            self.ring_mask = held >= lower[:, None]  # (B, slots); held >= 0 too: window_from >= 0

    @staticmethod
    def applies(kvs: Sequence[RequestKV], sizes: Sequence[int], starts: Sequence[int]) -> bool:
        """Whether a step of these chunks can take the batched path."""
        if not kvs or any(n != 1 for n in sizes):
            return False
        pool = kvs[0].pool
        for kv, start in zip(kvs, starts):
            if kv.pool is not pool or start < kv.window_from or start < kv.keep_full_before:
                return False
            if pool.layers and len(kv.block_table) <= start // kv.block_tokens:
                return False  # no page for the new token: the general path fails loudly, never writes elsewhere
            if any(start <= boundary <= start + 1 for boundary in kv.capture_at):
                return False
        return True

    def full(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (B, heads, d), k and v (B, kv_heads, d) of full layer `layer`; returns (B, heads * d)."""
        keys, values = _write_and_gather(self.kvs[0].pool.layers[layer], self.page, self.offset, self.tables, k, v)
        return _attend(q, keys, values, self.full_mask, scale)

    def sliding(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (B, heads, d), k and v (B, kv_heads, d) of sliding layer `layer`; returns (B, heads * d)."""
        rings = [_ring(kv, layer) for kv in self.kvs]  # each (2, W, kv_heads, d)
        for ring, slot, key, value in zip(rings, self.slot.tolist(), k, v):
            ring[0, slot] = key
            ring[1, slot] = value
        stacked = torch.stack([ring[:, : self.slots] for ring in rings])  # (B, 2, slots, kv_heads, d)
        return _attend(q, stacked[:, 0], stacked[:, 1], self.ring_mask, scale)


def _write_and_gather(pages: torch.Tensor, page: torch.Tensor, offset: torch.Tensor, tables: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new positions' k and v (N, kv_heads, d) into a full layer's pages (num_pages, 2, block_tokens,
    kv_heads, d) at (page, offset), then gather each request's pages by its table: keys and values
    (B, pages * block_tokens, kv_heads, d)."""
    pages[page, 0, offset] = k
    pages[page, 1, offset] = v
    used = pages[tables]  # (B, pages, 2, block_tokens, kv_heads, d)
    B, width, _, block, kv_heads, d = used.shape
    return used[:, :, 0].reshape(B, width * block, kv_heads, d), used[:, :, 1].reshape(B, width * block, kv_heads, d)


def _ring(kv: RequestKV, layer: int) -> torch.Tensor:
    """The ring (2, W, kv_heads, d) of sliding layer `layer` in `kv` (a model with sliding layers gives
    every KV rings)."""
    assert kv.rings is not None, "sliding attention on a KV without sliding layers"
    return kv.rings[layer]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q (B, heads, d) over keys, values (B, n, kv_heads, d) where mask (B, n); returns (B, heads * d)."""
    out = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask[:, None, None], scale=scale, enable_gqa=True)
    return out.reshape(q.shape[0], -1)  # (B, heads, 1, d) -> (B, heads * d)


VERIFY_TOKENS = 8  # a chunk of at most this many tokens takes the batched verification path


class VerifyBatch:
    """A step of short multi-token chunks (speculative verification: the last token and a few drafts of
    each sequence), attended in one fused call per layer like `DecodeBatch`, the chunks padded to the
    longest, X tokens. Each query sees, causally, its own chunk's keys before it and the keys before the
    chunk: the pages of full layers, the ring of sliding layers as it was before the chunk (the chunk
    writes its own positions into the ring only after attending, since position start + j overwrites the
    slot of start + j - W, which the chunk's earlier queries still see). Padded query rows are computed and
    dropped. To float rounding what the general path computes, as DecodeBatch is."""

    def __init__(self, kvs: Sequence[RequestKV], starts: Sequence[int], sizes: Sequence[int],
                 device: torch.device) -> None:
        self.kvs, self.sizes = kvs, list(sizes)
        count, width_x = len(kvs), max(sizes)
        self.starts = torch.tensor(starts, device=device)  # (B,)
        j = torch.arange(width_x, device=device)  # (X,)
        self.q_pos = self.starts[:, None] + j[None]  # (B, X) each query's position (padding: past the chunk)
        offsets = torch.tensor([0, *sizes], device=device).cumsum(0)[:-1]  # (B,) each chunk's first row of T
        size = torch.tensor(sizes, device=device)
        # row of T each padded (b, j) reads (padding repeats its chunk's last token), and the real ones
        self.gather = offsets[:, None] + torch.minimum(j[None], size[:, None] - 1)  # (B, X)
        self.real = j[None] < size[:, None]  # (B, X)
        self.token_pos = self.q_pos[self.real]  # (T,) in the order of T: chunk by chunk
        self.token_row = torch.arange(count, device=device)[:, None].expand(-1, width_x)[self.real]  # (T,)
        first = kvs[0]
        if first.pool.layers:
            B = first.block_tokens
            width = max((s + n - 1) // B + 1 for s, n in zip(starts, sizes))
            tables = [kv.block_table[:width] + [0] * (width - min(width, len(kv.block_table))) for kv in kvs]
            self.tables = torch.tensor(tables, device=device)  # (B, pages), padded with page 0
            self.page = self.tables[self.token_row, self.token_pos // B]  # (T,) where each new token goes
            self.offset = self.token_pos % B
            self.full_mask = torch.arange(width * B, device=device)[None, None] <= self.q_pos[:, :, None]  # (B, X, L)
        if first.rings is not None:
            W = first.window
            self.slots = max(1, min(W, max(starts)))  # slots a position before the chunks can be in
            before = self.starts[:, None] - 1  # (B, 1) the last position before each chunk
            held = before - (before - torch.arange(self.slots, device=device)[None]) % W  # (B, slots)
            lower = torch.tensor([kv.window_from for kv in kvs], device=device).clamp(min=0)
            ring = (held >= lower[:, None])[:, None] & (held[:, None] > self.q_pos[:, :, None] - W)  # (B, X, slots)
            own = (j[None, None] <= j[None, :, None]) & self.real[:, None]  # (B, X, X) causal, real keys only
            self.ring_mask = torch.cat((ring, own), dim=-1)  # (B, X, slots + X)
            slot = self.token_pos % W  # (T,) each new token's ring slot
            # per chunk: its rows of T and their slots, for writing the chunk into its own ring
            self.ring_writes = [(torch.arange(o, o + n, device=device), slot[o : o + n])
                                for o, n in zip(offsets.tolist(), sizes)]

    @staticmethod
    def applies(kvs: Sequence[RequestKV], sizes: Sequence[int], starts: Sequence[int]) -> bool:
        """Whether a step of these chunks can take the batched verification path."""
        if not kvs or max(sizes) > VERIFY_TOKENS or max(sizes) < 2:
            return False
        pool = kvs[0].pool
        for kv, start, n in zip(kvs, starts, sizes):
            if kv.pool is not pool or start < kv.window_from or start < kv.keep_full_before:
                return False
            if pool.layers and len(kv.block_table) <= (start + n - 1) // kv.block_tokens:
                return False  # no page for a new token: the general path fails loudly, never writes elsewhere
            if kv.rings is not None and n >= kv.window:
                return False
            if any(start <= boundary <= start + n for boundary in kv.capture_at):
                return False
        return True

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """(T, ...) rows -> (B, X, ...), padding rows repeating their chunk's last token."""
        return x[self.gather]

    def full(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (T, heads, d), k and v (T, kv_heads, d) of full layer `layer`; returns (T, heads * d)."""
        keys, values = _write_and_gather(self.kvs[0].pool.layers[layer], self.page, self.offset, self.tables, k, v)
        return self._attend(q, keys, values, self.full_mask, scale)

    def sliding(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (T, heads, d), k and v (T, kv_heads, d) of sliding layer `layer`; returns (T, heads * d)."""
        rings = [_ring(kv, layer) for kv in self.kvs]  # each (2, W, kv_heads, d)
        stacked = torch.stack([ring[:, : self.slots] for ring in rings])  # (B, 2, slots, kv_heads, d): a copy
        keys = torch.cat((stacked[:, 0], self._padded(k)), dim=1)  # (B, slots + X, kv_heads, d)
        values = torch.cat((stacked[:, 1], self._padded(v)), dim=1)
        out = self._attend(q, keys, values, self.ring_mask, scale)
        for ring, (rows, slots) in zip(rings, self.ring_writes):  # then the chunks' own positions into their rings
            ring[0, slots] = k[rows]
            ring[1, slots] = v[rows]
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
        """q (T, heads, d) over keys, values (B, n, kv_heads, d) where mask (B, X, n); returns (T, heads * d)."""
        padded = self._padded(q).transpose(1, 2)  # (B, heads, X, d)
        out = F.scaled_dot_product_attention(padded, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask[:, None], scale=scale, enable_gqa=True)  # (B, heads, X, d)
        return out.transpose(1, 2)[self.real].reshape(q.shape[0], -1)  # (T, heads * d)
