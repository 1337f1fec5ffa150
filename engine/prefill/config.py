"""The prefill engine's one config."""

from __future__ import annotations

from dataclasses import dataclass

from engine.prefill.cost import ChunkCost


@dataclass(frozen=True)
class PrefillConfig:
    block_tokens: int = 256  # the store's block size: one KV page
    kv_pages: int = 512  # pages in the engine's pool (per full layer)
    step_budget_s: float = 0.25  # what one step's chunks may cost, by the fitted model
    window_tier_bytes: int = 256 * 2**20  # host memory for sliding-window states of active sessions
    cost: ChunkCost | None = None  # None: fit at start-up on this machine
    load_timeout_s: float = 30.0  # a layer not loaded within this is treated as a failed load
    model_id: str | None = None  # the namespace's model identity; None: directory name + weights digest

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.kv_pages < 1:
            raise ValueError("PrefillConfig: block_tokens and kv_pages must be >= 1")
        if self.step_budget_s <= 0 or self.load_timeout_s <= 0:
            raise ValueError("PrefillConfig: step_budget_s and load_timeout_s must be positive")
        if self.window_tier_bytes < 0:
            raise ValueError("PrefillConfig: window_tier_bytes must be >= 0")
