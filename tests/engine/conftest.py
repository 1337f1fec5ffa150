"""Tiny random-weight models built and saved by `transformers` (a test dependency only), shared per session.

Weights are redrawn larger than transformers' initialisation (std 0.02), so logits spread over a few
units and a wrong mask, position or expert shows up far above the 1e-4 tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# make test runs two workers on two cores: one torch thread each, or OpenMP threads spin against each other
torch.set_num_threads(1)

WINDOW = 128
VOCAB = 512


@dataclass
class TinyModel:
    kind: str
    path: Path
    reference: torch.nn.Module  # the transformers model, fp32, eval mode

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """The reference's logits of every position, (len(tokens), vocab)."""
        with torch.inference_mode():
            return self.reference(torch.tensor(tokens)[None]).logits[0].float()


def _build(kind: str, path: Path) -> TinyModel:
    import transformers

    torch.manual_seed({"qwen3": 1, "gpt_oss": 2}[kind])
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=128, num_hidden_layers=3,
                                                                        **common))
    else:  # gpt-oss style: sliding (128) and full layers alternating, sinks, biases, 4 experts (top 2), YaRN
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            intermediate_size=32, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=WINDOW, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                    "original_max_position_embeddings": 256}, **common))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0, 0.1 if parameter.dim() > 1 else 0.3)
    model.eval()
    model.save_pretrained(path)
    return TinyModel(kind, path, model)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("models")
    return {kind: _build(kind, root / kind) for kind in ("qwen3", "gpt_oss")}


@pytest.fixture(params=["qwen3", "gpt_oss"])
def tiny(request, tiny_models) -> TinyModel:
    return tiny_models[request.param]


GEMMA3_WINDOW = 16


def build_gemma3(path: Path, seed: int = 3, **overrides) -> TinyModel:
    """Gemma 3 (text) at a toy scale with the real model's pattern: five sliding layers, then a full one.

    head_dim is not hidden/heads and query_pre_attn_scalar is not head_dim, so a scale taken from the
    wrong field shows; norm weights scatter around 0, the identity of Gemma's x·(1 + w)."""
    import transformers

    torch.manual_seed(seed)
    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
                  sliding_window=GEMMA3_WINDOW, max_position_embeddings=1024) | overrides
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**config))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0, 0.1)
            else:  # the embedding is the output head too: 0.3 spreads the logits over a few units
                parameter.normal_(0, 0.3 if "embed" in name else 0.1)
    model.eval()
    model.save_pretrained(path)
    return TinyModel("gemma3", path, model)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> TinyModel:
    return build_gemma3(tmp_path_factory.mktemp("models") / "gemma3")
