"""Bounded replay in the prefill engine: when a resumed prompt's window state is gone, the engine loads
the stored prefix and replays its last R tokens (path "replayed"), keeps approximate KV out of the exact
chain, and never replays a request or tenant that asks for exact continuation."""

from __future__ import annotations

import pytest
import torch

from engine.model.decoder import Chunk
from engine.model.kv import PagePool, RequestKV
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import CACHED, LOAD_FAILED, REPLAYED, WINDOW_MISSING, PrefillRequest
from engine.window import begin_replay
from tests.engine.prefill.test_engine import BLOCK, _check, _client, _engine, _tokens

pytestmark = pytest.mark.integration
R = 128  # the tiny gpt-oss model's window, DeepSeek-V4's setting
STORED = 496  # the first turn's full blocks: 31 of 16 tokens
TURNS = [500, 600, 700]


@pytest.fixture
def gpt_oss(tiny_models):
    return tiny_models["gpt_oss"]


def _replay_engine(tiny, client, **overrides) -> PrefillEngine:
    """An engine that replays where a window is gone: and windows are gone, here, from the store too (as
    once their records expire), so that each turn of these tests meets the case replay is for."""
    return _engine(tiny, client, replay_tokens=R, store_windows=False, **overrides)


def _stored_first_turn(tiny, client, conversation) -> None:
    """The first turn prefilled by another engine: the store holds its blocks, no window tier here has its state,
    and its window record has expired."""
    first = _engine(tiny, client, store_windows=False)
    first.prefill(PrefillRequest(conversation[:TURNS[0]], session_id="s")).kv.release()
    assert client.write_behind.flush()


def _replayed_logits(engine: PrefillEngine, tokens: list[int], prefix: int) -> torch.Tensor:
    """What a replay at `prefix` gives, computed on the bare model: the prefix's full-layer KV computed
    cold (as the store holds it), then the last R tokens of the prefix and the rest."""
    model = engine.model
    kv = RequestKV(model.config, PagePool(model.config, 64, BLOCK, model.dtype))
    kv.reserve(len(tokens))
    model.forward([Chunk(kv, torch.tensor(tokens[:prefix]), 0)])
    start = begin_replay(kv, prefix, R)
    (logits,) = model.forward([Chunk(kv, torch.tensor(tokens[start:]), start)])
    return logits


def test_a_lost_window_is_replayed_from_the_stored_prefix(gpt_oss, daemons):
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[1], seed=20)
    with _client(daemon) as client:
        _stored_first_turn(gpt_oss, client, conversation)
        engine = _replay_engine(gpt_oss, client)
        result = engine.prefill(PrefillRequest(conversation, session_id="s"))
        assert result.path == REPLAYED and not result.exact
        assert result.loaded_tokens == STORED and result.replayed_tokens == R
        expected = _replayed_logits(engine, conversation, STORED)
        assert (result.logits - expected).abs().max().item() <= 1e-4
        result.kv.release()


def test_the_replayed_conversation_goes_on_from_its_own_chain(gpt_oss, daemons):
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[2], seed=21)
    with _client(daemon) as client:
        _stored_first_turn(gpt_oss, client, conversation)
        engine = _replay_engine(gpt_oss, client)
        engine.prefill(PrefillRequest(conversation[:TURNS[1]], session_id="s")).kv.release()
        assert client.write_behind.flush()
        # the next turn finds the replayed chain and the window state the replay left: it resumes there
        after = engine.prefill(PrefillRequest(conversation, session_id="s"))
        assert after.path == CACHED and not after.exact
        assert after.loaded_tokens == TURNS[1] // BLOCK * BLOCK and after.replayed_tokens == 0
        after.kv.release()
        assert client.write_behind.flush()
        # with the window tier lost, it replays again, from the replayed chain's longer prefix
        fresh = _replay_engine(gpt_oss, client)
        again = fresh.prefill(PrefillRequest(conversation, session_id="s"))
        assert again.path == REPLAYED and again.stored_tokens == len(after.blocks) * BLOCK  # what `after` saved
        again.kv.release()


