"""Prefill -> decode across processes through the store (engine/prefill/handoff.py): the prefill side saves a
prompt's continuation record, and an engine with its own client, pool and window tier continues from it
computing only the last token; where the record is gone or corrupt it falls back and says so."""

from __future__ import annotations

import pytest
import torch

from engine.model.decoder import Chunk
from engine.model.kv import WindowState
from engine.prefill import handoff
from engine.prefill.request import CACHED, COLD, HANDED_OVER, REPLAYED, PrefillRequest
from tests.engine.prefill.test_engine import BLOCK, TOLERANCE, _client, _engine, _tokens

pytestmark = pytest.mark.integration


def _hand_off(tiny, daemon, tokens: list[int], **request) -> None:
    """Another process's prefill: its own client and engine, gone once the state is in the store."""
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        result = engine.prefill(PrefillRequest(tokens, hand_off=True, **request))
        assert result.handed_off
        assert engine.flush(10)
        result.kv.release()


# a prompt shorter than a block; ending one past a block boundary (no partial block: the record holds
# the last token only); ending on one (the last token completes a block); and past the tiny gpt-oss
# window of 128 with a partial block
@pytest.mark.parametrize("length", [7, 3 * BLOCK + 1, 4 * BLOCK, 150])
def test_a_handed_over_prompt_continues_from_its_last_token(tiny, daemons, length):
    (daemon,) = daemons(1)
    tokens = _tokens(length, seed=length)
    _hand_off(tiny, daemon, tokens)
    with _client(daemon) as client:
        engine = _engine(tiny, client)  # a fresh window tier: only the record can give the window
        result = engine.prefill(PrefillRequest(tokens, from_handoff=True))
        assert result.path == HANDED_OVER and result.exact
        assert result.loaded_tokens == (length - 1) // BLOCK * BLOCK
        reference = tiny.logits(tokens)[-1]
        assert (result.logits - reference).abs().max().item() <= TOLERANCE
        # the continued KV is whole: one more token on it is the reference's next position
        (after,) = engine.model.forward([_chunk(result.kv, 123, length)])
        assert (after - tiny.logits([*tokens, 123])[-1]).abs().max().item() <= TOLERANCE
        result.kv.release()


def test_without_a_record_the_decode_side_falls_back_and_says_so(tiny, daemons):
    (daemon,) = daemons(1)
    tokens = _tokens(200, seed=5)
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        cold = engine.prefill(PrefillRequest(tokens, from_handoff=True))
        assert cold.path == COLD
        cold.kv.release()
        assert engine.flush(10)  # its blocks are stored now, but no continuation record
        other = _engine(tiny, client)
        result = other.prefill(PrefillRequest(tokens, from_handoff=True))
        # both load the blocks; a hybrid one takes the window from the window record the first engine saved
        assert result.path == CACHED
        assert result.window_source == ("store" if tiny.kind == "gpt_oss" else None)
        assert (result.logits - tiny.logits(tokens)[-1]).abs().max().item() <= TOLERANCE
        result.kv.release()


def test_a_corrupt_record_is_a_fallback_not_wrong_kv(tiny, daemons):
    (daemon,) = daemons(1)
    tokens = _tokens(100, seed=6)
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        space = engine.namespace()
        found = handoff.continuation(space, tokens)
        engine.prefill(PrefillRequest(tokens)).kv.release()  # the blocks, no record
        assert engine.flush(10)
        # a well-formed record of the wrong position: verified by the store, refused by the engine
        assert client.put([(found.record, b"KVH1" + bytes(12) + bytes(64))], 1, handoff.HANDOFF_CLASS).stored == 1
        result = _engine(tiny, client).prefill(PrefillRequest(tokens, from_handoff=True))
        assert result.path != HANDED_OVER
        assert (result.logits - tiny.logits(tokens)[-1]).abs().max().item() <= TOLERANCE
        result.kv.release()


def test_a_replayed_window_under_an_exact_chains_key_is_refused(tiny_models, daemons):
    """A record in the exact chain that claims a window starting late (what only a replay leaves) is a
    lie or a bug: the exact request falls back rather than continue an approximate state."""
    gpt_oss = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    tokens = _tokens(30, seed=9)
    with _client(daemon) as client:
        engine = _engine(gpt_oss, client)
        found = handoff.continuation(engine.namespace(), tokens)
        kv = engine.prefill(PrefillRequest(tokens[:-1])).kv  # the honest state of the first 29 tokens ...
        kv.window_from = 20  # ... dressed up as a replay that began at 20
        window = WindowState(29, kv.rings.clone(), kv.window_from)
        assert client.put([(found.record, handoff.encode(kv, 29, window))], 1, handoff.HANDOFF_CLASS).stored == 1
        kv.release()
        result = engine.prefill(PrefillRequest(tokens, from_handoff=True, exact=True))
        assert result.path != HANDED_OVER and result.exact and result.kv.window_from == 0
        assert (result.logits - gpt_oss.logits(tokens)[-1]).abs().max().item() <= TOLERANCE
        result.kv.release()


def test_a_record_is_scoped_to_its_prompt_and_tenant(tiny, daemons):
    (daemon,) = daemons(1)
    tokens = _tokens(90, seed=7)
    _hand_off(tiny, daemon, tokens, salt="alice")
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        for request in (PrefillRequest(tokens, from_handoff=True, salt="bob"),  # another tenant
                        PrefillRequest([*tokens[:-1], (tokens[-1] + 1) % 100], from_handoff=True, salt="alice")):
            result = engine.prefill(request)
            assert result.path != HANDED_OVER
            result.kv.release()
        result = engine.prefill(PrefillRequest(tokens, from_handoff=True, salt="alice"))
        assert result.path == HANDED_OVER
        result.kv.release()


def test_an_exact_request_never_continues_a_replayed_state(tiny_models, daemons):
    """A replayed prefill hands off on the replayed chain; the decode side takes it unless it must be exact."""
    gpt_oss = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    conversation = _tokens(600, seed=8)
    with _client(daemon) as client:  # the first turn, stored by an engine whose window tier is then gone
        _engine(gpt_oss, client, store_windows=False).prefill(PrefillRequest(conversation[:500])).kv.release()
        assert client.write_behind.flush(10)
        prefill = _engine(gpt_oss, client, replay_tokens=128)
        result = prefill.prefill(PrefillRequest(conversation, hand_off=True))
        assert result.path == REPLAYED and not result.exact and result.handed_off
        assert prefill.flush(10)
        result.kv.release()
        decode = _engine(gpt_oss, client)
        approximate = decode.prefill(PrefillRequest(conversation, from_handoff=True))
        assert approximate.path == HANDED_OVER and not approximate.exact
        assert (approximate.logits - result.logits).abs().max().item() <= TOLERANCE  # the replayed state itself
        approximate.kv.release()
        exact = decode.prefill(PrefillRequest(conversation, from_handoff=True, exact=True))
        assert exact.path != HANDED_OVER and exact.exact
        assert (exact.logits - gpt_oss.logits(conversation)[-1]).abs().max().item() <= TOLERANCE
        exact.kv.release()


def _chunk(kv, token: int, start: int) -> Chunk:
    kv.reserve(start + 1)
    return Chunk(kv, torch.tensor([token]), start)
