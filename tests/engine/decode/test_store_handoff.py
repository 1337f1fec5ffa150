"""The decode engine and the store: a prompt prefilled by another process continues from the state it
handed over (one token recomputed), falls back and says so where that state is gone, and a sequence
preempted between decode steps saves its state through the store and resumes from it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
from engine.prefill.request import HANDED_OVER, REPLAYED, WINDOW_MISSING, PrefillRequest
from tests.engine.decode.conftest import Family, drive
from tests.engine.prefill.test_engine import BLOCK, _client, _engine, _tokens
from tests.engine.prefill.test_replay import R, _stored_first_turn

pytestmark = pytest.mark.integration
REPLY = 40


def _prefill_in_a_process(tiny, daemon, prompts: list[list[int]]) -> None:
    """A prefill process: prefills each prompt with hand_off, flushes, exits (its pages and window tier gone)."""
    script = f"""
import json, sys
from tests.engine.prefill.test_engine import _client, _engine
from engine.prefill.request import PrefillRequest
class Tiny: path = {str(tiny.path)!r}
with _client(type("D", (), {{"address": {daemon.address!r}}})) as client:
    engine = _engine(Tiny, client)
    for prompt in json.loads(sys.stdin.read()):
        result = engine.prefill(PrefillRequest(prompt, hand_off=True))
        assert result.handed_off
        result.kv.release()
    assert engine.flush(30)