def test_exact_requests_never_see_a_replay(gpt_oss, daemons):
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[2], seed=22)
    with _client(daemon) as client:
        _stored_first_turn(gpt_oss, client, conversation)
        engine = _replay_engine(gpt_oss, client)
        engine.prefill(PrefillRequest(conversation[:TURNS[1]], session_id="s")).kv.release()  # replayed
        assert client.write_behind.flush()
        # the exact chain holds only the first turn, with no window state: recomputed exactly
        exact = engine.prefill(PrefillRequest(conversation, exact=True))
        assert exact.path == WINDOW_MISSING and exact.exact and exact.stored_tokens == STORED
        _check(gpt_oss, exact, conversation)


def test_a_tenant_configured_exact_is_never_replayed(gpt_oss, daemons):
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[1], seed=23)
    with _client(daemon) as client:
        first = _engine(gpt_oss, client, store_windows=False)
        first.prefill(PrefillRequest(conversation[:TURNS[0]], salt="bank")).kv.release()
        assert client.write_behind.flush()
        tenant = first.namespace("bank").tenant.hex()
        engine = _replay_engine(gpt_oss, client, exact_tenants=frozenset({tenant}))
        result = engine.prefill(PrefillRequest(conversation, salt="bank"))
        assert result.path == WINDOW_MISSING and result.exact
        _check(gpt_oss, result, conversation)
        other = _replay_engine(gpt_oss, client)  # the same tenant where it is not configured exact: replayed
        replayed = other.prefill(PrefillRequest(conversation, salt="bank"))
        assert replayed.path == REPLAYED
        replayed.kv.release()


def test_a_short_prefix_is_recomputed_rather_than_replayed(gpt_oss, daemons):
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[1], seed=24)
    with _client(daemon) as client:
        _stored_first_turn(gpt_oss, client, conversation)
        engine = _engine(gpt_oss, client, store_windows=False, replay_tokens=STORED // 2 + 1)  # the prefix is under 2 R
        result = engine.prefill(PrefillRequest(conversation))
        assert result.path == WINDOW_MISSING
        _check(gpt_oss, result, conversation)
        never = _engine(gpt_oss, client, store_windows=False, replay_tokens=0)
        assert never.prefill(PrefillRequest(conversation)).path == WINDOW_MISSING


def test_a_failed_load_under_replay_recomputes_exactly(gpt_oss, daemons):
    from tests.kvstore.client.test_load import corrupt_on_disk

    (daemon,) = daemons(1, "--hot-tier-bytes", "0")
    conversation = _tokens(TURNS[1], seed=25)
    with _client(daemon) as client:
        _stored_first_turn(gpt_oss, client, conversation)
        engine = _replay_engine(gpt_oss, client)
    daemon.stop()
    corrupt_on_disk(daemon.data_dir, engine.namespace().blocks(conversation)[5].key, layer_index=0)
    daemon.start()
    with _client(daemon) as client:
        engine.client = client
        result = engine.prefill(PrefillRequest(conversation))
        assert result.path == LOAD_FAILED and result.loaded_tokens == 0 and result.replayed_tokens == 0
        assert result.exact
        _check(gpt_oss, result, conversation)


def test_a_dense_model_never_replays(tiny_models, daemons):
    tiny = tiny_models["qwen3"]
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[1], seed=26)
    with _client(daemon) as client:
        _stored_first_turn(tiny, client, conversation)
        result = _replay_engine(tiny, client).prefill(PrefillRequest(conversation))
        assert result.path == CACHED and result.replayed_tokens == 0 and result.exact
        _check(tiny, result, conversation)


# -- from the hostile review ------------------------------------------------------------------------


