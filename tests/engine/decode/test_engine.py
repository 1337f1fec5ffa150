"""The decode engine on the tiny families: greedy replies equal the plain greedy loop and transformers'
generate, alone and continuously batched; seeded sampling does not depend on the batch; preemption
recomputes exactly; every finish reason; bad input refused for that request alone."""

from __future__ import annotations

import pytest
import torch

from engine.decode import DecodeConfig, DecodeEngine, DecodeError, DecodeRequest, SamplingParams
from engine.decode.request import CANCELLED, CONTEXT, MAX_TOKENS, STOP_STRING, STOP_TOKEN
from engine.model.kv import KVCapacityError, PagePool, RequestKV
from tests.engine.conftest import VOCAB
from tests.engine.decode.conftest import PROMPT_LENGTHS, REPLY, drive, tokens
from tests.engine.greedy import greedy

pytestmark = pytest.mark.unit
GREEDY = SamplingParams(max_tokens=REPLY)


def _engine(family, **config) -> DecodeEngine:
    # the plain engine, one token per step: these tests count its forwards and tokens; speculation (on by
    # default) is driven through the same cases in test_speculative.py
    return DecodeEngine(family.model, None, DecodeConfig(**{"block_tokens": 16, "kv_pages": 64,
                                                            "speculative": False, **config}))


def _count_forwards(monkeypatch, model) -> list[list[int]]:
    """Per forward call, the token count of each of its chunks."""
    calls, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda chunks, *a, **k: calls.append([len(c.tokens) for c in chunks])
                        or forward(chunks, *a, **k))
    return calls


def test_greedy_alone_matches_the_greedy_loop_and_transformers(family):
    engine = _engine(family)
    for n in PROMPT_LENGTHS[family.kind]:
        prompt = family.prompt(n)
        (result,) = drive(engine, {0: [DecodeRequest(prompt, GREEDY)]}).values()
        expected = family.generate(prompt)
        assert greedy(family.model, prompt, REPLY) == expected, f"greedy loop, prompt of {n}"
        assert (result.tokens, result.finish_reason) == (expected, MAX_TOKENS), f"prompt of {n}"
        assert len(result.token_times_s) == REPLY
    assert engine.pool.free_pages == engine.pool.num_pages


def test_greedy_batched_with_staggered_joins_matches_alone(family, monkeypatch):
    lengths = PROMPT_LENGTHS[family.kind]
    # different lengths joining at different steps, two of them in one step, one while another prefills
    joins = {0: [lengths[2]], 3: [lengths[0], 9], 7: [lengths[1]], 20: [3]}
    calls = _count_forwards(monkeypatch, family.model)
    results = drive(_engine(family), {step: [DecodeRequest(family.prompt(n), GREEDY) for n in ns]
                                      for step, ns in joins.items()})
    prompts = [family.prompt(n) for ns in joins.values() for n in ns]
    for i, prompt in enumerate(prompts):
        assert results[i].tokens == family.generate(prompt), f"request {i}, prompt of {len(prompt)}"
    # one forward per step; each sequence feeds its prompt once, then one token per step
    assert sum(sum(call) for call in calls) == sum(len(p) + REPLY - 1 for p in prompts)
    assert max(len(call) for call in calls) == 5  # all five ran together in some steps
    assert [n for n in calls[5] if n > 1] == []  # step 5: everyone decoding, one token each


def test_prompts_beyond_the_step_budget_prefill_over_several_steps(qwen3, monkeypatch):
    calls = _count_forwards(monkeypatch, qwen3.model)
    prompt = qwen3.prompt(100)
    engine = _engine(qwen3, prefill_tokens_per_step=30)
    results = drive(engine, {0: [DecodeRequest(qwen3.prompt(5), GREEDY)], 2: [DecodeRequest(prompt, GREEDY)]})
    assert results[1].tokens == qwen3.generate(prompt)
    assert results[0].tokens == qwen3.generate(qwen3.prompt(5))
    assert [call for call in calls[2:6]] == [[1, 30], [1, 30], [1, 30], [1, 10]]  # the other kept decoding


def test_seeded_sampling_is_the_same_alone_and_batched(family):
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=REPLY)
              for t, k, p, s in ((1.0, 0, 1.0, 7), (0.8, 20, 1.0, 8), (1.3, 0, 0.9, 9), (1.0, 50, 0.95, 10))]
    prompts = [family.prompt(n) for n in (*PROMPT_LENGTHS[family.kind], 8)]
    alone = [drive(_engine(family), {0: [DecodeRequest(p, s)]})[0].tokens for p, s in zip(prompts, params)]
    requests = [DecodeRequest(p, s) for p, s in zip(prompts, params)]
    batched = drive(_engine(family), {0: requests[:1], 2: requests[1:3], 5: requests[3:]})
    assert [batched[i].tokens for i in range(4)] == alone
    assert alone[0] != family.generate(prompts[0])  # sampling really sampled


