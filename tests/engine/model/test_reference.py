"""Our decoder against the transformers implementation of the same architecture and weights."""

from __future__ import annotations

import pytest
import torch

from engine.model.decoder import Chunk, Decoder
from engine.model.kv import PagePool, RequestKV
from tests.engine.conftest import VOCAB, WINDOW

pytestmark = pytest.mark.unit
TOLERANCE = 1e-4  # max abs logit difference in fp32


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: Decoder, tokens: list[int], cuts: list[int]) -> torch.Tensor:
    """All-position logits (n, vocab), computed in chunks ending at `cuts`."""
    kv = RequestKV(model.config, PagePool(model.config, 64, 16, torch.float32))
    kv.reserve(len(tokens))
    out, start = [], 0
    for end in [*cuts, len(tokens)]:
        chunk = torch.tensor(tokens[start:end])
        out.append(model.forward([Chunk(kv, chunk, start)], all_logits=True)[0])
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("length", [50, WINDOW, 300])  # shorter than, equal to and longer than the window
def test_logits_match_transformers(tiny, length):
    model = Decoder.from_pretrained(tiny.path, torch.float32)
    tokens = _prompt(length, length)
    reference = tiny.logits(tokens)
    assert reference.std() > 0.5  # logits spread widely enough for the tolerance to mean something
    ours = _run(model, tokens, [])
    assert (ours - reference).abs().max().item() <= TOLERANCE


def test_chunked_prefill_matches_transformers(tiny):
    # chunks that straddle the window and block boundaries, one of a single token
    model = Decoder.from_pretrained(tiny.path, torch.float32)
    tokens = _prompt(300, 7)
    ours = _run(model, tokens, [1, 37, 128, 129, 250])
    assert (ours - tiny.logits(tokens)).abs().max().item() <= TOLERANCE


def test_one_step_of_several_requests_matches_each_alone(tiny):
    model = Decoder.from_pretrained(tiny.path, torch.float32)
    prompts = [_prompt(n, n) for n in (20, 140, 65)]
    pool = PagePool(model.config, 64, 16, torch.float32)
    kvs = [RequestKV(model.config, pool) for _ in prompts]
    for kv, prompt in zip(kvs, prompts):
        kv.reserve(len(prompt))
    last = model.forward([Chunk(kv, torch.tensor(p), 0) for kv, p in zip(kvs, prompts)])
    for logits, prompt in zip(last, prompts):
        assert (logits - tiny.logits(prompt)[-1]).abs().max().item() <= TOLERANCE


def test_a_wrong_window_is_caught(tiny_models):
    # the reference check can fail: one position more in the window changes logits beyond the tolerance
    tiny = tiny_models["gpt_oss"]
    model = Decoder.from_pretrained(tiny.path, torch.float32)
    from dataclasses import replace
    model.config = replace(model.config, sliding_window=WINDOW + 1)
    tokens = _prompt(300, 3)
    kv = RequestKV(model.config, PagePool(model.config, 64, 16, torch.float32))
    kv.reserve(300)
    ours = model.forward([Chunk(kv, torch.tensor(tokens), 0)], all_logits=True)[0]
    assert (ours - tiny.logits(tokens)).abs().max().item() > 100 * TOLERANCE


def test_bfloat16_runs_close_to_fp32(tiny):
    model = Decoder.from_pretrained(tiny.path, dtype=torch.bfloat16)
    tokens = _prompt(140, 5)
    kv = RequestKV(model.config, PagePool(model.config, 64, 16, torch.bfloat16))
    kv.reserve(len(tokens))
    (ours,) = model.forward([Chunk(kv, torch.tensor(tokens), 0)])
    reference = tiny.logits(tokens)[-1]
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - reference).abs().max().item() < 0.1 * reference.abs().max().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_transformers(tiny):
    model = Decoder.from_pretrained(tiny.path, torch.float32, device="cuda")
    tokens = _prompt(300, 11)
    kv = RequestKV(model.config, PagePool(model.config, 64, 16, torch.float32, device="cuda"))
    kv.reserve(len(tokens))
    ours = model.forward([Chunk(kv, torch.tensor(tokens), 0)], all_logits=True)[0].cpu()
    assert (ours - tiny.logits(tokens)).abs().max().item() <= TOLERANCE