"""
    subprocess.run([sys.executable, "-c", script], input=json.dumps(prompts), text=True, check=True, timeout=120)


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_prompts_prefilled_in_another_process_decode_as_greedy_from_scratch(families, tiny_models, daemons, kind):
    tiny, family = tiny_models[kind], families[kind]
    (daemon,) = daemons(1)
    # shorter than a block, one past a boundary, and past gpt_oss's 128-token window mid-block
    prompts = [_tokens(n, seed=n) for n in (9, 4 * BLOCK + 1, 150)]
    _prefill_in_a_process(tiny, daemon, prompts)
    with _client(daemon) as client:
        decode = DecodeEngine(family.model, _engine(tiny, client), DecodeConfig())
        reply = SamplingParams(max_tokens=REPLY)
        results = drive(decode, {0: [DecodeRequest(PrefillRequest(p, from_handoff=True), reply) for p in prompts[:2]],
                                 3: [DecodeRequest(PrefillRequest(prompts[2], from_handoff=True),
                                                   SamplingParams(max_tokens=REPLY))]})
    for i, prompt in enumerate(prompts):
        assert results[i].prefill_path == HANDED_OVER
        assert results[i].tokens == family.generate(prompt, REPLY)


def test_without_the_handed_over_state_the_decode_side_falls_back_and_says_so(families, tiny_models, daemons):
    tiny, family = tiny_models["gpt_oss"], families["gpt_oss"]
    (daemon,) = daemons(1)
    prompt = _tokens(150, seed=40)
    with _client(daemon) as client:
        # the blocks stored, no continuation record, the window only here
        stored = _engine(tiny, client, store_windows=False)
        stored.prefill(PrefillRequest(prompt)).kv.release()
        assert stored.flush(10)
        decode = DecodeEngine(family.model, _engine(tiny, client), DecodeConfig())
        (result,) = drive(decode, {0: [DecodeRequest(PrefillRequest(prompt, from_handoff=True),
                                                     SamplingParams(max_tokens=REPLY))]}).values()
    assert result.prefill_path == WINDOW_MISSING  # recomputed: exact, and says why
    assert result.tokens == family.generate(prompt, REPLY)


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_a_preempted_sequence_resumes_from_the_store_as_if_never_preempted(families, tiny_models, daemons, kind):
    tiny, family = tiny_models[kind], families[kind]
    (daemon,) = daemons(1)
    prompt, other = _tokens(150, seed=41), _tokens(100, seed=42)
    with _client(daemon) as client:
        engine = _engine(tiny, client, kv_pages=18)  # 7 + 10 pages of prompts, then the younger is preempted
        decode = DecodeEngine(family.model, engine, DecodeConfig())
        results = drive(decode, {0: [DecodeRequest(PrefillRequest(other), SamplingParams(max_tokens=45)),
                                     DecodeRequest(PrefillRequest(prompt, session_id="s"),
                                                   SamplingParams(max_tokens=45))]})
    older, younger = results[0], results[1]
    assert older.preemptions == 0 and younger.preemptions >= 1
    assert younger.resumed_from_store == younger.preemptions and younger.recomputed_tokens == 0
    assert older.tokens == family.generate(other, 45)
    assert younger.tokens == family.generate(prompt, 45)


def test_a_preempted_replayed_sequence_resumes_its_replayed_state(families, tiny_models, daemons):
    """Approximate KV stays what it was: the resumed reply is the one the unpreempted replay gives."""
    tiny, family = tiny_models["gpt_oss"], families["gpt_oss"]
    (daemon,) = daemons(1)
    tokens, other = _tokens(700, seed=43), _tokens(100, seed=44)
    replies = []
    with _client(daemon) as client:
        _stored_first_turn(tiny, client, tokens)  # 496 stored tokens, their window lost
        for pages in (128, 46):  # room for both; then 38 + 7 pages of prompts, the younger preempted
            engine = _engine(tiny, client, replay_tokens=R, kv_pages=pages, store_windows=False)
            decode = DecodeEngine(family.model, engine, DecodeConfig())
            results = drive(decode, {0: [DecodeRequest(PrefillRequest(other), SamplingParams(max_tokens=40)),
                                         DecodeRequest(PrefillRequest(tokens[:600]), SamplingParams(max_tokens=40))]})
            assert results[1].prefill_path == REPLAYED
            replies.append(results[1])
    assert replies[0].preemptions == 0
    assert replies[1].preemptions >= 1 and replies[1].resumed_from_store == replies[1].preemptions
    assert replies[1].tokens == replies[0].tokens


def test_a_prefill_request_needs_a_prefill_engine(families):
    from engine.decode import DecodeError

    family: Family = families["qwen3"]
    with pytest.raises(DecodeError, match="PrefillEngine"):
        DecodeEngine(family.model, None, DecodeConfig()).submit(DecodeRequest(PrefillRequest([1, 2, 3])))


def test_a_cancelled_request_stops_its_prefill_and_frees_its_kv(families, tiny_models, daemons):
    """Its prefill ends with the cancel (else a tenant could submit and cancel past every bound on requests,
    leaving the work behind): nothing of it is computed further, nor saved."""
    tiny, family = tiny_models["qwen3"], families["qwen3"]
    (daemon,) = daemons(1)
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        decode = DecodeEngine(family.model, engine, DecodeConfig())
        rid = decode.submit(DecodeRequest(PrefillRequest(_tokens(60, seed=45))))
        assert decode.cancel(rid) and not decode.cancel(rid)
        (result,) = decode.run()
        assert result.finish_reason == "cancelled" and result.tokens == []
        assert engine.pool.free_pages == engine.pool.num_pages and decode.pending == 0
        assert engine.pending == 0 and engine.flush(10)
        assert client.lookup(engine.namespace().blocks(_tokens(60, seed=45))) == 0  # nothing computed, nothing saved


def test_a_sequence_waiting_for_pages_a_prefill_holds_waits_rather_than_fails(families):
    """Nothing runs, a sequence waits for pages, and the pages are the prefill engine's, which goes on:
    the step waits for it (it used to raise KVCapacityError)."""
    from engine.prefill.config import PrefillConfig
    from engine.prefill.cost import ChunkCost
    from engine.prefill.engine import PrefillEngine

    family = families["qwen3"]
    # 1 s per token by the cost model and an 8 s budget: a prompt prefills 8 tokens (one page) a step
    prefill = PrefillEngine(family.model, None, PrefillConfig(block_tokens=8, kv_pages=11, step_budget_s=8.0,
                                                              cost=ChunkCost(0.0, 1.0, 0.0)), "m")
    decode = DecodeEngine(family.model, prefill, DecodeConfig())
    short = DecodeRequest(PrefillRequest(_tokens(13, seed=46)), SamplingParams(max_tokens=40))
    long = DecodeRequest(PrefillRequest(_tokens(72, seed=47)), SamplingParams(max_tokens=4))
    results = drive(decode, {0: [short], 3: [long]})
    assert [r.finish_reason for r in results.values()] == ["max_tokens", "max_tokens"]
    assert results[0].preemptions >= 1 and prefill.pool.free_pages == prefill.pool.num_pages
