"""Speculative decoding in the decode engine on the tiny families: lossless.

Greedy replies with speculation are transformers' generate, token for token, alone and continuously
batched, across the sliding window (gemma3's window of 16 wraps its ring every few steps, so a rejected
draft that is not rolled back corrupts the next tokens), under preemption and with the overlap thread;
stops inside an accepted run end the reply where they would without speculation; seeded sampling with
speculation draws sequences from the target's own distribution (a chi-square goodness-of-fit test
against the exact probabilities, computed by transformers).

Prompts repeat a random phrase, as agent traffic repeats its context, so the n-gram drafter proposes
and the random models' (often looping) greedy replies accept a good share; every test checks that drafts
were both accepted and rejected, so both paths ran.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import pytest
import torch

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, DecodeResult, SamplingParams
from engine.decode.request import MAX_TOKENS, STOP_STRING, STOP_TOKEN
from engine.decode.sampling import candidates
from engine.model.decode_attention import VerifyBatch
from engine.model.decoder import Chunk
from engine.model.kv import PagePool, RequestKV
from tests.engine.decode.conftest import PROMPT_LENGTHS, REPLY, Family, drive, tokens

pytestmark = pytest.mark.unit  # lossless on tiny families, in make test (the real model: make test-speculative)
GREEDY = SamplingParams(max_tokens=REPLY)


def flat(b: int) -> float:
    """A flat SPS: the schedule then admits every draft with a survival above zero (all of them)."""
    return 100.0


def _engine(family: Family, **config) -> DecodeEngine:
    return DecodeEngine(family.model, None, DecodeConfig(**{"block_tokens": 16, "kv_pages": 64, "speculative": True,
                                                            "sps": flat, **config}))


def repeating(n: int, seed: int) -> list[int]:
    """n tokens: a random phrase of 7, repeated, then a random tail of 3 (the reply goes on from there)."""
    phrase = tokens(7, seed=seed)
    body = (phrase * (n // 7 + 1))[: max(0, n - 3)]
    return body + tokens(3, seed=seed + 1000)[: n - len(body)]


def _prompts(family: Family) -> list[list[int]]:
    """Random prompts (the families' own) and repeating ones, short and across the sliding window."""
    lengths = PROMPT_LENGTHS[family.kind]
    return [family.prompt(n) for n in lengths] + [repeating(n, seed=n) for n in (*lengths, 24)]


def _drafts(results: dict[int, DecodeResult]) -> tuple[int, int]:
    return sum(r.drafted for r in results.values()), sum(r.accepted_drafts for r in results.values())


def test_greedy_alone_with_speculation_is_transformers_generate(family):
    engine = _engine(family)
    drafted = accepted = 0
    for prompt in _prompts(family):
        results = drive(engine, {0: [DecodeRequest(prompt, GREEDY)]})
        assert (results[0].tokens, results[0].finish_reason) == (family.generate(prompt), MAX_TOKENS), \
            f"prompt of {len(prompt)}"
        assert len(results[0].token_times_s) == REPLY
        drafted, accepted = (a + b for a, b in zip((drafted, accepted), _drafts(results)))
    assert 0 < accepted < drafted, (accepted, drafted)
    assert engine.pool.free_pages == engine.pool.num_pages
    assert len(engine.draft_records) > 0


@pytest.mark.parametrize("fixed", [None, 5, 1])
def test_greedy_batched_with_joins_and_leaves_is_transformers_generate(family, fixed):
    prompts = _prompts(family)
    # joining at different steps, several in one step, one while others decode; shorter replies leave early
    steps = [0, 0, 2, 3, 3, 7, 11][: len(prompts)]
    lengths = [REPLY, 13, REPLY, 25, REPLY, 7, REPLY]
    joins: dict[int, list[DecodeRequest]] = {}
    for prompt, step, n in zip(prompts, steps, lengths):
        joins.setdefault(step, []).append(DecodeRequest(prompt, SamplingParams(max_tokens=n)))
    results = drive(_engine(family, fixed_drafts=fixed), joins)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert results[i].tokens == family.generate(prompt)[:n], f"request {i}, prompt of {len(prompt)}"
    drafted, accepted = _drafts(results)
    assert 0 < accepted < drafted


def test_preemption_and_overlap_with_speculation_keep_each_its_own_tokens(family):
    prompts = _prompts(family)
    requests = [DecodeRequest(p, GREEDY) for p in prompts]
    for config in ({"kv_pages": 12}, {"overlap": True}):  # 12 pages of 16 cannot hold all: some are preempted
        engine = _engine(family, **config)
        results = drive(engine, {0: requests[:3], 1: requests[3:]})
        engine.close()
        assert [results[i].tokens for i in range(len(prompts))] == [family.generate(p) for p in prompts], config
        assert engine.pool.free_pages == engine.pool.num_pages
        if "kv_pages" in config:
            assert sum(r.preemptions for r in results.values()) > 0


def _runs(family: Family, prompt: list[int], detokenize: Callable[[Sequence[int]], str] | None = None,
          **params) -> tuple[DecodeResult, list[list[int]]]:
    """A greedy reply with speculation, and the tokens each step appended (more than one: drafts accepted)."""
    per_step: list[list[int]] = [[]]
    engine = _engine(family)
    engine.submit(DecodeRequest(prompt, SamplingParams(max_tokens=REPLY, **params), detokenize=detokenize,
                                on_token=lambda token: per_step[-1].append(token)))
    results = []
    while engine.pending:
        results += engine.step()
        per_step.append([])
    (result,) = results
    return result, [s for s in per_step if s]


def looping(family: Family) -> list[int]:
    """A prompt ending inside a loop of the model's own greedy reply (random models fall into short cycles):
    the reply goes on looping, so drafts copied from the loop are accepted in runs."""
    prompt = repeating(30, seed=2)
    return prompt + family.generate(prompt)[:16]


def test_a_stop_inside_an_accepted_run_ends_the_reply_there(qwen3):
    prompt = looping(qwen3)
    reply = qwen3.generate(prompt)
    result, steps = _runs(qwen3, prompt)
    assert result.tokens == reply
    # positions of the reply that an accepted draft filled: not the last token of its step
    ends = list(itertools.accumulate(len(run) for run in steps))
    inside = [(k, j) for k, run in enumerate(steps) for j in range(len(run) - 1)]  # (step, index in it)
    assert inside, steps
    # a stop string that first occurs at such a position: every token spells "x", the string is c + 1 of them
    for k, j in inside[:8]:
        c = ends[k] - len(steps[k]) + j
        stopped, stopped_steps = _runs(qwen3, prompt, lambda ids: "x" * len(ids), stop=("x" * (c + 1),))
        assert (stopped.tokens, stopped.finish_reason) == (reply[: c + 1], STOP_STRING), c
        # the same steps up to the stop, which cut its step's accepted run short (on_token saw nothing after)
        assert stopped_steps == steps[:k] + [steps[k][: j + 1]], c
    # a stop token: the reply ends at its first occurrence, as without speculation
    for k, j in inside[:4]:
        c = ends[k] - len(steps[k]) + j
        stopped, _ = _runs(qwen3, prompt, stop_token_ids=(reply[c],))
        cut = reply.index(reply[c]) + 1
        assert (stopped.tokens, stopped.finish_reason) == (reply[:cut], STOP_TOKEN), c


SAMPLED = 4  # tokens per sampled reply: top_k = 2 makes 16 possible replies, each a cell of the test
TRIALS = 3000
Z = 3.0902  # the standard normal's 0.999 quantile: the test fails wrongly once in a thousand runs


def chi_square_limit(df: int, z: float = Z) -> float:
    """The chi-square (1 - 0.001) quantile, by Wilson-Hilferty: exact enough for df >= 3."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def test_seeded_sampling_with_speculation_draws_from_the_targets_distribution(qwen3):
    prompt = looping(qwen3)
    params = dict(temperature=1.0, top_k=2, max_tokens=SAMPLED)
    # the exact distribution of the 16 replies, from transformers' logits through the engine's own top-k
    exact: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], probability: float) -> None:
        if len(prefix) == SAMPLED:
            exact[prefix] = probability
            return
        tokens_, weights = candidates(qwen3.tiny.logits(prompt + list(prefix))[-1], SamplingParams(**params))
        for token, weight in zip(tokens_.tolist(), (weights / weights.sum()).tolist()):
            expand((*prefix, token), probability * weight)

    expand((), 1.0)
    assert len(exact) == 2**SAMPLED and sum(exact.values()) == pytest.approx(1.0)
    engine = _engine(qwen3, max_running=256, kv_pages=512)
    requests = [DecodeRequest(prompt, SamplingParams(seed=seed, **params)) for seed in range(TRIALS)]
    results = drive(engine, {0: requests})
    counts = {cell: 0 for cell in exact}
    for result in results.values():
        counts[tuple(result.tokens)] += 1  # a reply outside the 16 raises KeyError: top-k was not kept
    drafted, accepted = _drafts(results)
    assert accepted > TRIALS // 4 and drafted > accepted  # speculation really ran, and really rejected
    statistic = sum((counts[c] - TRIALS * p) ** 2 / (TRIALS * p) for c, p in exact.items())
    assert statistic < chi_square_limit(len(exact) - 1), (statistic, counts)
    # and not every seed drew the same reply: sampling sampled
    assert len({c for c, n in counts.items() if n}) > 5


def test_draft_room_keeps_max_tokens_and_the_context(qwen3):
    # replies of 1..6 tokens: drafts must never carry a reply past max_tokens
    prompt = repeating(30, seed=3)
    reply = qwen3.generate(prompt)
    requests = [DecodeRequest(prompt, SamplingParams(max_tokens=n)) for n in range(1, 7)]
    results = drive(_engine(qwen3), {0: requests})
    assert [results[i].tokens for i in range(6)] == [reply[:n] for n in range(1, 7)]
    context = qwen3.model.config.max_position_embeddings
    long = list(itertools.islice(itertools.cycle(repeating(30, seed=3)), context - 9))
    (result,) = drive(_engine(qwen3), {0: [DecodeRequest(long, SamplingParams(max_tokens=None))]}).values()
    assert len(long) + len(result.tokens) == context and result.finish_reason == "context"


ROLLBACK_PROMPTS = {"qwen3": 40, "gpt_oss": 140, "gemma3": 30}  # past the sliding window (128, 16)


@pytest.mark.parametrize("kept", [0, 1, 3])
def test_a_rollback_leaves_the_kv_as_if_the_rejected_drafts_were_never_fed(family, kept):
    """Feed [last, d1..d5] at once and keep `kept` drafts, beside a KV fed only [last, d1..d_kept]: every
    later token's logits agree. Past the window a rejected draft at p has overwritten ring slot p % W,
    which held p - W, in the window of the next tokens: only the checkpoint's restore brings it back."""
    model, config = family.model, family.model.config
    prompt = family.prompt(ROLLBACK_PROMPTS[family.kind])
    pool = PagePool(config, 32, 16, model.dtype, model.device)
    speculated, plain = RequestKV(config, pool), RequestKV(config, pool)
    start = len(prompt) - 1
    for kv in (speculated, plain):
        kv.reserve(start + 16)
        model.forward([Chunk(kv, torch.tensor(prompt[:-1]), 0)])
    drafts = tokens(5, seed=99)
    checkpoint = speculated.checkpoint(start + 1, start + 6)
    scores = model.forward([Chunk(speculated, torch.tensor([prompt[-1], *drafts]), start)], logits_for=[6])[0]
    assert scores.shape == (6, config.vocab_size)
    speculated.rollback(start + 1 + kept, checkpoint)
    (plain_scores,) = model.forward([Chunk(plain, torch.tensor([prompt[-1], *drafts[:kept]]), start)],
                                    all_logits=True)
    torch.testing.assert_close(scores[: kept + 1], plain_scores, rtol=1e-4, atol=1e-4)  # the kept rows
    assert speculated.length == plain.length == start + 1 + kept
    following = tokens(8, seed=7)  # then decode the same tokens one by one in both
    for i, token in enumerate(following):
        position = start + 1 + kept + i
        (a,) = model.forward([Chunk(speculated, torch.tensor([token]), position)])
        (b,) = model.forward([Chunk(plain, torch.tensor([token]), position)])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"token {i} after the rollback")
    for kv in (speculated, plain):
        kv.release()


