"""How far bounded replay's output is from the exact state's, measured on one token sequence.

    results = replay_quality(model, tokens, prefix=P, end=P + T, replay_tokens=(128, 256, 512))
    summarize(results)   # pooled: top-1 agreement, KL(exact || replay), max |Δlogit|, greedy match, perplexity

The exact reference computes [0, end) in chunks. Each replay gets a fresh RequestKV holding the exact
run's full-layer KV of [0, P) (what the store would load), replays the last R tokens of the prefix
(`begin_replay`) and computes the next turn [P, end) from there. Both are compared at positions
P-1 .. end-1: the logits that predict the next turn's real tokens, then the reply's first token. Then
each decodes a greedy continuation in KV of its own (decoding writes the rings and pages, so the exact
run continues from a copy and can go on to the session's next span).

The vocabulary is 262,144 wide on the real model, so logits exist only `logit_rows` positions at a
time: a block of the exact run, then the same block of every replay, compared and dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.model.decoder import Chunk, Decoder
from engine.model.kv import PagePool, RequestKV
from engine.window.replay import begin_replay

CONTINUATION = 32  # greedy tokens compared after the prompt's end


@dataclass(frozen=True)
class Span:
    """A resumed request: the store holds [0, prefix); [prefix, end) is the next turn, ending the prompt."""

    prefix: int
    end: int

    @property
    def new_tokens(self) -> int:
        return self.end - self.prefix


@dataclass
class ReplayQuality:
    """One replay of `replay_tokens` at one span, against the exact state."""

    span: Span
    replay_tokens: int
    kl: torch.Tensor  # (T + 1,) float64: KL(exact || replay) at positions P-1 .. end-1
    top1: torch.Tensor  # (T + 1,) bool: the same argmax at those positions
    nll_exact: torch.Tensor  # (T,) float64: -log p of the next turn's real tokens [P, end), under exact
    nll_replay: torch.Tensor  # (T,) float64: the same under the replay
    max_dlogit: float  # largest |exact - replay| over those positions and the vocabulary
    greedy_exact: list[int]
    greedy_replay: list[int]

    @property
    def top1_end(self) -> bool:
        """Whether the reply's first token, predicted at the prompt's end, is the same."""
        return bool(self.top1[-1])

    @property
    def greedy_match(self) -> int:
        """How many leading tokens of the greedy continuation match exact's."""
        return next((i for i, (a, b) in enumerate(zip(self.greedy_exact, self.greedy_replay)) if a != b),
                    len(self.greedy_exact))

    @property
    def recomputed_frac(self) -> float:
        """Of the prefix, the share the replay recomputes (the rest of its compute is saved)."""
        return min(self.replay_tokens, self.span.prefix) / self.span.prefix

    def summary(self) -> dict:
        return {"prefix": self.span.prefix, "new_tokens": self.span.new_tokens, "replay_tokens": self.replay_tokens,
                **summarize([self])}


def summarize(results: Sequence[ReplayQuality]) -> dict:
    """The metrics pooled over `results` (per-position ones over all their positions)."""
    if not results:
        raise ValueError("summarize: no replay results to pool")
    kl = torch.cat([r.kl for r in results])  # (positions,)
    nll_exact, nll_replay = torch.cat([r.nll_exact for r in results]), torch.cat([r.nll_replay for r in results])
    continuation = len(results[0].greedy_exact)
    return {
        "items": len(results),
        "positions": kl.numel(),
        "top1_end": _mean(r.top1_end for r in results),
        "top1_turn": torch.cat([r.top1 for r in results]).double().mean().item(),
        "kl_mean": kl.mean().item(),
        "kl_p99": torch.quantile(kl, 0.99).item(),
        "max_dlogit": max(r.max_dlogit for r in results),
        "greedy_match": _mean(r.greedy_match for r in results),
        "greedy_full": _mean(r.greedy_match == continuation for r in results),
        "ppl_exact": math.exp(nll_exact.mean().item()),
        "ppl_replay": math.exp(nll_replay.mean().item()),
        "recomputed_frac": _mean(r.recomputed_frac for r in results),
    }


