"""Attention for a step in which every chunk is one token (a decode step), and (`VerifyBatch`) for one of
short chunks, a speculative step's verification chunks.

The general path (`Decoder._attention`) attends chunk by chunk through torch's fused attention kernel,
built for long chunks: for one query its fixed cost (~0.4 ms a call on this CPU) is larger than the
arithmetic, and it would read a batch's KV only after copying it into one padded tensor (at batch 32,
16 MB for each sliding layer). Here the positions a step writes go into every sequence's pages and ring
first, then each sequence attends over its own KV where it lies (`attend_few`): its ring as it is, the
pages of its full layers gathered, never the other sequences' or any padding.

Scores and the softmax are computed in fp32 and the probabilities rounded to the KV's dtype for the
product with the values, as torch's fused CPU kernel does for bf16 and transformers' attention does in
effect, so bf16 models see the same roundings whichever path a step takes.

Used only where it computes what the general path does: chunks of one token (`DecodeBatch`) or of a few
(`VerifyBatch`), no attention sinks, no window to capture in this step (those steps, one per block
boundary, take the general path). It computes it to float rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model.kv import RequestKV


class DecodeBatch:
    """What every layer of one decode step shares: positions, each sequence's block table and ring mask."""

    def __init__(self, kvs: Sequence[RequestKV], positions: Sequence[int], device: torch.device) -> None:
        self.kvs = kvs
        self.pos = torch.tensor(positions, device=device)  # (B,)
        first = kvs[0]
        if first.pool.layers:
            B = first.block_tokens
            # each sequence's pages up to its new token's, and where that token goes
            self.tables = [torch.tensor(kv.block_table[: p // B + 1], device=device) for kv, p in zip(kvs, positions)]
            self.page = torch.tensor([kv.block_table[p // B] for kv, p in zip(kvs, positions)], device=device)  # (B,)
            self.offset = self.pos % B
            self.lengths = [p + 1 for p in positions]
        if first.rings is not None:
            W = first.window
            self.slot = [p % W for p in positions]
            self.slots = [min(W, p + 1) for p in positions]  # before the window fills, slots past the newest are empty
            # slot s holds the latest position <= p that is s mod W; masked where a replay's window begins later
            self.ring_masks = [None if kv.window_from <= p + 1 - slots else
                               (p - (p - torch.arange(slots, device=device)) % W >= kv.window_from)[None]
                               for kv, p, slots in zip(kvs, positions, self.slots)]  # each None or (1, slots)

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
        pages = self.kvs[0].pool.layers[layer]  # (num_pages, 2, block_tokens, kv_heads, d)
        pages[self.page, 0, self.offset] = k
        pages[self.page, 1, self.offset] = v
        return torch.cat([attend_few(q[b : b + 1], *_gathered(pages, table, n), None, scale)
                          for b, (table, n) in enumerate(zip(self.tables, self.lengths))])

    def sliding(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (B, heads, d), k and v (B, kv_heads, d) of sliding layer `layer`; returns (B, heads * d)."""
        out = []
        for b, (kv, slot, slots, mask) in enumerate(zip(self.kvs, self.slot, self.slots, self.ring_masks)):
            ring = _ring(kv, layer)  # (2, W, kv_heads, d)
            ring[0, slot] = k[b]
            ring[1, slot] = v[b]
            out.append(attend_few(q[b : b + 1], ring[0, :slots], ring[1, :slots], mask, scale))
        return torch.cat(out)


def _gathered(pages: torch.Tensor, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (length, kv_heads, d) of positions [0, length) of one sequence, from a full layer's
    pages (num_pages, 2, block_tokens, kv_heads, d) by its table (its pages, in order)."""
    used = pages[table]  # (pages, 2, block_tokens, kv_heads, d): a copy of this sequence's pages only
    kv_heads, d = used.shape[-2:]
    return used[:, 0].reshape(-1, kv_heads, d)[:length], used[:, 1].reshape(-1, kv_heads, d)[:length]


def _ring(kv: RequestKV, layer: int) -> torch.Tensor:
    """The ring (2, W, kv_heads, d) of sliding layer `layer` in `kv` (a model with sliding layers gives
    every KV rings)."""
    assert kv.rings is not None, "sliding attention on a KV without sliding layers"
    return kv.rings[layer]


def attend_few(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """GQA attention of a few queries q (x, heads, d) over keys, values (n, kv_heads, d) where mask (x, n) (None:
    everywhere); returns (x, heads * d). Scores and softmax in fp32, the probabilities times the values in the
    values' dtype (fp32 accumulation)."""
    x, heads, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads  # query head h reads KV head h // group
    rows = q.view(x, kv_heads, group, d).transpose(0, 1).reshape(kv_heads, x * group, d)  # rows (query, group)
    if kv_heads == 1:  # 2-D products: torch's batched ones take up to 3x as long on these transposed views
        scores = torch.mm(rows[0].float(), keys[:, 0].T.float())[None] * scale  # (1, x * group, n)
    else:
        scores = torch.bmm(rows.float(), keys.permute(1, 2, 0).float()) * scale  # (kv_heads, x * group, n)
    if mask is not None:
        scores.masked_fill_(~mask.repeat_interleave(group, dim=0), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    if kv_heads == 1:
        return torch.mm(probs[0], values[:, 0]).view(x, heads * d)  # rows (query, head)
    out = torch.bmm(probs, values.transpose(0, 1))  # (kv_heads, x * group, d)
    return out.view(kv_heads, x, group, d).transpose(0, 1).reshape(x, heads * d)


VERIFY_TOKENS = 8  # a chunk of at most this many tokens takes the batched verification path


class VerifyBatch:
    """A step of short multi-token chunks (speculative verification: the last token and a few drafts of
    each sequence), each chunk attending over its own KV like `DecodeBatch`'s tokens. Each query sees,
    causally, its own chunk's keys before it and the keys before the chunk: the pages of full layers, the
    ring of sliding layers as it was before the chunk (the chunk writes its own positions into the ring only
    after attending, since position start + j overwrites the slot of start + j - W, which the chunk's earlier
    queries still see). To float rounding what the general path computes, as DecodeBatch is."""

    def __init__(self, kvs: Sequence[RequestKV], starts: Sequence[int], sizes: Sequence[int],
                 device: torch.device) -> None:
        self.kvs, self.sizes = kvs, list(sizes)
        offsets = [sum(sizes[:b]) for b in range(len(sizes))]
        self.rows = [slice(o, o + n) for o, n in zip(offsets, sizes)]  # each chunk's rows of the step's T tokens
        q_pos = [torch.arange(s, s + n, device=device) for s, n in zip(starts, sizes)]  # each (x,)
        first = kvs[0]
        if first.pool.layers:
            B = first.block_tokens
            positions = torch.cat(q_pos)  # (T,)
            self.page = torch.tensor([kv.block_table[p // B] for kv, s, n in zip(kvs, starts, sizes)
                                      for p in range(s, s + n)], device=device)  # (T,) where each new token goes
            self.offset = positions % B
            self.tables = [torch.tensor(kv.block_table[: (s + n - 1) // B + 1], device=device)
                           for kv, s, n in zip(kvs, starts, sizes)]
            self.lengths = [s + n for s, n in zip(starts, sizes)]
            # causal: query j of a chunk at s sees positions <= s + j
            self.full_masks = [torch.arange(s + n, device=device)[None] <= pos[:, None] for s, n, pos in
                               zip(starts, sizes, q_pos)]  # each (x, s + x)
        if first.rings is not None:
            W = first.window
            self.slots = [min(W, s) for s in starts]  # ring slots a position before each chunk can be in
            self.ring_masks, self.ring_slots = [], []
            for kv, s, n, pos, slots in zip(kvs, starts, sizes, q_pos, self.slots):
                held = (s - 1) - ((s - 1) - torch.arange(slots, device=device)) % W  # (slots,) position in each slot
                ring = (held >= max(kv.window_from, 0))[None] & (held[None] > pos[:, None] - W)  # (x, slots)
                own = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # (x, x) causal within the chunk
                self.ring_masks.append(torch.cat((ring, own), dim=-1))  # (x, slots + x)
                self.ring_slots.append(pos % W)  # (x,) where the chunk's positions go after attending

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

    def full(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (T, heads, d), k and v (T, kv_heads, d) of full layer `layer`; returns (T, heads * d)."""
        pages = self.kvs[0].pool.layers[layer]  # (num_pages, 2, block_tokens, kv_heads, d)
        pages[self.page, 0, self.offset] = k
        pages[self.page, 1, self.offset] = v
        return torch.cat([attend_few(q[rows], *_gathered(pages, table, n), mask, scale)
                          for rows, table, n, mask in zip(self.rows, self.tables, self.lengths, self.full_masks)])

    def sliding(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (T, heads, d), k and v (T, kv_heads, d) of sliding layer `layer`; returns (T, heads * d)."""
        out = []
        for kv, rows, slots, mask, written in zip(self.kvs, self.rows, self.slots, self.ring_masks, self.ring_slots):
            ring = _ring(kv, layer)  # (2, W, kv_heads, d)
            keys = torch.cat((ring[0, :slots], k[rows]))  # (slots + x, kv_heads, d)
            values = torch.cat((ring[1, :slots], v[rows]))
            out.append(attend_few(q[rows], keys, values, mask, scale))
            ring[0, written] = k[rows]  # then the chunk's own positions into its ring
            ring[1, written] = v[rows]
        return torch.cat(out)
