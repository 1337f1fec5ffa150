"""A handed-over conversation's reply is saved as it fills blocks, in the prompt's chain, with the window at
its last block boundary: the next turn, whose prompt holds prompt + reply, resumes from all of it."""

from __future__ import annotations

import pytest

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, DecodeResult, SamplingParams
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import CACHED, REPLAYED, WINDOW_MISSING, PrefillRequest
from engine.window import record as window_records
from tests.engine.prefill.test_engine import BLOCK, _check, _client, _engine, _tokens
from tests.engine.prefill.test_replay import STORED, R, _replayed_logits, _stored_first_turn

pytestmark = pytest.mark.integration


def _decode(prefill: PrefillEngine, results, n: int, **config) -> list[DecodeResult]:
    """Greedy replies of n tokens to handed-over results, decoded together; the store holds what they saved."""
    decode = DecodeEngine(prefill.model, prefill, DecodeConfig(**config))
    ids = [decode.submit(DecodeRequest(r, SamplingParams(max_tokens=n))) for r in results]
    done = {d.id: d for d in decode.run()}
    assert prefill.client.write_behind.flush()
    return [done[i] for i in ids]


def _in_kv(tokens: int) -> int:
    """Tokens of a sequence's full blocks in its KV: its last token is sampled, never fed."""
    return (tokens - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_the_next_turn_finds_the_reply_cached(tiny_models, daemons, kind):
    tiny = tiny_models[kind]
    (daemon,) = daemons(1)
    prompt, more = _tokens(150, seed=30), _tokens(30, seed=31)  # past gpt_oss's 128-token window
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        first = engine.prefill(PrefillRequest(prompt, session_id="s"))
        (done,) = _decode(engine, [first], 45)
        conversation = prompt + done.tokens  # 195 tokens: the reply filled blocks 9, 10 and 11
        if engine.window_tier is not None:  # the session's state: the reply's last boundary; the prompt's stays unowned
            tier = engine.window_tier
            (session_key,) = tier._session_key.values()
            assert tier._states[session_key].position == _in_kv(len(conversation)) == 192
            assert sorted(s.position for s in tier._states.values()) == [_in_kv(len(prompt)), 192]
            assert len(tier._owners) == 1
        second = engine.prefill(PrefillRequest(conversation + more, session_id="s", turn=1))
        assert second.path == CACHED and second.exact
        assert second.loaded_tokens == _in_kv(len(conversation))
        _check(tiny, second, conversation + more)


def test_a_replayed_conversation_saves_its_reply_in_the_replayed_chain(tiny_models, daemons):
    gpt_oss = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    tokens = _tokens(700, seed=32)
    with _client(daemon) as client:
        _stored_first_turn(gpt_oss, client, tokens)  # 496 stored tokens, their window lost
        engine = _engine(gpt_oss, client, replay_tokens=R)
        first = engine.prefill(PrefillRequest(tokens[:600], session_id="s"))
        assert first.path == REPLAYED and not first.exact
        (done,) = _decode(engine, [first], 40)
        conversation = tokens[:600] + done.tokens
        turn = conversation + tokens[640:660]
        assert client.lookup(engine.namespace().blocks(turn)) == STORED // BLOCK  # nothing new in the exact chain
        second = engine.prefill(PrefillRequest(turn, session_id="s"))
        assert second.path == CACHED and not second.exact
        assert second.loaded_tokens == _in_kv(len(conversation)) == 624
        assert (second.logits - _replayed_logits(engine, turn, STORED)).abs().max().item() <= 1e-4
        second.kv.release()
        exact = engine.prefill(PrefillRequest(turn, exact=True))  # the reply's blocks are not for it
        assert exact.path == WINDOW_MISSING and exact.stored_tokens == STORED and exact.loaded_tokens == 0
        _check(gpt_oss, exact, turn)


def test_a_preempted_replayed_sequence_recomputes_exactly_into_the_exact_chain(tiny_models, daemons):
    gpt_oss = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    tokens, other = _tokens(700, seed=33), _tokens(100, seed=34)
    with _client(daemon) as client:
        _stored_first_turn(gpt_oss, client, tokens)
        # 46 pages: the two prompts (38 + 7) fit, their replies do not; the younger, replayed one is preempted
        engine = _engine(gpt_oss, client, replay_tokens=R, kv_pages=46)
        older = engine.prefill(PrefillRequest(other))
        first = engine.prefill(PrefillRequest(tokens[:600], session_id="s"))
        assert first.path == REPLAYED
        done_other, done = _decode(engine, [older, first], 40, preempt_to_store=False)
        assert done.preemptions == 1 and done_other.preemptions == 0 and done.resumed_from_store == 0
        conversation = tokens[:600] + done.tokens
        turn = conversation + tokens[640:660]
        # recomputed from scratch, its KV is exact: every full block saved again, in the exact chain
        assert client.lookup(engine.namespace().blocks(turn)) == _in_kv(len(conversation)) // BLOCK
        second = engine.prefill(PrefillRequest(turn, session_id="s", exact=True))
        assert second.path == CACHED and second.exact and second.loaded_tokens == _in_kv(len(conversation))
        _check(gpt_oss, second, turn)
        resumed = engine.prefill(PrefillRequest(other + done_other.tokens + tokens[:10]))
        assert resumed.path == CACHED and resumed.loaded_tokens == _in_kv(len(other) + 40)
        _check(gpt_oss, resumed, other + done_other.tokens + tokens[:10])


def test_a_reply_to_token_ids_is_not_saved(tiny_models, daemons):
    tiny = tiny_models["qwen3"]
    (daemon,) = daemons(1)
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        decode = DecodeEngine(engine.model, engine, DecodeConfig())
        decode.submit(DecodeRequest(_tokens(40, seed=35), SamplingParams(max_tokens=30)))
        decode.run()
        assert client.write_behind.flush()
        assert client.write_behind.counters["queued"] == 0


def test_a_preempted_exact_sequence_goes_on_saving_where_it_was(tiny_models, daemons):
    gpt_oss = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    prompt, other = _tokens(150, seed=36), _tokens(100, seed=37)
    with _client(daemon) as client:
        engine = _engine(gpt_oss, client, kv_pages=18)  # 7 + 10 pages of prompts, then the younger is preempted
        older = engine.prefill(PrefillRequest(other))
        first = engine.prefill(PrefillRequest(prompt, session_id="s"))
        done_other, done = _decode(engine, [older, first], 45, preempt_to_store=False)
        assert done.preemptions == 1 and done_other.preemptions == 0 and done.resumed_from_store == 0
        conversation = prompt + done.tokens
        turn = conversation + other[:30]
        second = engine.prefill(PrefillRequest(turn, session_id="s"))
        assert second.path == CACHED and second.exact and second.loaded_tokens == _in_kv(len(conversation))
        _check(gpt_oss, second, turn)


def test_another_engine_resumes_the_next_turn_exactly_from_the_replys_stored_window(tiny_models, daemons):
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    prompt, more = _tokens(150, seed=36), _tokens(30, seed=37)
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        (done,) = _decode(engine, [engine.prefill(PrefillRequest(prompt, session_id="s"))], 45)
        conversation = prompt + done.tokens
        other = _engine(tiny, client)  # a restarted engine, or another instance: nothing in its window tier
        second = other.prefill(PrefillRequest(conversation + more, session_id="s", turn=1))
        assert (second.path, second.window_source, second.exact) == (CACHED, "store", True)
        assert second.loaded_tokens == _in_kv(len(conversation))  # from the reply's last boundary
        _check(tiny, second, conversation + more)


def test_the_replys_window_record_supersedes_the_prompts(tiny_models, daemons):
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    prompt = _tokens(150, seed=38)
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        result = engine.prefill(PrefillRequest(prompt, session_id="s"))
        client.write_behind.flush()
        at_prompt = window_records.window_record(engine.chain_namespace(result.request), result.blocks[-1])
        assert client.lookup([at_prompt]) == 1
        (done,) = _decode(engine, [result], 45)
        client.write_behind.flush()
        conversation = prompt + done.tokens
        reply_end = engine.namespace().blocks(conversation[:_in_kv(len(conversation))])[-1]
        at_reply = window_records.window_record(engine.namespace(), reply_end)
        assert at_reply.key != at_prompt.key
        assert (client.lookup([at_prompt]), client.lookup([at_reply])) == (0, 1)


def test_the_same_prompt_sent_again_after_its_reply_is_cached(tiny_models, daemons):
    """A retried or regenerated reply: the prompt's window stays in the tier beside the reply's (the store keeps
    the reply's record alone), so the same prompt again resumes from its last boundary, exactly."""
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    prompt = _tokens(150, seed=39)  # its last boundary at 144; the reply's at 192
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        (done,) = _decode(engine, [engine.prefill(PrefillRequest(prompt, session_id="s"))], 45)
        assert _in_kv(len(prompt + done.tokens)) == 192
        again = engine.prefill(PrefillRequest(prompt, session_id="s"))
        assert (again.path, again.window_source, again.exact) == (CACHED, "host", True)
        assert again.loaded_tokens == _in_kv(len(prompt)) == 144
        _check(tiny, again, prompt)