def replay_quality(model: Decoder, tokens: Sequence[int], prefix: int, end: int, replay_tokens: Sequence[int],
                   **options) -> list[ReplayQuality]:
    """Per R in `replay_tokens`, the replay at the span [prefix, end) of `tokens` against the exact state.
    `options` as for `session_replay_quality`."""
    return session_replay_quality(model, tokens, [Span(prefix, end)], replay_tokens, **options)


def session_replay_quality(model: Decoder, tokens: Sequence[int], spans: Sequence[Span], replay_tokens: Sequence[int],
                           continuation: int = CONTINUATION, chunk_tokens: int = 1024, logit_rows: int = 32,
                           block_tokens: int = 256,
                           on_span: Callable[[Span, list[ReplayQuality]], None] | None = None) -> list[ReplayQuality]:
    """Every R of `replay_tokens` at every span of one session, its exact run computed once across the spans.

    Spans come in order and apart (each prefix at least one past the previous end), since the exact run
    only moves forward. Prefix work runs in chunks of `chunk_tokens`; `on_span` is called after each span.
    Results: for each span, one per R, in the order given.
    """
    if not replay_tokens or min(replay_tokens) < 1:
        raise ValueError(f"replay quality: replay_tokens must be one or more R >= 1, got {list(replay_tokens)}")
    ids = torch.tensor(list(tokens), dtype=torch.long)  # (n,)

    def replays(exact: RequestKV, span: Span) -> list[RequestKV]:
        made = [_replay_kv(model, exact, span.prefix, r, span.end + continuation, block_tokens) for r in replay_tokens]
        _advance(model, ids, [(kv, max(0, span.prefix - r), span.prefix - 1) for kv, r in zip(made, replay_tokens)],
                 chunk_tokens)
        return made

    return session_variant_quality(model, tokens, spans, replays, replay_tokens, continuation, chunk_tokens,
                                   logit_rows, block_tokens, on_span)


def session_variant_quality(model: Decoder, tokens: Sequence[int], spans: Sequence[Span],
                            variants: Callable[[RequestKV, Span], list[RequestKV]], labels: Sequence[int],
                            continuation: int = CONTINUATION, chunk_tokens: int = 1024, logit_rows: int = 32,
                            block_tokens: int = 256,
                            on_span: Callable[[Span, list[ReplayQuality]], None] | None = None,
                            against_first: bool = False) -> list[ReplayQuality]:
    """The next turn's quality, at every span of one session, of each KV `variants(exact, span)` makes from the
    exact run's KV of [0, prefix) (a bounded replay, KV through a lossy codec...), against the exact run's.
    Each result's `replay_tokens` is its variant's label (`labels`, one per variant compared).

    `against_first`: the first variant is the reference instead of the exact run, and the others are
    compared with it. The variants are computed together, in one batch, and the exact run alone; in bf16 the
    two shapes round differently, so an unchanged copy of the exact KV computed beside the variants is the
    reference that leaves only what the variants changed."""
    _check(len(tokens), spans, continuation, chunk_tokens, logit_rows)
    ids = torch.tensor(list(tokens), dtype=torch.long)  # (n,)
    exact = new_kv(model, spans[-1].end + continuation, block_tokens)
    done, results = 0, []
    for span in spans:
        _advance(model, ids, [(exact, done, span.prefix - 1)], chunk_tokens)
        def made(kv: RequestKV, at: Span = span) -> list[RequestKV]:
            kvs = variants(kv, at)
            if len(kvs) != len(labels) + against_first:
                raise ValueError(f"variant quality: {len(kvs)} variants for {len(labels)} labels"
                                 + (" and the reference" if against_first else ""))
            return kvs

        measured = _measure_span(model, ids, exact, span, made, labels, continuation, logit_rows, against_first)
        done = span.end
        results += measured
        if on_span is not None:
            on_span(span, measured)
    return results