def test_different_seeds_differ_and_temperature_zero_is_greedy(qwen3):
    prompt = qwen3.prompt(37)
    replies = [drive(_engine(qwen3), {0: [DecodeRequest(prompt, SamplingParams(temperature=1.0, seed=seed,
                                                                                max_tokens=REPLY))]})[0].tokens
               for seed in (1, 2, 1)]
    assert replies[0] == replies[2] and replies[0] != replies[1]
    zero = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=1, max_tokens=REPLY)
    assert drive(_engine(qwen3), {0: [DecodeRequest(prompt, zero)]})[0].tokens == qwen3.generate(prompt)


def test_a_pool_too_small_for_all_preempts_and_still_gives_each_its_own_tokens(family):
    # four sequences need 3-11 pages of 16 tokens each at the end; 14 pages cannot hold them together
    prompts = [family.prompt(n) for n in (*PROMPT_LENGTHS[family.kind], 20)]
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=REPLY)
    params = [GREEDY, GREEDY, GREEDY, sampled]
    alone = [drive(_engine(family), {0: [DecodeRequest(p, s)]})[0].tokens for p, s in zip(prompts, params)]
    engine = _engine(family, kv_pages=14)
    results = drive(engine, {0: [DecodeRequest(p, s) for p, s in zip(prompts, params)]})
    assert [results[i].tokens for i in range(4)] == alone
    assert sum(r.preemptions for r in results.values()) > 0
    assert sum(r.recomputed_tokens for r in results.values()) > 0
    assert engine.pool.free_pages == 14


def test_finish_reasons(qwen3):
    prompt = qwen3.prompt(37)
    reply = qwen3.generate(prompt)
    stop = reply[5]
    ended = drive(_engine(qwen3), {0: [DecodeRequest(prompt, SamplingParams(stop_token_ids=[stop]))]})[0]
    assert (ended.tokens, ended.finish_reason) == (reply[: reply.index(stop) + 1], STOP_TOKEN)

    def spell(ids):
        return "".join(f"<{i}>" for i in ids)
    text = f"<{reply[7]}><{reply[8]}>"
    first = next(i for i in range(len(reply)) if text in spell(reply[: i + 1]))
    ended = drive(_engine(qwen3), {0: [DecodeRequest(prompt, SamplingParams(stop=text), detokenize=spell)]})[0]
    assert (ended.tokens, ended.finish_reason) == (reply[: first + 1], STOP_STRING)
    from_config = drive(_engine(qwen3, detokenize=spell), {0: [DecodeRequest(prompt, SamplingParams(stop=[text]))]})
    assert from_config[0].tokens == ended.tokens

    ended = drive(_engine(qwen3), {0: [DecodeRequest(prompt, SamplingParams(max_tokens=5))]})[0]
    assert (ended.tokens, ended.finish_reason) == (reply[:5], MAX_TOKENS)

    context = qwen3.model.config.max_position_embeddings  # 1024
    long = tokens(context - 6, seed=5)
    ended = drive(_engine(qwen3), {0: [DecodeRequest(long, SamplingParams(max_tokens=None))]})[0]
    assert (len(ended.tokens), ended.finish_reason) == (6, CONTEXT)
    assert ended.tokens == qwen3.generate(long, 6)


def test_cancel_frees_the_kv_and_reports_it(qwen3):
    engine = _engine(qwen3)
    keep = engine.submit(DecodeRequest(qwen3.prompt(37), GREEDY))
    gone = engine.submit(DecodeRequest(qwen3.prompt(100), GREEDY))
    for _ in range(3):
        assert engine.step() == []
    assert engine.cancel(gone) and not engine.cancel(gone)
    (cancelled,) = engine.step()
    assert (cancelled.id, cancelled.finish_reason, len(cancelled.tokens)) == (gone, CANCELLED, 3)
    (done,) = engine.run()
    assert done.id == keep and done.tokens == qwen3.generate(qwen3.prompt(37))
    assert engine.pool.free_pages == engine.pool.num_pages