def test_batched_verification_chunks_score_as_transformers_does(family):
    """Chunks of 1 to 6 tokens after prompts short and past the window, in one forward (the batched
    verification path, `VerifyBatch`), then again after more tokens: every position's logits are the
    reference's."""
    model, config = family.model, family.model.config
    lengths = (3, 20, ROLLBACK_PROMPTS[family.kind], 9)
    sizes = (6, 1, 4, 2)
    prompts = [tokens(n, seed=40 + n) for n in lengths]
    pool = PagePool(config, 64, 16, model.dtype, model.device)
    kvs = [RequestKV(config, pool) for _ in prompts]
    histories = []
    for kv, prompt in zip(kvs, prompts):
        kv.reserve(len(prompt) + 16)
        model.forward([Chunk(kv, torch.tensor(prompt), 0)])
        histories.append(list(prompt))
    for round_ in range(2):
        fed = [tokens(n, seed=60 + 10 * round_ + i) for i, n in enumerate(sizes)]
        chunks = [Chunk(kv, torch.tensor(f), len(h)) for kv, f, h in zip(kvs, fed, histories)]
        assert VerifyBatch.applies(kvs, [len(c.tokens) for c in chunks], [c.start for c in chunks])
        scores = model.forward(chunks, all_logits=True)
        for i, (h, f) in enumerate(zip(histories, fed)):
            reference = family.tiny.logits(h + f)[len(h):]  # (n, vocab)
            torch.testing.assert_close(scores[i], reference, rtol=1e-4, atol=1e-4, msg=f"round {round_}, chunk {i}")
            h.extend(f)


