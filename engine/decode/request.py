"""What the decode engine takes and returns, and the error it raises for bad input."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.decode.errors import DecodeError
from engine.decode.sampling import SamplingParams
from engine.prefill.request import PrefillRequest, PrefillResult, PromptImage

__all__ = ["CANCELLED", "CONTEXT", "ERROR", "DecodeError", "DecodeRequest", "DecodeResult", "FINISH_REASONS",
           "MAX_TOKENS", "STOP_STRING", "STOP_TOKEN"]

# Why a reply ended.
STOP_TOKEN = "stop_token"  # its last token is one of the request's stop_token_ids
STOP_STRING = "stop_string"  # the text of its tokens contains one of the request's stop strings
MAX_TOKENS = "max_tokens"  # it reached the request's max_tokens
CONTEXT = "context"  # prompt + reply filled the model's context (max_tokens None)
CANCELLED = "cancelled"  # DecodeEngine.cancel
ERROR = "error"  # the engine failed on this request alone (its sampling or drafting raised): DecodeResult.error
FINISH_REASONS = (STOP_TOKEN, STOP_STRING, MAX_TOKENS, CONTEXT, CANCELLED, ERROR)


@dataclass
class DecodeRequest:
    """A sequence to continue.

    `prompt` is either the prompt's token ids, which the decode engine computes itself, or the
    `PrefillResult` of a prefill engine in this process whose KV pool the decode engine shares: its KV
    continues without recompute, and the decode engine owns (and at the end releases) it from submit on;
    or a `PrefillRequest` that engine prefills first (with `from_handoff`: continuing from the state a
    prefill in another process handed over through the store, `engine.prefill.handoff`).
    """

    prompt: Sequence[int] | PrefillResult | PrefillRequest
    sampling: SamplingParams = field(default_factory=SamplingParams)
    detokenize: Callable[[Sequence[int]], str] | None = None  # token ids -> text for stop strings; None: the config's
    on_token: Callable[[int], None] | None = None  # called with each token as it is sampled (streaming), on the
    #                                               engine's thread: it must not block

    @property
    def images(self) -> tuple[PromptImage, ...]:
        """The prompt's images: what a recompute of its KV (after a preemption) feeds at their placeholders."""
        if isinstance(self.prompt, PrefillRequest):
            return self.prompt.images
        if isinstance(self.prompt, PrefillResult):
            return self.prompt.request.images
        return ()


@dataclass
class DecodeResult:
    """A finished reply: token ids only (the caller detokenizes), and why it ended.

    The tokens include a final stop token, and the tokens that completed a stop string (whose text the
    caller trims)."""

    id: int
    request: DecodeRequest
    tokens: list[int]
    finish_reason: str  # one of FINISH_REASONS
    prompt_tokens: int
    token_times_s: list[float]  # per token, seconds from submit to its sampling (a handed-over first token: 0)
    preemptions: int = 0  # times its KV was released to let older sequences grow
    recomputed_tokens: int = 0  # tokens computed again after preemptions
    prefill_path: str | None = None  # how the prompt's KV came (a PrefillResult's path: "handed_over", or the
    #                                  fallback where the handed-over state was gone); None for token ids
    resumed_from_store: int = 0  # preemptions resumed from the KV saved through the store, not recomputed
    cached_tokens: int = 0  # prompt tokens loaded from the store (or handed over) rather than computed
    window_source: str | None = None  # a hybrid model's cached prompt: its window from "host" or "store"
    drafted: int = 0  # speculative decoding: drafts verified
    accepted_drafts: int = 0  # of those, accepted (each one a token without a forward of its own)
    error: str | None = None  # finish reason "error": what raised ("RuntimeError: ..."); the other requests went on

    @property
    def inter_token_s(self) -> list[float]:
        """Gaps between consecutive tokens, seconds."""
        return [b - a for a, b in zip(self.token_times_s, self.token_times_s[1:])]