def spans_at(prompt_ends: Sequence[int], prefixes: Sequence[int], min_new_tokens: int) -> list[Span]:
    """Per prefix, the span to the first prompt end at least `min_new_tokens` past it: a request that
    resumes at a stored prefix and brings the rest of the conversation as its new tokens."""
    spans = []
    for prefix in prefixes:
        end = next((e for e in sorted(prompt_ends) if e >= prefix + min_new_tokens), None)
        if end is None:
            raise ValueError(f"no prompt ends {min_new_tokens}+ tokens after prefix {prefix} (last ends at "
                             f"{max(prompt_ends, default=0)}); build a longer session")
        spans.append(Span(prefix, end))
    return spans


def _measure_span(model: Decoder, ids: torch.Tensor, exact: RequestKV, span: Span,
                  variants: Callable[[RequestKV], list[RequestKV]], replay_tokens: Sequence[int],
                  continuation: int, logit_rows: int, against_first: bool = False) -> list[ReplayQuality]:
    """`exact` holds [0, prefix - 1); compare the span's logits block by block, then the continuations.
    `against_first`: the first variant is the reference, the others are compared with it."""
    prefix, end = span.prefix, span.end
    blocks = [(prefix - 1, prefix)] + [(a, min(a + logit_rows, end)) for a in range(prefix, end, logit_rows)]
    replays: list[RequestKV] = []
    # per R, one tensor per block of positions
    kl: list[list[torch.Tensor]] = [[] for _ in replay_tokens]
    top1: list[list[torch.Tensor]] = [[] for _ in replay_tokens]
    nll_exact: list[list[torch.Tensor]] = [[] for _ in replay_tokens]
    nll_replay: list[list[torch.Tensor]] = [[] for _ in replay_tokens]
    max_dlogit = [0.0] * len(replay_tokens)
    for a, b in blocks:
        (exact_logits,) = model.forward([Chunk(exact, ids[a:b], a)], all_logits=True)  # (b - a, vocab)
        if not replays:  # the exact run now holds all of [0, prefix): make each variant from it
            replays = variants(exact)
        replay_logits = model.forward([Chunk(kv, ids[a:b], a) for kv in replays], all_logits=True)
        reference, compared = (replay_logits[0], replay_logits[1:]) if against_first else (exact_logits, replay_logits)
        exact_log_probs = torch.log_softmax(reference.double(), dim=-1)  # (b - a, vocab)
        scored = max(0, min(b, end - 1) - a)  # rows whose next token is the next turn's, not the reply's
        targets = ids[a + 1 : a + 1 + scored, None]  # (scored, 1)
        for i, logits in enumerate(compared):
            log_probs = torch.log_softmax(logits.double(), dim=-1)  # (b - a, vocab)
            kl[i].append((exact_log_probs.exp() * (exact_log_probs - log_probs)).sum(-1))
            top1[i].append(reference.argmax(-1) == logits.argmax(-1))
            nll_exact[i].append(-exact_log_probs[:scored].gather(1, targets)[:, 0])
            nll_replay[i].append(-log_probs[:scored].gather(1, targets)[:, 0])
            max_dlogit[i] = max(max_dlogit[i], (reference - logits).abs().max().item())
    continuations = _greedy(model, [clone_kv(model, exact), *replays],
                            [exact_logits[-1], *(logits[-1] for logits in replay_logits)], end, continuation)
    if against_first:
        continuations = continuations[1:]
    return [ReplayQuality(span, r, torch.cat(kl[i]), torch.cat(top1[i]), torch.cat(nll_exact[i]),
                          torch.cat(nll_replay[i]), max_dlogit[i], continuations[0], continuations[i + 1])
            for i, r in enumerate(replay_tokens)]


