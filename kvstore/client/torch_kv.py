"""Load destinations over an engine's paged KV tensors (torch; the client's device path).

An engine keeps, per persisted layer, one tensor of pages: (num_pages, *page_shape), where a page holds
one block's KV of that layer (e.g. (2, block_tokens, kv_heads, head_dim) for K and V), and per request
a block table: the page of each block of its prefix.

* On the CPU, each (layer, block) view is the page itself: bytes land in place, nothing more to do.
* On CUDA, bytes land in pinned staging buffers; `layer_written` queues the copy to the page on a
  dedicated copy stream, `layer_complete` records one event per layer, and `wait_layer` makes the
  compute stream wait for that event — the CPU never blocks on the GPU. Staging is a ring of
  `staging_layers` layers; a block's slot in it is reused only once its previous copy has finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch


class PagedKV:
    def __init__(self, layers: Sequence[torch.Tensor], block_table: Sequence[int] | Sequence[Sequence[int]],
                 staging_layers: int = 2) -> None:
        """`block_table`: the page of each loaded block, one table for every layer, or one per layer (an
        engine whose layers keep their pages apart, e.g. vLLM's KV cache groups)."""
        if not layers:
            raise ValueError("PagedKV needs one tensor per layer")
        shapes = {(tuple(t.shape), t.dtype, t.device) for t in layers}
        if len(shapes) != 1:
            raise ValueError("every layer tensor must have the same shape, dtype and device")
        for t in layers:
            if not t.is_contiguous():
                raise ValueError("layer tensors must be contiguous: (num_pages, *page_shape)")
        if block_table and isinstance(block_table[0], Sequence):  # one table per layer
            tables = [list(cast(Sequence[int], t)) for t in block_table]
        else:
            tables = [list(cast(Sequence[int], block_table))] * len(layers)
        if len(tables) != len(layers) or len({len(t) for t in tables}) != 1:
            raise ValueError("PagedKV needs one block table, or one per layer, each as long")
        pages = layers[0].shape[0]
        if any(not 0 <= p < pages for table in tables for p in table):
            raise ValueError(f"block table names a page outside 0..{pages - 1}")
        self.layers = list(layers)
        self.tables = tables
        self.block_table = tables[0]
        self.num_layers = len(layers)
        self.layer_bytes = layers[0][0].numel() * layers[0].element_size()  # one page: (*page_shape)
        self.device = layers[0].device
        self.host_resident = self.device.type == "cpu"  # CUDA views are staging, reused as layers pass
        self._bytes: list[memoryview | None] = [None] * self.num_layers
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            self._events = [torch.cuda.Event() for _ in range(self.num_layers)]
            self._ring = max(1, min(staging_layers, self.num_layers))
            # (ring, blocks, layer_bytes) uint8, pinned: the copy engine reads it asynchronously
            self._staging = torch.empty((self._ring, len(self.block_table), self.layer_bytes), dtype=torch.uint8,
                                        pin_memory=True)
            self._staging_view = self._staging.numpy().data.cast("B")
            # (ring, blocks): the event after the last copy out of each staging slot. Daemons stream at
            # their own pace, so a slot is reused per block, once that block's earlier copy is done.
            self._copied: list[list[torch.cuda.Event | None]] = [[None] * len(self.block_table)
                                                                  for _ in range(self._ring)]

    def _page(self, layer: int, block: int) -> torch.Tensor:
        return self.layers[layer][self.tables[layer][block]]

    def layer_view(self, layer: int, block: int) -> memoryview:
        if self.device.type != "cuda":
            whole = self._bytes[layer]
            if whole is None:  # (num_pages * layer_bytes,) bytes of the whole layer tensor
                whole = self._bytes[layer] = self.layers[layer].view(-1).view(torch.uint8).numpy().data.cast("B")
            start = self.tables[layer][block] * self.layer_bytes
            return whole[start : start + self.layer_bytes]
        slot = layer % self._ring
        previous = self._copied[slot][block]
        if previous is not None:
            previous.synchronize()  # the copy of an earlier layer out of this staging slot has finished
        start = (slot * len(self.block_table) + block) * self.layer_bytes
        return self._staging_view[start : start + self.layer_bytes]

    def layer_written(self, layer: int, block: int) -> None:
        if self.device.type != "cuda":
            return
        slot = layer % self._ring
        copied = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            self._page(layer, block).view(-1).view(torch.uint8).copy_(self._staging[slot, block], non_blocking=True)
            copied.record(self._stream)
        self._copied[slot][block] = copied

    def layer_complete(self, layer: int) -> None:
        if self.device.type == "cuda":
            self._events[layer].record(self._stream)

    def wait_layer(self, layer: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self._events[layer])
