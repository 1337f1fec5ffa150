"""Explicit KV storage the model's forward pass reads and writes.

* Full-attention layers: paged KV. One tensor per full layer, (num_pages, 2, block_tokens, kv_heads,
  head_dim): a page is one block of one layer, K then V, exactly the layout of a layer of a stored
  block, so the store loads into pages and saves from them without reshaping. A request owns a block
  table: the page of each of its blocks.
* Sliding-window layers: a ring of W positions per request and layer, (n_sliding, 2, W, kv_heads,
  head_dim); position p lives in slot p % W. Only the window is ever needed, so memory stays bounded
  however long the session grows.

Bounded replay (`engine.window.replay`) bends both: full layers keep the KV loaded below a position rather
than overwrite it with what the replay recomputes, and the rings hold nothing before the replay began.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.config import ModelConfig


class KVCapacityError(RuntimeError):
    """No free pages for a request's KV; the caller waits for other requests to finish or fails it."""


class PagePool:
    def __init__(self, config: ModelConfig, num_pages: int, block_tokens: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        if num_pages < 1 or block_tokens < 1:
            raise ValueError("a page pool needs at least one page of at least one token")
        self.block_tokens = block_tokens
        self.num_pages = num_pages
        self.dtype, self.device = dtype, torch.device(device)  # of every page and every request's rings
        page = (2, block_tokens, config.num_kv_heads, config.head_dim)
        # per full layer: (num_pages, 2, block_tokens, kv_heads, head_dim)
        self.layers = [torch.zeros((num_pages, *page), dtype=dtype, device=device) for _ in config.full_layers]
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise KVCapacityError(f"need {count} KV pages, {len(self._free)} of {self.num_pages} free")
        return [self._free.pop() for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass
class WindowState:
    """The sliding layers' KV as of `position` (tokens before it): what the window tier and the window records
    keep (engine.window)."""

    position: int
    rings: torch.Tensor  # (n_sliding, 2, W, kv_heads, head_dim), position p in slot p % W
    window_from: int = 0  # the rings hold no position before this (a replayed window starts late)

    @property
    def nbytes(self) -> int:
        return self.rings.numel() * self.rings.element_size()


@dataclass
class RingCheckpoint:
    """What a speculative chunk's draft positions overwrite in the sliding layers' rings: writing position p
    replaces slot p % W, which held p - W, still in the window of the next token should p be rejected."""

    begin: int  # the first draft position
    slots: torch.Tensor  # (n,) ring slots of positions [begin, begin + n)
    saved: torch.Tensor  # (n_sliding, 2, n, kv_heads, head_dim) their contents before the chunk


class RequestKV:
    """One request's KV: a block table into the pool, a window ring, and how many tokens are in it.

    The handle a prefill engine passes to a decode engine.
    """

    def __init__(self, config: ModelConfig, pool: PagePool) -> None:
        self.pool = pool
        self.block_tokens = pool.block_tokens
        self.window = config.sliding_window or 0
        self.block_table: list[int] = []
        self.length = 0  # positions [0, length) hold valid KV
        self.window_from = 0  # sliding layers attend to no position before this: where a replay began
        self.keep_full_before = 0  # full layers' KV below this was loaded, and a replay must not overwrite it
        self.rings = torch.zeros((len(config.sliding_layers), 2, self.window, config.num_kv_heads, config.head_dim),
                                 dtype=pool.dtype, device=pool.device) if config.sliding_layers else None
        self.capture_at: set[int] = set()  # block boundaries whose window state to keep while computing
        self.captured: dict[int, WindowState] = {}  # boundary -> the window as of it

    def reserve(self, tokens: int) -> None:
        """Pages for positions [0, tokens); raises KVCapacityError (holding what it had) when the pool is full."""
        needed = -(-tokens // self.block_tokens) - len(self.block_table)
        if needed > 0 and self.pool.layers:
            self.block_table.extend(self.pool.allocate(needed))

    def release(self) -> None:
        self.pool.release(self.block_table)
        self.block_table = []
        self.length = self.window_from = self.keep_full_before = 0

    def checkpoint(self, begin: int, end: int) -> RingCheckpoint | None:
        """Before a chunk whose positions [begin, end) are speculative (drafts a verification may reject):
        the ring slots they will overwrite; None without sliding layers (full layers need only `length`)."""
        if self.rings is None or end <= begin:
            return None
        assert end - begin < self.window, "drafts of a chunk must not wrap the ring onto the chunk itself"
        slots = torch.arange(begin, end, device=self.rings.device) % self.window  # (n,)
        return RingCheckpoint(begin, slots, self.rings[:, :, slots].clone())

    def rollback(self, keep: int, checkpoint: RingCheckpoint | None) -> None:
        """Keep positions [0, keep) of what a speculative chunk wrote: the rest were rejected drafts. Full
        layers: `length` goes back (their pages past it are masked, then overwritten); sliding layers: the
        rejected positions' slots get back what they held, the window of the positions kept."""
        self.length = min(self.length, keep)
        rings = self.rings  # a checkpoint exists only where there are rings
        if checkpoint is not None and rings is not None and keep < checkpoint.begin + checkpoint.slots.numel():
            first = max(0, keep - checkpoint.begin)  # the first rejected draft, within the checkpoint
            rings[:, :, checkpoint.slots[first:]] = checkpoint.saved[:, :, first:]

    def restore_window(self, state: WindowState) -> None:
        assert self.rings is not None and state.rings.shape == self.rings.shape
        self.rings.copy_(state.rings)
        self.window_from = state.window_from

    def full_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (x, kv_heads, head_dim) at positions [start, start+x) of full layer `layer` (its index
        among full layers), except below `keep_full_before`; return K and V of positions [0, start+x), each
        (start+x, kv_heads, head_dim)."""
        pages = self.pool.layers[layer]  # (num_pages, 2, block_tokens, kv_heads, head_dim)
        end = start + k.shape[0]
        skip = min(max(0, self.keep_full_before - start), k.shape[0])  # replayed positions keep the loaded KV
        positions = torch.arange(start + skip, end, device=k.device)
        table = torch.tensor(self.block_table, dtype=torch.long, device=k.device)
        page, offset = table[positions // self.block_tokens], positions % self.block_tokens
        pages[page, 0, offset] = k[skip:]
        pages[page, 1, offset] = v[skip:]
        used = pages[table[: -(-end // self.block_tokens)]]  # (blocks, 2, block_tokens, kv_heads, head_dim)
        kv = used.transpose(0, 1).reshape(2, -1, *k.shape[1:])[:, :end]  # (2, end, kv_heads, head_dim)
        return kv[0], kv[1]

    def sliding_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                   start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values and positions a chunk at [start, start+x) of sliding layer `layer` attends to: the
        window before it from the ring, then the chunk; the ring then holds the window after the chunk."""
        rings = self.rings
        assert rings is not None, "sliding_kv on a KV without sliding layers"
        if start < self.window_from:
            raise ValueError(f"a chunk at position {start} starts before the window this KV holds (from "
                             f"{self.window_from}, where a replay began); restart from the replay's start")
        ring, window, x = rings[layer], self.window, k.shape[0]  # ring (2, W, kv_heads, head_dim)
        low = max(self.window_from, start - window)
        if start - low == window:  # a whole window before the chunk: the ring as it lies, slot s at the
            # latest position before `start` that is s mod W (attention masks by position, not by order)
            before = start - 1 - (start - 1 - torch.arange(window, device=k.device)) % window  # (W,)
            keys, values = torch.cat((ring[0], k)), torch.cat((ring[1], v))  # (n, kv_heads, head_dim)
        else:  # the start of a sequence or of a replay: only the positions the ring holds
            before = torch.arange(low, start, device=k.device)  # (<W,)
            keys, values = torch.cat((ring[0, before % window], k)), torch.cat((ring[1, before % window], v))
        positions = torch.cat((before, torch.arange(start, start + x, device=k.device)))  # (n,)
        for boundary in self.capture_at:
            if start <= boundary <= start + x:
                self._capture(rings, layer, boundary, keys, values, positions)
        new = min(x, window)  # of the window after the chunk, the ring already holds what precedes the chunk
        slots = torch.arange(start + x - new, start + x, device=k.device) % window
        ring[0, slots] = k[-new:]
        ring[1, slots] = v[-new:]
        return keys, values, positions

    def _capture(self, rings: torch.Tensor, layer: int, boundary: int, keys: torch.Tensor, values: torch.Tensor,
                 positions: torch.Tensor) -> None:
        """Add sliding layer `layer`'s part of the window as of `boundary` to `captured`; `rings` the KV's own
        (n_sliding, 2, W, kv_heads, head_dim), whose shape the captured window takes."""
        state = self.captured.get(boundary)
        if state is None:
            state = self.captured[boundary] = WindowState(boundary, torch.zeros_like(rings), self.window_from)
        wanted = (positions < boundary) & (positions >= boundary - self.window)
        slots = positions[wanted] % self.window
        state.rings[layer, 0, slots] = keys[wanted]
        state.rings[layer, 1, slots] = values[wanted]
