"""The decode engine's one config."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeConfig:
    max_running: int = 64  # sequences one step feeds; more wait in the queue
    prefill_tokens_per_step: int = 2048  # prompt (or recompute) tokens one step feeds besides the decode tokens
    kv_pages: int = 512  # pages of the engine's own pool: used only when given no pool or prefill engine
    block_tokens: int = 256  # tokens per page of that own pool
    detokenize: Callable[[Sequence[int]], str] | None = None  # token ids -> text, for stop strings
    # a preempted sequence whose reply goes to the store saves its state there and resumes from it (False:
    # it recomputes prompt + reply, as a sequence of bare token ids always does)
    preempt_to_store: bool = True
    # while a step's forward runs, a worker thread does the next step's host work that does not wait for its
    # tokens (admission, KV pages for every sequence's next token); see DecodeEngine.idle_gaps_s
    overlap: bool = False

    def __post_init__(self) -> None:
        for name in ("max_running", "prefill_tokens_per_step", "kv_pages", "block_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeConfig: {name} must be an integer >= 1, got {value!r}")
        for name in ("preempt_to_store", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DecodeConfig: {name} must be True or False, got {getattr(self, name)!r}")
        if self.detokenize is not None and not callable(self.detokenize):
            raise ValueError("DecodeConfig: detokenize must be a callable (token ids -> text) or None, "
                             f"got {type(self.detokenize).__name__}")
