"""Loads into paged torch KV: in place on the CPU; through pinned staging and a copy stream on CUDA."""


import pytest
import torch

from kvstore.block import KVLayout, Namespace
from kvstore.client import KVClient
from kvstore.client.torch_kv import PagedKV

pytestmark = pytest.mark.integration

LAYOUT = KVLayout(num_layers=3, kv_heads=2, head_dim=16, dtype="bfloat16")
NS = Namespace("paged", LAYOUT, block_tokens=8)
PAGE = (2, 8, 2, 16)  # (K/V, block_tokens, kv_heads, head_dim)


def saved_blocks(n: int):
    """Blocks whose payload is real bf16 KV, layer-major: (layers, *PAGE) per block."""
    items, tensors = [], []
    for block in NS.blocks(range(8 * n)):
        kv = torch.randn((LAYOUT.num_layers, *PAGE)).to(torch.bfloat16)  # (layers, 2, tokens, heads, dim)
        items.append((block, kv.view(-1).view(torch.uint8).numpy().tobytes()))
        tensors.append(kv)
    return items, tensors


def load_into_pages(daemon, device: str, per_layer: bool = False):
    items, expected = saved_blocks(4)
    # (pages, 2, tokens, heads, dim) per layer, poisoned; the prefix goes to pages 5, 1, 7, 3, or to each
    # layer's own pages (an engine whose layers keep their pages apart, as vLLM's KV cache groups do)
    layers = [torch.full((8, *PAGE), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(3)]
    tables = [[5, 1, 7, 3], [0, 2, 4, 6], [6, 4, 2, 0]] if per_layer else [[5, 1, 7, 3]] * 3
    with KVClient([daemon.address]) as client:
        client.put(items, LAYOUT.num_layers)
        destination = PagedKV(layers, tables if per_layer else tables[0])
        assert destination.layer_bytes == NS.layer_bytes
        handle = client.load([b for b, _ in items], destination)
        for layer in range(3):
            handle.wait_layer(layer, timeout=10)
            for i, page in enumerate(tables[layer]):  # on the compute stream, after wait_layer
                assert torch.equal(layers[layer][page].cpu(), expected[i][layer]), (layer, i)
        assert handle.wait(timeout=10) == 4 * 8
    for layer in range(3):
        untouched = [p for p in range(8) if p not in tables[layer]]
        assert all(torch.isnan(layers[layer][p].float()).all() for p in untouched), "no write outside the table"


@pytest.mark.parametrize("per_layer", [False, True], ids=["one-table", "a-table-per-layer"])
def test_paged_cpu_tensors_are_written_in_place(daemons, per_layer):
    load_into_pages(daemons(1)[0], "cpu", per_layer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("per_layer", [False, True], ids=["one-table", "a-table-per-layer"])
def test_paged_cuda_tensors_via_pinned_staging_and_a_copy_stream(daemons, per_layer):
    load_into_pages(daemons(1)[0], "cuda", per_layer)


def test_bad_paged_layouts():
    layer = torch.zeros((4, *PAGE), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside"):
        PagedKV([layer], [4])
    with pytest.raises(ValueError, match="same shape"):
        PagedKV([layer, torch.zeros((3, *PAGE), dtype=torch.bfloat16)], [0])
    with pytest.raises(ValueError, match="contiguous"):
        PagedKV([layer.transpose(1, 2)], [0])
    with pytest.raises(ValueError, match="one per layer"):
        PagedKV([layer, layer], [[0, 1], [2]])
    with pytest.raises(ValueError, match="one per layer"):
        PagedKV([layer, layer], [[0, 1]])
    with pytest.raises(ValueError, match="outside"):
        PagedKV([layer, layer], [[0], [4]])
