"""Prefill → decode in one process: a PrefillResult's KV (pages and window ring) continues in place."""

from __future__ import annotations

import pytest
import torch

from engine.decode import DecodeConfig, DecodeEngine, DecodeError, DecodeRequest, SamplingParams
from engine.decode.request import MAX_TOKENS, STOP_TOKEN
from engine.model.decoder import Decoder
from engine.prefill.config import PrefillConfig
from engine.prefill.cost import ChunkCost
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import PrefillRequest
from tests.engine.decode.conftest import PROMPT_LENGTHS, REPLY, drive
from tests.engine.greedy import greedy

pytestmark = pytest.mark.unit
PAGES = 32


def _prefill_engine(model: Decoder) -> PrefillEngine:
    # a fixed cost model (nothing is timed) whose budget cuts long prompts into several chunks
    config = PrefillConfig(block_tokens=16, kv_pages=PAGES, cost=ChunkCost(a=1e-9, b=1e-3, c=1e-3),
                           step_budget_s=0.05)
    return PrefillEngine(model, None, config, model_id="tiny")


@pytest.mark.parametrize("speculative", [False, True])
def test_a_prefill_result_continues_as_greedy_from_scratch(family, monkeypatch, speculative):
    prefill = _prefill_engine(family.model)
    decode = DecodeEngine(family.model, prefill, DecodeConfig(speculative=speculative))
    prompts = [family.prompt(n) for n in PROMPT_LENGTHS[family.kind]]
    handed = [prefill.prefill(PrefillRequest(p)) for p in prompts]
    fed = []
    forward = family.model.forward
    monkeypatch.setattr(family.model, "forward", lambda chunks, *a, **k: fed.extend(len(c.tokens) for c in chunks)
                        or forward(chunks, *a, **k))
    # two handed over together, the third joining a few steps later
    results = drive(decode, {0: [DecodeRequest(r, SamplingParams(max_tokens=REPLY)) for r in handed[:2]],
                             4: [DecodeRequest(handed[2], SamplingParams(max_tokens=REPLY))]})
    monkeypatch.undo()
    for i, prompt in enumerate(prompts):
        assert results[i].tokens == greedy(family.model, prompt, REPLY), f"prompt of {len(prompt)}"
        assert results[i].tokens[0] == handed[i].first_token
        assert results[i].token_times_s[0] == 0.0
    if speculative:  # each chunk: the last token and at most gamma drafts, and fewer forwards than tokens
        assert max(fed) <= 1 + DecodeConfig().gamma and len(fed) < 3 * (REPLY - 1)
    else:
        assert set(fed) == {1}  # no prompt token recomputed
        assert len(fed) == 3 * (REPLY - 1)
    assert prefill.pool.free_pages == PAGES  # the decode engine released the handed-over KV


def test_a_handed_over_seeded_request_samples_as_one_prefilled_here(qwen3):
    prompt = qwen3.prompt(37)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=REPLY)
    here = drive(DecodeEngine(qwen3.model, None, DecodeConfig()), {0: [DecodeRequest(prompt, params)]})[0]
    prefill = _prefill_engine(qwen3.model)
    decode = DecodeEngine(qwen3.model, prefill, DecodeConfig())
    handed = drive(decode, {0: [DecodeRequest(prefill.prefill(PrefillRequest(prompt)), params)]})[0]
    assert handed.tokens == here.tokens


def test_a_first_token_that_ends_the_reply_finishes_at_submit(qwen3):
    prefill = _prefill_engine(qwen3.model)
    decode = DecodeEngine(qwen3.model, prefill, DecodeConfig())
    result = prefill.prefill(PrefillRequest(qwen3.prompt(20)))
    rid = decode.submit(DecodeRequest(result, SamplingParams(stop_token_ids=[result.first_token])))
    assert prefill.pool.free_pages == PAGES
    (done,) = decode.step()
    assert (done.id, done.tokens, done.finish_reason) == (rid, [result.first_token], STOP_TOKEN)
    result = prefill.prefill(PrefillRequest(qwen3.prompt(20)))
    (done,) = drive(decode, {0: [DecodeRequest(result, SamplingParams(max_tokens=1))]}).values()
    assert (done.tokens, done.finish_reason) == ([result.first_token], MAX_TOKENS)