def _greedy(model: Decoder, kvs: list[RequestKV], last_logits: list[torch.Tensor], end: int,
            continuation: int) -> list[list[int]]:
    """Greedy tokens after `end` for each KV (each holding [0, end)), decoded together one step at a time."""
    generated = [[int(logits.argmax())] for logits in last_logits]
    for position in range(end, end + continuation - 1):
        logits = model.forward([Chunk(kv, torch.tensor(tokens[-1:]), position) for kv, tokens in zip(kvs, generated)])
        for tokens, row in zip(generated, logits):
            tokens.append(int(row.argmax()))
    return generated


def _advance(model: Decoder, ids: torch.Tensor, runs: list[tuple[RequestKV, int, int]], chunk_tokens: int) -> None:
    """Compute ids[start:stop] into each run's KV, the runs batched in steps of `chunk_tokens` each."""
    for offset in range(0, max((stop - start for _, start, stop in runs), default=0), chunk_tokens):
        chunks = [Chunk(kv, ids[start + offset : min(start + offset + chunk_tokens, stop)], start + offset)
                  for kv, start, stop in runs if start + offset < stop]
        model.forward(chunks)


def new_kv(model: Decoder, tokens: int, block_tokens: int) -> RequestKV:
    pool = PagePool(model.config, -(-tokens // block_tokens), block_tokens, model.dtype, model.device)
    kv = RequestKV(model.config, pool)
    kv.reserve(tokens)
    return kv


def _replay_kv(model: Decoder, exact: RequestKV, prefix: int, replay_tokens: int, capacity: int,
               block_tokens: int) -> RequestKV:
    """A fresh KV whose full layers hold exact's KV of [0, prefix), as a load from the store leaves it, set to
    replay the last `replay_tokens` of the prefix."""
    kv = new_kv(model, capacity, block_tokens)
    for source, target in zip(exact.pool.layers, kv.pool.layers):  # each (pages, 2, block, kv_heads, head_dim)
        for block in range(-(-prefix // block_tokens)):
            filled = min(block_tokens, prefix - block * block_tokens)
            target[kv.block_table[block], :, :filled] = source[exact.block_table[block], :, :filled]
    kv.length = prefix
    begin_replay(kv, prefix, replay_tokens)
    return kv


def clone_kv(model: Decoder, kv: RequestKV) -> RequestKV:
    """An independent copy of `kv`: pages, rings and positions."""
    copy = new_kv(model, len(kv.block_table) * kv.block_tokens, kv.block_tokens)
    for source, target in zip(kv.pool.layers, copy.pool.layers):
        target[copy.block_table] = source[kv.block_table]
    if kv.rings is not None and copy.rings is not None:  # both of one model: rings in both or neither
        copy.rings.copy_(kv.rings)
    copy.length, copy.window_from, copy.keep_full_before = kv.length, kv.window_from, kv.keep_full_before
    return copy


def _check(n_tokens: int, spans: Sequence[Span], continuation: int, chunk_tokens: int, logit_rows: int) -> None:
    if not spans:
        raise ValueError("replay quality: give at least one span (prefix, end) to measure")
    if min(continuation, chunk_tokens, logit_rows) < 1:
        raise ValueError(f"replay quality: continuation ({continuation}), chunk_tokens ({chunk_tokens}) and "
                         f"logit_rows ({logit_rows}) must each be >= 1")
    previous_end = 0
    for span in spans:
        if not 1 <= span.prefix < span.end <= n_tokens:
            raise ValueError(f"replay quality: span {span} must satisfy 1 <= prefix < end <= {n_tokens} (the "
                             "tokens given)")
        if span.prefix - 1 < previous_end:
            raise ValueError(f"replay quality: span {span} starts before the previous span ended ({previous_end}); "
                             "give spans in order, each prefix past the previous end")
        previous_end = span.end


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