def steep(b: int) -> float:
    """An SPS falling with B, as on a CPU: the schedule then admits fewer drafts the more others verify."""
    return 1.0 / (1.0 + 0.25 * b)


def test_seeded_sampling_with_speculation_is_the_reply_without_alone_and_batched(family):
    """Each token costs one draw of the request's generator, drafted or not: a seeded reply is the one
    decoding without speculation gives, whatever the schedule verified and whatever shares its steps."""
    prompt = looping(family) if family.kind == "qwen3" else repeating(30, seed=2)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=REPLY)
              for t, k, p, s in ((1.0, 2, 1.0, 7), (0.8, 0, 0.9, 8), (0.5, 3, 1.0, 9))]
    plain = [drive(_engine(family, speculative=False), {0: [DecodeRequest(prompt, p)]})[0].tokens for p in params]
    for schedule in (dict(sps=steep), dict(sps=flat), dict(fixed_drafts=1), dict(fixed_drafts=5)):
        alone = [drive(_engine(family, **schedule), {0: [DecodeRequest(prompt, p)]})[0] for p in params]
        assert [r.tokens for r in alone] == plain, schedule
        assert sum(r.accepted_drafts for r in alone) > 0 and sum(r.drafted for r in alone) > 0
    neighbours = [DecodeRequest(repeating(n, seed=n), GREEDY) for n in (12, 24, 40)]
    sampled = [DecodeRequest(prompt, p) for p in params]
    batched = drive(_engine(family, sps=steep), {0: neighbours[:2] + sampled[:1], 2: sampled[1:], 3: neighbours[2:]})
    assert [batched[i].tokens for i in (2, 3, 4)] == plain
