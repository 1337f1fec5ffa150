"""One request's state inside the decode engine: its tokens, how many of them its KV holds, when it ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.decode.request import CONTEXT, MAX_TOKENS, STOP_STRING, STOP_TOKEN, DecodeRequest, DecodeResult
from engine.decode.sampling import SamplingParams
from engine.decode.saving import ReplyChain
from engine.model.kv import RequestKV
from engine.prefill.request import PrefillRequest
from engine.speculative.drafter import NGramDrafter


@dataclass
class DecodeSequence:
    id: int
    request: DecodeRequest
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int]  # prompt, then the reply so far; the last one is not yet in the KV
    prompt_tokens: int
    context: int  # the model's max positions: prompt + reply never exceed it
    detokenize: Callable[[Sequence[int]], str] | None
    kv: RequestKV | None = None  # None while waiting without KV (new, or preempted)
    computed: int = 0  # tokens [0, computed) are in the KV
    submitted: float = field(default_factory=time.perf_counter)
    token_times_s: list[float] = field(default_factory=list)
    preemptions: int = 0
    recomputed_tokens: int = 0
    chain: ReplyChain | None = None  # where a handed-over sequence's filled blocks are saved; None: not saved
    resume: PrefillRequest | None = None  # preempted with its KV saved through the store: how to get it back
    cancelled: bool = False  # cancelled while its prefill ran: its KV is released when the prefill returns
    prefill_path: str | None = None
    cached_tokens: int = 0  # of the prompt, loaded from the store rather than computed
    window_source: str | None = None  # where a hybrid model's cached prompt took its window (PrefillResult's)
    resumed_from_store: int = 0
    # speculative decoding: proposes what may follow `tokens`. Made when the sequence is admitted, never while
    # it queues (an index over a long prompt costs ~0.1 s and MiBs), its index built on the engine's drafts
    # thread (`indexing`, until done); the tokens appended since are fed before each proposal
    drafter: NGramDrafter | None = None
    indexing: Future | None = None
    drafted: int = 0  # drafts verified
    accepted: int = 0  # of those, accepted
    _stops: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        # membership per sampled token: a set, so thousands of stop ids do not make every token cost as many
        self._stops = frozenset(self.params.stop_token_ids)

    def draft_room(self) -> int:
        """Drafts a step may verify at most without passing max_tokens or the context: the step yields
        accepted + 1 tokens, and the last of them is never fed."""
        room = self.context - len(self.tokens) - 1
        if self.params.max_tokens is not None:
            room = min(room, self.params.max_tokens - len(self.reply) - 1)
        return max(0, room)

    @property
    def held_kv(self) -> RequestKV:
        """The KV of a sequence that holds one: admitted, handed over, or being preempted."""
        assert self.kv is not None, "a sequence without KV is waiting: nothing reads its KV there"
        return self.kv

    @property
    def reply(self) -> list[int]:
        return self.tokens[self.prompt_tokens:]

    @property
    def uncomputed(self) -> int:
        """Tokens still to feed before the next one can be sampled: 1 when decoding, more when (re)prefilling."""
        return len(self.tokens) - self.computed

    def append(self, token: int) -> str | None:
        """Add a sampled token; the finish reason it causes, or None to go on."""
        self.tokens.append(token)
        self.token_times_s.append(time.perf_counter() - self.submitted)
        if self.request.on_token is not None:
            self.request.on_token(token)
        return self.finish_reason()

    def finish_reason(self) -> str | None:
        p = self.params
        if self.tokens[-1] in self._stops:
            return STOP_TOKEN
        if p.stop and self._stop_string_seen():
            return STOP_STRING
        if p.max_tokens is not None and len(self.reply) >= p.max_tokens:
            return MAX_TOKENS
        if len(self.tokens) >= self.context:
            return CONTEXT
        return None

    def _stop_string_seen(self) -> bool:
        # checked every token, so a stop string can only newly end in the tail: decoding the last few
        # tokens (a token spells at least one character, bar byte pieces, hence the margin) suffices
        tail = max(len(s) for s in self.params.stop) + 8
        assert self.detokenize is not None, "the engine refuses stop strings without a detokenize callable"
        text = self.detokenize(self.reply[-tail:])
        return any(s in text for s in self.params.stop)

    def preempt(self, resume: PrefillRequest | None = None) -> None:
        """Give up the KV. With `resume` (its KV was saved through the store) the sequence gets it back by
        that prefill when admitted again; else it recomputes prompt + reply."""
        assert self.kv is not None
        self.kv.release()
        self.kv = None
        if resume is None:
            self.recomputed_tokens += self.computed
        self.resume, self.computed = resume, 0
        self.preemptions += 1

    def result(self, reason: str, error: str | None = None) -> DecodeResult:
        return DecodeResult(self.id, self.request, self.reply, reason, self.prompt_tokens, self.token_times_s,
                            self.preemptions, self.recomputed_tokens, self.prefill_path, self.resumed_from_store,
                            self.cached_tokens, self.window_source, self.drafted, self.accepted, error)
