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


def load_into_pages(daemon, device: str):
    items, expected = saved_blocks(4)
    # (pages, 2, tokens, heads, dim) per layer, poisoned; the prefix goes to pages 5, 1, 7, 3
    layers = [torch.full((8, *PAGE), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(3)]
    table = [5, 1, 7, 3]
    with KVClient([daemon.address]) as client:
        client.put(items, LAYOUT.num_layers)
        destination = PagedKV(layers, table)
        assert destination.layer_bytes == NS.layer_bytes
        handle = client.load([b for b, _ in items], destination)
        for layer in range(3):
            handle.wait_layer(layer, timeout=10)
            for i, page in enumerate(table):  # on the compute stream, after wait_layer
                assert torch.equal(layers[layer][page].cpu(), expected[i][layer]), (layer, i)
        assert handle.wait(timeout=10) == 4 * 8
    untouched = [p for p in range(8) if p not in table]
    assert all(torch.isnan(layers[0][p].float()).all() for p in untouched), "no write outside the table"


def test_paged_cpu_tensors_are_written_in_place(daemons):
    load_into_pages(daemons(1)[0], "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paged_cuda_tensors_via_pinned_staging_and_a_copy_stream(daemons):
    load_into_pages(daemons(1)[0], "cuda")


def test_bad_paged_layouts():
    layer = torch.zeros((4, *PAGE), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside"):
        PagedKV([layer], [4])
    with pytest.raises(ValueError, match="same shape"):
        PagedKV([layer, torch.zeros((3, *PAGE), dtype=torch.bfloat16)], [0])
    with pytest.raises(ValueError, match="contiguous"):
        PagedKV([layer.transpose(1, 2)], [0])