BAD = {
    "max_tokens 0": lambda p: DecodeRequest(p, SamplingParams(max_tokens=0)),
    "max_tokens past the context": lambda p: DecodeRequest(p, SamplingParams(max_tokens=1024 - len(p) + 1)),
    "stop token outside the vocabulary": lambda p: DecodeRequest(p, SamplingParams(stop_token_ids=[1, VOCAB])),
    "negative stop token": lambda p: DecodeRequest(p, SamplingParams(stop_token_ids=[-1])),
    "stop string without detokenize": lambda p: DecodeRequest(p, SamplingParams(stop="x")),
    "negative temperature": lambda p: DecodeRequest(p, SamplingParams(temperature=-0.5)),
    "nan temperature": lambda p: DecodeRequest(p, SamplingParams(temperature=float("nan"))),
    "top_p 0": lambda p: DecodeRequest(p, SamplingParams(temperature=1.0, top_p=0.0)),
    "top_k negative": lambda p: DecodeRequest(p, SamplingParams(top_k=-1)),
    "seed not an int": lambda p: DecodeRequest(p, SamplingParams(seed="7")),
    "empty prompt": lambda p: DecodeRequest([], GREEDY),
    "token outside the vocabulary": lambda p: DecodeRequest([*p, VOCAB], GREEDY),
    "prompt fills the context": lambda p: DecodeRequest(tokens(1024), SamplingParams(max_tokens=None)),
    "more pages than the pool": lambda p: DecodeRequest(p, SamplingParams(max_tokens=400)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_for_that_request_alone(qwen3, case):
    engine = _engine(qwen3, kv_pages=20)  # 320 tokens
    prompt = qwen3.prompt(37)
    other = engine.submit(DecodeRequest(prompt, GREEDY))
    engine.step()
    with pytest.raises(DecodeError) as error:
        engine.submit(BAD[case](prompt))
    assert isinstance(error.value, ValueError) and str(error.value)
    (result,) = engine.run()
    assert result.id == other and result.tokens == qwen3.generate(prompt)
    assert engine.pool.free_pages == engine.pool.num_pages


def test_waiting_for_pages_held_outside_the_engine_raises_when_nothing_runs(qwen3):
    pool = PagePool(qwen3.model.config, 8, 16, torch.float32)
    held = RequestKV(qwen3.model.config, pool)
    held.reserve(8 * 16)  # all pages, e.g. an unreleased prefill result
    engine = DecodeEngine(qwen3.model, pool, DecodeConfig())
    engine.submit(DecodeRequest(qwen3.prompt(5), SamplingParams(max_tokens=3)))
    with pytest.raises(KVCapacityError, match="release"):
        engine.step()
    held.release()
    assert len(engine.run()[0].tokens) == 3


def test_a_pool_or_prefill_engine_of_another_dtype_is_refused(qwen3):
    # the model computes in fp32; KV pages in bf16 would fail at the first step's write, so the engine refuses them
    from engine.prefill import PrefillConfig, PrefillEngine
    from engine.prefill.cost import ChunkCost

    with pytest.raises(ValueError, match="bfloat16.*float32"):
        DecodeEngine(qwen3.model, PagePool(qwen3.model.config, 8, 16, torch.bfloat16), DecodeConfig())
    config = PrefillConfig(kv_pages=8, cost=ChunkCost(1e-9, 1e-3, 0))
    bf16 = PrefillEngine.from_pretrained(qwen3.tiny.path, None, config, torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        DecodeEngine(qwen3.model, bf16, DecodeConfig())


def test_overlap_gives_the_same_tokens_and_counts_the_gaps(family):
    """The next step's admission and pages prepared during the forward: same replies, with joins and
    preemptions (three sequences of 30 + 40 tokens need 15 of the pool's 8 pages of 16)."""
    prompts = [family.prompt(30), tokens(30, seed=1), tokens(30, seed=2)]
    replies = {}
    for overlap in (False, True):
        for speculative in (False, True):
            engine = DecodeEngine(family.model, None, DecodeConfig(kv_pages=8, block_tokens=16, overlap=overlap,
                                                                   speculative=speculative))
            results = drive(engine, {0: [DecodeRequest(prompts[0], SamplingParams(max_tokens=REPLY))],
                                     2: [DecodeRequest(p, SamplingParams(max_tokens=REPLY, temperature=0.8, seed=i))
                                         for i, p in enumerate(prompts[1:])]})
            replies[overlap, speculative] = [r.tokens for r in results.values()]
            assert sum(r.preemptions for r in results.values()) > 0
            # one token per step without speculation, so a gap between each two of a reply's forwards
            assert len(engine.idle_gaps_s) >= (1 if speculative else REPLY - 1) and min(engine.idle_gaps_s) >= 0
            engine.close()
        assert replies[overlap, False][0] == replies[overlap, True][0] == family.generate(prompts[0])
    # seeded sampling: the same with and without overlap (speculation may draw differently after a
    # preemption: docs/engines.md, "Speculative decoding")
    assert replies[False, False] == replies[True, False] and replies[False, True] == replies[True, True]