def test_a_failed_load_under_a_short_replay_leaves_no_replayed_window_for_exact_requests(gpt_oss, daemons):
    from tests.kvstore.client.test_load import corrupt_on_disk

    (daemon,) = daemons(1, "--hot-tier-bytes", "0")
    conversation = _tokens(TURNS[2], seed=27)
    with _client(daemon) as client:
        _stored_first_turn(gpt_oss, client, conversation)
        # R < W: a replayed window starts late
        engine = _engine(gpt_oss, client, store_windows=False, replay_tokens=R // 2)
    daemon.stop()
    corrupt_on_disk(daemon.data_dir, engine.namespace().blocks(conversation)[5].key, layer_index=0)
    daemon.start()
    with _client(daemon) as client:
        engine.client = client
        failed = engine.prefill(PrefillRequest(conversation[:TURNS[0] + 10], session_id="s"))
        assert failed.path == LOAD_FAILED and failed.exact
        failed.kv.release()
        assert client.write_behind.flush()
        assert all(state.window_from == 0 for state in engine.window_tier._states.values())
        exact = engine.prefill(PrefillRequest(conversation[:TURNS[1]], exact=True))
        assert exact.path == CACHED and exact.exact  # from the window the exact recompute kept
        _check(gpt_oss, exact, conversation[:TURNS[1]])


def test_another_tenants_session_of_the_same_name_does_not_evict_ones_window(gpt_oss, daemons):
    (daemon,) = daemons(1)
    alice, bob = _tokens(TURNS[1], seed=28), _tokens(TURNS[1], seed=29)
    with _client(daemon) as client:
        engine = _replay_engine(gpt_oss, client)
        engine.prefill(PrefillRequest(alice[:TURNS[0]], salt="alice", session_id="chat")).kv.release()
        engine.prefill(PrefillRequest(bob[:TURNS[0]], salt="bob", session_id="chat")).kv.release()
        assert client.write_behind.flush()
        again = engine.prefill(PrefillRequest(alice, salt="alice", session_id="chat"))
        assert again.path == CACHED and again.exact
        _check(gpt_oss, again, alice)


def test_a_turn_without_a_new_block_resumes_from_the_replayed_window(gpt_oss, daemons):
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[1], seed=30)
    with _client(daemon) as client:
        _stored_first_turn(gpt_oss, client, conversation)
        engine = _replay_engine(gpt_oss, client)
        first = engine.prefill(PrefillRequest(conversation[:STORED + 1], session_id="s"))
        assert first.path == REPLAYED
        first.kv.release()
        assert client.write_behind.flush()
        # both chains now hold the same 31 blocks; only the replayed one has a window kept at their end
        again = engine.prefill(PrefillRequest(conversation[:STORED + 10], session_id="s"))
        assert again.path == CACHED and not again.exact and again.replayed_tokens == 0
        again.kv.release()


def test_a_namespace_altered_after_it_was_built_is_refused(gpt_oss):
    from engine.prefill.request import PrefillError
    from engine.window.replay import REPLAYED_SUFFIX

    engine = _engine(gpt_oss, None)
    forged = engine.namespace().with_model_id(engine.model_id + REPLAYED_SUFFIX)
    forged.model_id = engine.model_id  # the replayed chain's digest under the exact chain's name
    with pytest.raises(PrefillError, match="does not match this model"):
        engine.submit(PrefillRequest(_tokens(40), namespace=forged, exact=True))
    with pytest.raises(ValueError, match="may not end in"):
        PrefillEngine(engine.model, None, engine.config, engine.model_id + REPLAYED_SUFFIX)


@pytest.mark.parametrize("overrides, message", [
    ({"replay_tokens": 64.0}, "replay_tokens must be an integer"),
    ({"replay_tokens": -1}, "replay_tokens must be an integer"),
    ({"replay_min_prefix_factor": 0.5}, "replay_min_prefix_factor"),
    ({"exact_tenants": ["0" * 32]}, "must be a set"),
    ({"exact_tenants": {b"0" * 32}}, "not a tenant digest"),
    ({"exact_tenants": {"bank"}}, "not a tenant digest"),
])
def test_bad_replay_settings_are_refused(overrides, message):
    from engine.prefill.config import PrefillConfig

    with pytest.raises(ValueError, match=message):
        PrefillConfig(**overrides)


def test_exact_must_be_a_bool(gpt_oss):
    from engine.prefill.request import PrefillError

    engine = _engine(gpt_oss, None)
    with pytest.raises(PrefillError, match="exact must be True or False"):
        engine.submit(PrefillRequest(_tokens(40), exact=torch.tensor([True, False])))
