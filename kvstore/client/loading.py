"""Layer-pipelined loading of a cached prefix into an engine's KV buffers (docs/design.md section 7).

`KVClient.load(...)` returns a LoadHandle at once; its workers (loader.py, on the client's thread
pool) fetch layer 0 of every block from every daemon first, then layer 1, and so on, writing each
(layer, block) straight into the engine's buffer for it. The model calls `handle.wait_layer(l)` just
before attention layer l.

The ordering logic (which layers are complete, how far the hit reaches) is LoadProgress, shared by
every destination; a destination only says where a (layer, block) goes and what "written" means
(on the CPU: nothing more; on CUDA: an asynchronous copy from pinned staging, and an event per layer).

A daemon dying or a block failing verification mid-load shrinks the hit to the blocks before it —
all layers of a block or none — and the engine recomputes from `handle.hit_tokens` on. A cancelled
load stops writing before `cancel()` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class LoadCancelled(Exception):
    pass


class KVDestination(Protocol):
    """Where loaded KV goes: one view per (layer, block) of `layer_bytes` bytes."""

    num_layers: int
    layer_bytes: int
    host_resident: bool  # True if layer views keep their bytes (so the host tier may copy from them)

    def layer_view(self, layer: int, block: int) -> memoryview:
        """A writable host view for layer `layer` of the prefix's block `block`."""

    def layer_written(self, layer: int, block: int) -> None:
        """The view of (layer, block) now holds verified bytes."""

    def layer_complete(self, layer: int) -> None:
        """Every block of `layer` up to the hit has been written."""

    def wait_layer(self, layer: int) -> None:
        """Called by wait_layer after `layer` is complete: make the compute side wait for it."""


class LoadProgress:
    """Which (layer, block) pairs are in place, and how many leading blocks the load will deliver."""

    def __init__(self, num_layers: int, hit_blocks: int, destination: KVDestination | None = None) -> None:
        self.num_layers = num_layers
        self.hit = hit_blocks
        self.done = np.zeros((num_layers, max(hit_blocks, 1)), dtype=bool)  # (layers, blocks)
        self.destination = destination
        self.cancelled = False
        self.finished = False
        self._completed = -1  # highest layer reported complete to the destination
        self._changed = threading.Condition()

    def mark(self, layer: int, block: int) -> None:
        with self._changed:
            if self.cancelled:
                raise LoadCancelled()
            self.done[layer, block] = True
            self._advance()

    def shrink(self, blocks: int, reason: str = "") -> None:
        """The load will deliver at most `blocks` leading blocks."""
        with self._changed:
            if blocks < self.hit:
                self.hit = blocks
                self._advance()

    def finish(self) -> None:
        with self._changed:
            # Whatever is not complete in every layer is not part of the hit.
            complete = self.done[:, : self.hit].all(axis=0)
            if not complete.all():
                self.hit = int(np.argmin(complete))
            self.finished = True
            self._advance()

    def _advance(self) -> None:
        while self._completed + 1 < self.num_layers and (
                self.finished or self.done[self._completed + 1, : self.hit].all()):
            self._completed += 1
            if self.destination is not None and not self.cancelled:
                self.destination.layer_complete(self._completed)
        self._changed.notify_all()

    def wait_layer(self, layer: int, timeout: float | None = None) -> int:
        """Block until `layer` is in place for every block of the hit; returns the hit (in blocks)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
        with self._changed:
            if not self._changed.wait_for(lambda: self._completed >= layer or self.cancelled, timeout):
                raise TimeoutError(f"layer {layer} not loaded within {timeout} s")
            return self.hit

    def wait(self, timeout: float | None = None) -> int:
        with self._changed:
            if not self._changed.wait_for(lambda: self.finished or self.cancelled, timeout):
                raise TimeoutError(f"load not finished within {timeout} s")
            return self.hit


class Joinable(Protocol):
    def join(self) -> None:
        """Return once this worker has stopped writing."""


class LoadHandle:
    """An in-flight load of a prefix; see the module docstring for the contract."""

    def __init__(self, progress: LoadProgress, block_tokens: int, workers: Sequence[Joinable]) -> None:
        """`workers`: what writes into the destination (threads, or the loader's LoadWork), joined by cancel."""
        self._progress = progress
        self._block_tokens = block_tokens
        self._workers = list(workers)

    @property
    def hit_tokens(self) -> int:
        """Tokens the load will deliver; final once `wait()` returned, and it only ever shrinks."""
        return self._progress.hit * self._block_tokens

    @property
    def done(self) -> bool:
        return self._progress.finished

    def wait_layer(self, layer: int, timeout: float | None = None) -> int:
        """Return once layer `layer` of every block of the hit is in place; the hit so far, in tokens."""
        hit = self._progress.wait_layer(layer, timeout)
        if self._progress.cancelled:
            raise LoadCancelled()
        if self._progress.destination is not None:
            self._progress.destination.wait_layer(layer)
        return hit * self._block_tokens

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the whole load; the final hit in tokens."""
        return self._progress.wait(timeout) * self._block_tokens

    def cancel(self) -> None:
        """Stop the load; no byte is written into the destination after this returns."""
        with self._progress._changed:
            self._progress.cancelled = True
            self._progress._changed.notify_all()
        for worker in self._workers:
            if worker is not threading.current_thread():
                worker.join()


class LayerViews:
    """Host memory for every (layer, block), anywhere: views[block][layer], each `layer_bytes` long (the
    pieces of an engine's page, say, each written in place)."""

    host_resident = True  # its views hold the bytes for good: the host tier may copy them from there

    def __init__(self, views: Sequence[Sequence[memoryview]], num_layers: int, layer_bytes: int) -> None:
        self.num_layers, self.layer_bytes = num_layers, layer_bytes
        self._views = [list(block) for block in views]
        for i, block in enumerate(self._views):
            if len(block) != num_layers or any(len(view) != layer_bytes for view in block):
                raise ValueError(f"block {i} needs {num_layers} views of {layer_bytes} bytes")

    def layer_view(self, layer: int, block: int) -> memoryview:
        return self._views[block][layer]

    def layer_written(self, layer: int, block: int) -> None:
        pass

    def layer_complete(self, layer: int) -> None:
        pass

    def wait_layer(self, layer: int) -> None:
        pass


class BufferDestination(LayerViews):
    """Host buffers, one per block, each layer-major: (num_layers, layer_bytes) bytes."""

    def __init__(self, buffers: Sequence[bytearray | memoryview], num_layers: int, layer_bytes: int) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        for i, view in enumerate(views):
            if len(view) < num_layers * layer_bytes:
                raise ValueError(f"buffer {i} has {len(view)} bytes; a block needs {num_layers * layer_bytes}")
        super().__init__([[view[n * layer_bytes : (n + 1) * layer_bytes] for n in range(num_layers)]
                          for view in views], num_layers, layer_bytes)
