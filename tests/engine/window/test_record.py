"""Window records: identity that no other record shares, and a payload that is the window or a miss."""

from __future__ import annotations

import pytest
import torch

from engine.model.kv import WindowState
from engine.prefill import handoff
from engine.window import record
from kvstore.block import KVLayout, Namespace

pytestmark = pytest.mark.unit

W = 8
LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=4, dtype="float32")


def _state(position: int, window_from: int = 0) -> WindowState:
    rings = torch.randn(3, 2, W, 1, 4, generator=torch.Generator().manual_seed(position))  # (n_sliding, 2, W, ...)
    return WindowState(position, rings, window_from)


@pytest.mark.parametrize("position, window_from", [(16, 0), (5, 0), (20, 14)])
def test_a_window_round_trips_to_the_positions_it_holds(position, window_from):
    state = _state(position, window_from)
    back, session = record.decode(record.encode(state, 7), position, state.rings, exact=False)
    assert session == 7
    w = min(W, position - window_from)
    slots = torch.arange(position - w, position) % W
    assert back.position == position and back.window_from == window_from
    assert torch.equal(back.rings[:, :, slots], state.rings[:, :, slots])
    rest = back.rings.clone()
    rest[:, :, slots] = 0
    assert not rest.any()  # nothing but those positions


def test_the_payload_is_the_window_and_a_prelude():
    assert len(record.encode(_state(16))) == 40 + 3 * 2 * W * 1 * 4 * 4
    assert len(record.encode(_state(5))) == 40 + 3 * 2 * 5 * 1 * 4 * 4  # a window not yet full


def test_session_tags_tell_sessions_and_tenants_apart_and_none_is_zero():
    tags = {record.session_tag(s) for s in ("aa/chat-1", "aa/chat-2", "bb/chat-1")}
    assert len(tags) == 3 and 0 not in tags
    assert record.session_tag(None) == 0 and record.session_tag("aa/chat-1") == record.session_tag("aa/chat-1")


@pytest.mark.parametrize("payload, position, exact, cause", [
    (b"KVW", 16, True, "format"),
    (b"KVH1" + record.encode(_state(16))[4:], 16, True, "format"),
    (record.encode(_state(16))[:4] + b"\x02\x00" + record.encode(_state(16))[6:], 16, True, "format"),  # version 2
    (record.encode(_state(16)), 17, True, "position"),
    (record.encode(_state(16))[:-4], 16, True, "shape"),
    # as many bytes, another geometry: two KV heads of 2 where this model has one of 4
    (record.encode(WindowState(16, _state(16).rings.reshape(3, 2, W, 2, 2))), 16, True, "shape"),
    (record.encode(_state(20, 14)), 20, True, "replayed"),
])
def test_a_payload_that_is_not_the_window_is_refused_with_its_cause(payload, position, exact, cause):
    with pytest.raises(record.CorruptWindow) as refused:
        record.decode(payload, position, _state(16).rings, exact)
    assert refused.value.cause == cause


def test_a_window_record_is_no_block_nor_continuation_and_is_per_tenant_and_chain():
    chain = Namespace("model@1", LAYOUT, 4, "alice")
    blocks = chain.blocks(list(range(12)))
    ours = record.window_record(chain, blocks[1])
    assert ours == record.window_record(chain, blocks[1])  # found again by whoever looks it up
    others = {
        "a block": blocks[2].key,
        "the continuation of the same prefix": handoff.continuation(chain, list(range(9))).record.key,
        "another boundary": record.window_record(chain, blocks[2]).key,
        "another tenant": record.window_record(Namespace("model@1", LAYOUT, 4, "bob"),
                                               Namespace("model@1", LAYOUT, 4, "bob").blocks(list(range(12)))[1]).key,
        "the replayed chain": record.window_record(chain.with_model_id("model@1#replayed"),
                                                   chain.with_model_id("model@1#replayed").blocks(range(12))[1]).key,
    }
    assert all(key != ours.key for key in others.values()), others
    assert ours.namespace != chain.digest and ours.tenant == chain.tenant


def test_a_window_in_another_dtype_of_the_same_width_is_refused():
    rings = _state(16).rings
    with pytest.raises(record.CorruptWindow) as refused:
        record.decode(record.encode(WindowState(16, rings.half())), 16, rings.bfloat16(), exact=True)
    assert refused.value.cause == "shape"
    back, _ = record.decode(record.encode(WindowState(16, rings.bfloat16())), 16, rings.bfloat16(), exact=True)
    assert torch.equal(back.rings, rings.bfloat16())


@pytest.mark.parametrize("codec", ["zstd", "int8", "int4"])
@pytest.mark.parametrize("position, window_from", [(16, 0), (5, 0), (20, 14), (14, 14)])
def test_an_encoded_window_round_trips_within_its_codec(codec, position, window_from):
    """Version 4: the sliding layers encoded as blocks are; zstd gives every bit back, int8 and int4 stay within
    their steps; an empty window (w = 0) holds no layer bytes at all."""
    state = _state(position, window_from)
    payload = record.encode(state, 3, codec)
    back, session = record.decode(payload, position, state.rings, exact=False, codec=codec)
    w = min(W, position - window_from)
    slots = torch.arange(position - w, position) % W
    want, got = state.rings[:, :, slots], back.rings[:, :, slots]
    bound = {"zstd": 0.0, "int8": 0.01, "int4": 0.12}[codec]
    assert session == 3 and back.window_from == window_from
    assert (got - want).norm() <= bound * want.norm()
    assert not back.rings.index_fill(2, slots, 0).any()


def test_a_window_of_another_codec_is_a_codec_miss_and_broken_layers_too():
    state = _state(16)
    encoded = record.encode(state, 0, "int8")
    for payload, codec in ((encoded, "raw"), (record.encode(state), "int8"), (encoded, "zstd"),
                           (encoded[:-3], "int8"), (encoded[:50] + bytes(len(encoded) - 50), "int8")):
        with pytest.raises(record.CorruptWindow) as refused:
            record.decode(payload, 16, state.rings, exact=True, codec=codec)
        assert refused.value.cause == "codec"
