from __future__ import annotations

import pytest
import torch

from engine.model.config import FULL, SLIDING, ModelConfig
from engine.model.kv import KVCapacityError, PagePool, RequestKV

pytestmark = pytest.mark.unit

CONFIG = ModelConfig("llama", vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                     intermediate_size=8, max_position_embeddings=1000, layer_types=(FULL, SLIDING), sliding_window=5)


def _kv(x: int, start: int) -> torch.Tensor:
    """Recognisable KV: element value = position."""
    return torch.arange(start, start + x, dtype=torch.float32)[:, None, None].expand(x, 1, 4).clone()


def test_pool_hands_out_pages_and_refuses_beyond_capacity():
    pool = PagePool(CONFIG, 4, 8, torch.float32)
    assert pool.layers[0].shape == (4, 2, 8, 1, 4)  # one tensor for the one full layer
    kv = RequestKV(CONFIG, pool)
    kv.reserve(17)  # three pages
    assert len(kv.block_table) == 3 and pool.free_pages == 1
    other = RequestKV(CONFIG, pool)
    with pytest.raises(KVCapacityError, match="need 2 KV pages, 1 of 4 free"):
        other.reserve(9)
    assert pool.free_pages == 1  # a refused reservation takes nothing
    kv.release()
    assert pool.free_pages == 4


def test_full_layer_returns_every_position_in_order():
    kv = RequestKV(CONFIG, PagePool(CONFIG, 8, 4, torch.float32))
    kv.reserve(11)
    kv.full_kv(0, _kv(6, 0), -_kv(6, 0), 0)
    keys, values = kv.full_kv(0, _kv(5, 6), -_kv(5, 6), 6)
    assert keys[:, 0, 0].tolist() == list(range(11))
    assert values[:, 0, 0].tolist() == [-p for p in range(11)]


def test_ring_keeps_only_the_window_and_captures_a_boundary():
    kv = RequestKV(CONFIG, PagePool(CONFIG, 8, 4, torch.float32))
    kv.capture_at = {8, 2}
    keys, _, positions = kv.sliding_kv(0, _kv(6, 0), _kv(6, 0), 0)
    assert positions.tolist() == list(range(6))
    keys, _, positions = kv.sliding_kv(0, _kv(4, 6), _kv(4, 6), 6)
    # the 5 before the chunk (in the ring's slot order: attention masks by position), then the chunk
    assert sorted(positions[:5].tolist()) == [1, 2, 3, 4, 5] and positions[5:].tolist() == [6, 7, 8, 9]
    assert keys[:, 0, 0].tolist() == [float(p) for p in positions]
    assert sorted(kv.rings[0, 0, :, 0, 0].tolist()) == [5.0, 6.0, 7.0, 8.0, 9.0]
    captured = kv.captured[8]
    assert captured.position == 8
    assert sorted(captured.rings[0, 0, :, 0, 0].tolist()) == [3.0, 4.0, 5.0, 6.0, 7.0]  # positions [8-5, 8)
    early = kv.captured[2].rings[0, 0, :, 0, 0].tolist()  # positions [0, 2); the slots of negative ones empty
    assert early[0] == 0.0 and early[1] == 1.0 and early[2:] == [0.0] * 3


def test_rings_take_the_pools_dtype_even_without_full_layers():
    # a model whose every layer slides has no page tensor to take a dtype from: its rings still follow the pool
    only_sliding = ModelConfig("llama", vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                               head_dim=4, intermediate_size=8, max_position_embeddings=1000,
                               layer_types=(SLIDING, SLIDING), sliding_window=5)
    for dtype in (torch.bfloat16, torch.float32):
        kv = RequestKV(only_sliding, PagePool(only_sliding, 4, 8, dtype))
        assert kv.rings is not None and kv.rings.dtype == dtype
