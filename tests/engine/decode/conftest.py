"""The three tiny families as Decoders, their reference greedy replies, and a driver for staggered joins."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from engine.decode import DecodeEngine, DecodeRequest, DecodeResult
from engine.model.decoder import Decoder
from tests.engine.conftest import VOCAB, TinyModel

REPLY = 40  # greedy tokens compared
# prompt lengths per family: short, and across the sliding window (128 for gpt_oss, 16 for gemma3) before
# or during the reply
PROMPT_LENGTHS = {"qwen3": (5, 37, 100), "gpt_oss": (5, 100, 130), "gemma3": (5, 12, 30)}


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Family:
    """A tiny model as the engine's Decoder beside its transformers reference, with generate's replies cached."""

    def __init__(self, tiny: TinyModel) -> None:
        self.kind, self.tiny = tiny.kind, tiny
        self.model = Decoder.from_pretrained(tiny.path, torch.float32)
        self._generated: dict[tuple[int, ...], list[int]] = {}

    def prompt(self, n: int) -> list[int]:
        return tokens(n, seed=n)

    def generate(self, prompt: list[int], n: int = REPLY) -> list[int]:
        """transformers' greedy reply of n tokens (no end-of-sequence stop)."""
        key = (*prompt, -n)
        if key not in self._generated:
            with torch.inference_mode():
                ids = torch.tensor(prompt)[None]
                # the mask given: else generate masks every prompt token equal to pad_token_id as padding
                out = self.tiny.reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                   max_new_tokens=n, eos_token_id=None, pad_token_id=0)
            self._generated[key] = out[0, len(prompt):].tolist()
            assert len(self._generated[key]) == n
        return self._generated[key]


@pytest.fixture(scope="session")
def families(tiny_models, tiny_gemma3) -> dict[str, Family]:
    return {kind: Family(tiny) for kind, tiny in (*tiny_models.items(), ("gemma3", tiny_gemma3))}


@pytest.fixture(params=["qwen3", "gpt_oss", "gemma3"])
def family(request, families) -> Family:
    return families[request.param]


@pytest.fixture
def qwen3(families) -> Family:
    return families["qwen3"]


def drive(engine: DecodeEngine, joins: dict[int, Sequence[DecodeRequest]]) -> dict[int, DecodeResult]:
    """Step the engine, submitting joins[k] before step k, until all are done; results by submit order."""
    ids, results, step = [], {}, 0
    while step <= max(joins) or engine.pending:
        ids += [engine.submit(request) for request in joins.get(step, ())]
        results.update((r.id, r) for r in engine.step())
        step += 1
    return {i: results[rid] for i, rid in enumerate(ids)}
