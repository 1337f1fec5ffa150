"""How a request picks its tokens: greedy, or temperature → top-k → top-p → a draw from its own generator.

Each sampled request owns a `torch.Generator`, seeded from `SamplingParams.seed`, and only its own rows
draw from it: its draws depend on its logits and its seed, never on what else shares the batch (or on
being preempted and resumed, since the generator travels with the request). Its logits themselves may
move by float rounding (~1e-6) with its neighbours in a step (`engine.model.decode_attention`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.decode.errors import DecodeError, few
from engine.model.decoder import argmax_ids

SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds in [0, 2**64)
CANDIDATES = 1024  # top-p first looks for its nucleus among this many likeliest tokens (then 4x more, ...)


MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Invalid values raise DecodeError on construction."""

    temperature: float = 0.0  # 0: greedy (argmax); the other fields but max_tokens and stops are then unused
    top_k: int = 0  # keep the k likeliest tokens; 0: off
    top_p: float = 1.0  # keep the smallest set of likeliest tokens whose probability reaches p; 1: off
    seed: int | None = None  # the request's generator; None: drawn from the OS, not reproducible
    max_tokens: int | None = 256  # tokens to generate at most; None: until a stop or the model's context
    stop_token_ids: tuple[int, ...] = ()  # any iterable of ints; the stop token ends the reply and is kept in it
    stop: tuple[str, ...] = ()  # stop strings (a str or an iterable of them); need a detokenize callable

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise DecodeError(f"SamplingParams: temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise DecodeError(f"SamplingParams: top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise DecodeError(f"SamplingParams: top_p must lie in (0, 1] (1 = off), got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < SEED_LIMIT):
            raise DecodeError(f"SamplingParams: seed must be an integer in [0, 2**64) or None, got {s!r}")
        m = self.max_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise DecodeError(f"SamplingParams: max_tokens must be an integer >= 1, or None to stop only at a "
                              f"stop or the model's context; got {m!r}")
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        object.__setattr__(self, "stop", _stop_strings(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _token_ids(ids: Iterable[int]) -> tuple[int, ...]:
    try:
        ids = tuple(operator.index(i) for i in ids if not isinstance(i, bool))
    except TypeError:
        raise DecodeError(f"SamplingParams: stop_token_ids must be integers, got {type(ids).__name__} holding "
                          "something else") from None
    if negative := [i for i in ids if i < 0]:
        raise DecodeError(f"SamplingParams: stop_token_ids must be >= 0, got {few(negative)}")
    return ids


def _stop_strings(stop: str | Iterable[str]) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in strings):
        raise DecodeError(f"SamplingParams: stop strings must be non-empty strings, got {strings!r}"[:300])
    # Each token's new text is searched for every stop string, and text as long as the longest is held
    # back: both bounded, so a request cannot make every token cost what it likes
    if len(strings) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in strings):
        raise DecodeError(f"SamplingParams: stop takes at most {MAX_STOP_STRINGS} strings of at most "
                          f"{MAX_STOP_CHARS} characters, got {len(strings)} of up to {max(map(len, strings))}")
    return strings


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own generator; None for greedy requests, which draw nothing."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` (rows, vocab): argmax for greedy rows, a draw from the row's own
    generator (advancing it) for the others."""
    assert logits.dim() == 2 and len(params) == len(generators) == logits.shape[0]
    chosen = argmax_ids(logits).tolist()
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            chosen[row] = _draw(logits[row], p, generator)
    return chosen


def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    tokens, weights = candidates(logits, p)
    return int(tokens[torch.multinomial(weights, 1, generator=generator)])


def candidates(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens temperature -> top-k -> top-p leaves (n,), likeliest first, and their weights (n,)
    (proportional to the probabilities, zero where top-p cut), found without sorting the vocabulary:
    `torch.topk` takes the likeliest, where a sort of 262k logits cost ~25 ms per row (at batch 8, as long
    as the step's forward). The distribution is exactly the sorted one's."""
    logits = logits.float()
    # shifted by the maximum first, and by no less than fp32's smallest normal: a tiny temperature then sends
    # the others to -inf and keeps the likeliest at 0, never inf - inf or 0 / 0 (NaN)
    temperature = max(p.temperature, torch.finfo(torch.float32).tiny)
    scores = (logits - logits.max()) / temperature  # (vocab,)
    vocab = scores.numel()
    if not 0 < p.top_k < vocab and p.top_p >= 1:  # temperature alone: the whole vocabulary
        return torch.arange(vocab, device=scores.device), torch.softmax(scores, dim=-1)
    if 0 < p.top_k < vocab:  # the k likeliest (and any tied with the k-th), renormalised among themselves
        kth = torch.topk(scores, p.top_k).values[-1]
        tied = (scores >= kth).nonzero()[:, 0]
        values, order = scores[tied].sort(descending=True)
        tokens = tied[order]
        probs = torch.softmax(values, dim=-1)
    else:
        total = torch.logsumexp(scores, dim=-1)
        size = min(CANDIDATES, vocab)
        while True:  # enough candidates once their mass reaches top_p: the nucleus lies among them
            values, tokens = torch.topk(scores, size)
            probs = torch.exp(values - total)  # (size,) probabilities over the whole vocabulary
            if size == vocab or probs.sum() >= p.top_p:
                break
            size = min(4 * size, vocab)
    if p.top_p < 1:
        before = probs.cumsum(0) - probs  # the mass of the likelier tokens
        cut = before >= p.top_p
        # the likeliest token always stays: a top_p below fp32's smallest subnormal (~1.4e-45) compares as
        # 0.0 against `before`, whose first entry is 0, and would cut every token (an empty distribution,
        # which multinomial refuses for the whole batch)
        cut[0] = False
        probs = probs.masked_fill(cut, 0)
    return tokens, probs
