"""A decode step attends for all sequences at once (engine/model/decode_attention.py): the same logits and the same
KV as chunk-by-chunk attention, for sequences of different lengths, before and past the window, after a
replay (a window that starts late), and a step that captures a window goes the general way."""

from __future__ import annotations

import pytest
import torch

from engine.model.decode_attention import DecodeBatch
from engine.model.decoder import Chunk, Decoder
from engine.model.kv import PagePool, RequestKV
from engine.window import begin_replay
from tests.engine.conftest import GEMMA3_WINDOW, VOCAB

pytestmark = pytest.mark.unit
BLOCK = 8
LENGTHS = [3, GEMMA3_WINDOW - 1, GEMMA3_WINDOW, 2 * GEMMA3_WINDOW + 5, 61]  # before, at and past the window


def _prefilled(model: Decoder, pool: PagePool, lengths, replay_at: int | None = None) -> list[RequestKV]:
    kvs = []
    for i, n in enumerate(lengths):
        kv = RequestKV(model.config, pool)
        kv.reserve(n + 1)
        tokens = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(i))
        model.forward([Chunk(kv, tokens, 0)])
        if replay_at is not None and i == len(lengths) - 1:  # the last one's window rebuilt from replay_at
            start = begin_replay(kv, n, n - replay_at)
            model.forward([Chunk(kv, tokens[start:], start)])
        kvs.append(kv)
    return kvs


def _copy(kv: RequestKV, pool: PagePool) -> RequestKV:
    """The same KV state, its pages in `pool` (a copy of kv's pool) and its rings copied."""
    twin = object.__new__(RequestKV)
    twin.__dict__.update(kv.__dict__)
    twin.pool, twin.block_table = pool, list(kv.block_table)
    twin.rings = kv.rings.clone() if kv.rings is not None else None
    twin.capture_at, twin.captured = set(kv.capture_at), {}
    return twin


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_a_batched_decode_step_computes_what_chunk_by_chunk_does(tiny_models, tiny_gemma3, kind, monkeypatch):
    tiny = tiny_gemma3 if kind == "gemma3" else tiny_models[kind]
    model = Decoder.from_pretrained(tiny.path, torch.float32)
    pool = PagePool(model.config, 64, BLOCK, model.dtype)
    kvs = _prefilled(model, pool, LENGTHS, replay_at=LENGTHS[-1] - 5 if model.config.sliding_layers else None)
    general_pool = PagePool(model.config, 64, BLOCK, model.dtype)
    for mine, theirs in zip(pool.layers, general_pool.layers):
        theirs.copy_(mine)
    twins = [_copy(kv, general_pool) for kv in kvs]
    new = torch.randint(0, VOCAB, (len(kvs),), generator=torch.Generator().manual_seed(9))
    starts = [kv.length for kv in kvs]
    assert DecodeBatch.applies(kvs, [1] * len(kvs), starts)
    batched = model.forward([Chunk(kv, new[i : i + 1], s) for i, (kv, s) in enumerate(zip(kvs, starts))])
    monkeypatch.setattr(model, "_sinks", True)  # forces chunk-by-chunk attention
    general = model.forward([Chunk(kv, new[i : i + 1], s) for i, (kv, s) in enumerate(zip(twins, starts))])
    for a, b in zip(batched, general):
        assert (a - b).abs().max().item() < 1e-5
    # the new tokens' KV written alike (to rounding: a layer's input carries the earlier layers' attention)
    for mine, theirs in zip(pool.layers, general_pool.layers):
        assert (mine - theirs).abs().max().item() < 1e-5
    for kv, twin in zip(kvs, twins):
        if kv.rings is not None:
            assert (kv.rings - twin.rings).abs().max().item() < 1e-5


def test_steps_the_batched_path_does_not_take(tiny_gemma3):
    model = Decoder.from_pretrained(tiny_gemma3.path, torch.float32)
    pool = PagePool(model.config, 16, BLOCK, model.dtype)
    a, b = _prefilled(model, pool, [5, 7])
    assert DecodeBatch.applies([a, b], [1, 1], [5, 7])
    assert not DecodeBatch.applies([a, b], [2, 1], [5, 7])  # a chunk of two tokens
    a.capture_at = {6}
    assert not DecodeBatch.applies([a, b], [1, 1], [5, 7])  # a window to capture in this step
    a.capture_at = set()
    other = RequestKV(model.config, PagePool(model.config, 4, BLOCK, model.dtype))
    assert not DecodeBatch.applies([a, other], [1, 1], [5, 0])  # two pools
    assert not DecodeBatch.applies([a, b], [1, 1], [5, 3 * BLOCK])  # no page reserved for b's token: never
    #                                                                 written into page 0, another request's