def test_a_result_from_another_pool_or_handed_over_twice_is_refused(qwen3):
    prefill = _prefill_engine(qwen3.model)
    result = prefill.prefill(PrefillRequest(qwen3.prompt(20)))
    elsewhere = DecodeEngine(qwen3.model, None, DecodeConfig())
    with pytest.raises(DecodeError, match="another page pool"):
        elsewhere.submit(DecodeRequest(result))
    decode = DecodeEngine(qwen3.model, prefill.pool, DecodeConfig())
    decode.submit(DecodeRequest(result, SamplingParams(max_tokens=3)))
    with pytest.raises(DecodeError, match="already being decoded"):
        decode.submit(DecodeRequest(result))
    decode.run()
    with pytest.raises(DecodeError, match="released"):  # its KV was released when it finished
        decode.submit(DecodeRequest(result))
    assert prefill.pool.free_pages == PAGES


def test_cancelling_a_request_in_its_prefill_stops_the_prefill_and_frees_its_pages(qwen3):
    """A cancel must end the work too, not only the reply: a prompt left to prefill after its cancel costs
    the steps of every other request, and submitting then cancelling would pass every bound on requests."""
    prefill = _prefill_engine(qwen3.model)
    decode = DecodeEngine(qwen3.model, prefill, DecodeConfig(speculative=False))
    gone = decode.submit(DecodeRequest(PrefillRequest(qwen3.prompt(200)), SamplingParams(max_tokens=REPLY)))
    assert decode.step() == [] and prefill.pending == 1  # part of its prompt computed, the rest to come
    assert decode.cancel(gone) and not decode.cancel(gone)
    assert prefill.pending == 0 and prefill.pool.free_pages == PAGES
    (cancelled,) = decode.step()
    assert (cancelled.id, cancelled.finish_reason, cancelled.tokens) == (gone, "cancelled", [])
    assert decode.pending == 0
    queued = decode.submit(DecodeRequest(PrefillRequest(qwen3.prompt(40)), SamplingParams(max_tokens=REPLY)))
    assert decode.cancel(queued) and prefill.pending == 0  # cancelled before it was admitted


@pytest.mark.parametrize("speculative", [False, True])
def test_prompts_prefill_in_the_decode_steps_one_forward_and_continue_as_greedy(family, monkeypatch, speculative):
    """The prefill engine's chunks ride in the decode step's one forward (a second
    forward a step cost 6-10% of every step on 2 cores: bench/mixed_step.py); the replies stay greedy's."""
    prefill = _prefill_engine(family.model)
    decode = DecodeEngine(family.model, prefill, DecodeConfig(speculative=speculative))
    prompts = [family.prompt(n) for n in PROMPT_LENGTHS[family.kind]]
    forwards, steps = [0], [0]
    forward, step = family.model.forward, decode.step
    monkeypatch.setattr(family.model, "forward", lambda *a, **k: forwards.__setitem__(0, forwards[0] + 1)
                        or forward(*a, **k))
    monkeypatch.setattr(decode, "step", lambda: steps.__setitem__(0, steps[0] + 1) or step())
    # one alone, then two joining it while it decodes: their prompts prefill beside its decode tokens
    results = drive(decode, {0: [DecodeRequest(PrefillRequest(prompts[0]), SamplingParams(max_tokens=REPLY))],
                             3: [DecodeRequest(PrefillRequest(p), SamplingParams(max_tokens=REPLY))
                                 for p in prompts[1:]]})
    monkeypatch.undo()
    for i, prompt in enumerate(prompts):
        assert results[i].tokens == greedy(family.model, prompt, REPLY), f"prompt of {len(prompt)}"
    assert forwards[0] <= steps[0]  # never two forwards in a step
    assert prefill.pool.free_pages == PAGES


def test_a_prefill_result_keeps_its_own_logits_not_the_steps(qwen3):
    """The decode engine hands the prefill engine rows of its whole step's logits; a result that kept a view
    would keep every row of that step alive (~1 MiB each at a real vocabulary) for as long as it decodes."""
    prefill = _prefill_engine(qwen3.model)
    prefill.submit(PrefillRequest(qwen3.prompt(12)))
    planned = prefill.plan_step()
    assert planned is not None and len(planned.chunks) == 1
    (last,) = qwen3.model.forward(planned.chunks, planned.before_layer)
    step = torch.zeros(7, last.numel())  # (rows, vocab): the step's other rows around this prompt's
    step[3] = last
    (result,) = prefill.finish_step(planned, [step[3]])
    assert torch.equal(result.logits, last)
    assert result.logits.untyped_storage().nbytes() == last.numel() * last.element_size()
    result.kv.release()
