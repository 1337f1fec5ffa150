"""Families and options the loader once got silently wrong, against transformers on the same weights.

Qwen2 (q/k/v biases, none on o_proj, sliding layers from max_window_layers on), Llama with attention and
MLP biases, a custom head_dim and tied embeddings, and the `llama3` and `linear` RoPE scalings. Each
model's config differs from the shared tiny models (window, head_dim, layer count), and each test has a
twin showing that leaving the feature out moves the logits far beyond the tolerance.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from engine.model.decoder import Chunk, Decoder
from engine.model.kv import PagePool, RequestKV
from tests.engine.conftest import VOCAB, TinyModel

pytestmark = pytest.mark.unit
TOLERANCE = 2e-5  # max abs logit difference in fp32, for logits spread over a few units
QWEN2_WINDOW = 48
LENGTH = 200  # positions up to 200: past the window, and far past the scalings' original context of 64
CUTS = [1, 37, 47, 48, 130]  # chunks straddling the window, one of a single token


def _build(kind: str, path) -> TinyModel:
    import transformers

    torch.manual_seed({"qwen2": 11, "llama3": 12, "linear": 13}[kind])
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=1024)
    if kind == "qwen2":  # sliding layers 1 and 2, as use_sliding_window with max_window_layers=1 makes them
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            num_hidden_layers=3, use_sliding_window=True, sliding_window=QWEN2_WINDOW, max_window_layers=1,
            tie_word_embeddings=False, **common))
    elif kind == "llama3":  # every bias Llama can have, head_dim unlike hidden/heads, tied embeddings
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, head_dim=24, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0}, **common))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0, 0.1 if parameter.dim() > 1 else 0.3)
    model.eval()
    model.save_pretrained(path)
    return TinyModel(kind, path, model)


@pytest.fixture(scope="module")
def loader_models(tmp_path_factory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("loader_models")
    return {kind: _build(kind, root / kind) for kind in ("qwen2", "llama3", "linear")}


@pytest.fixture(params=["qwen2", "llama3", "linear"])
def tiny(request, loader_models) -> TinyModel:
    return loader_models[request.param]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: Decoder, tokens: list[int], cuts: list[int]) -> torch.Tensor:
    """All-position logits (n, vocab), computed in chunks ending at `cuts`."""
    kv = RequestKV(model.config, PagePool(model.config, 64, 16, torch.float32))
    kv.reserve(len(tokens))
    out, start = [], 0
    for end in [*cuts, len(tokens)]:
        out.append(model.forward([Chunk(kv, torch.tensor(tokens[start:end]), start)], all_logits=True)[0])
        start = end
    return torch.cat(out)


def test_the_config_is_read_as_transformers_builds_it(loader_models):
    qwen2 = Decoder.from_pretrained(loader_models["qwen2"].path).config
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.mlp_bias) == (True, False, False)
    assert qwen2.sliding_layers == [1, 2] and qwen2.sliding_window == QWEN2_WINDOW
    llama = Decoder.from_pretrained(loader_models["llama3"].path).config
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.head_dim) == (True, True, True, 24)
    assert llama.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("cuts", [[], CUTS], ids=["whole", "chunked"])
def test_logits_match_transformers(tiny, cuts):
    model = Decoder.from_pretrained(tiny.path, torch.float32)
    tokens = _prompt(LENGTH, len(cuts))
    reference = tiny.logits(tokens)
    assert reference.std() > 0.5  # logits spread widely enough for the tolerance to mean something
    assert (_run(model, tokens, cuts) - reference).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("kind, dropped", [
    ("qwen2", "self_attn.q_proj.bias"),
    ("qwen2", "self_attn.k_proj.bias"),
    ("llama3", "self_attn.o_proj.bias"),
    ("llama3", "mlp.down_proj.bias"),
])
def test_each_bias_matters(loader_models, kind, dropped):
    # the reference tests can fail: a model computed without one family of biases is far off
    tiny = loader_models[kind]
    loaded = Decoder.from_pretrained(tiny.path, torch.float32)
    model = Decoder(loaded.config, {name: tensor for name, tensor in loaded.w.items() if not name.endswith(dropped)})
    tokens = _prompt(LENGTH, 3)
    assert (_run(model, tokens, []) - tiny.logits(tokens)).abs().max().item() > 1000 * TOLERANCE


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_the_scaling_matters_at_these_positions(loader_models, kind):
    tiny = loader_models[kind]
    model = Decoder.from_pretrained(tiny.path, torch.float32)
    model.config = replace(model.config, rope_scaling={})
    from engine.model.rope import Rope
    model.rope = Rope(model.config)
    tokens = _prompt(LENGTH, 4)
    assert (_run(model, tokens, []) - tiny.logits(tokens)).abs().max().item() > 1000 * TOLERANCE


def test_the_qwen2_window_matters(loader_models):
    tiny = loader_models["qwen2"]
    model = Decoder.from_pretrained(tiny.path, torch.float32)
    model.config = replace(model.config, sliding_window=QWEN2_WINDOW + 1)
    tokens = _prompt(LENGTH, 5)
    assert (_run(model, tokens, []) - tiny.logits(tokens)).abs().max().item() > 1000 * TOLERANCE


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0},  # original: max
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 256, "beta_fast": 16, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.707, "truncate": False},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256, "attention_factor": 1.5},
], ids=["linear", "llama3", "llama3-default-original", "yarn", "yarn-mscale", "yarn-implicit-factor"])
def test_rope_frequencies_match_transformers(scaling):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.model.config import ModelConfig
    from engine.model.rope import Rope

    raw = {"model_type": "llama", "vocab_size": 64, "hidden_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
           "max_position_embeddings": 4096, "rope_parameters": {"rope_theta": 50_000.0, **scaling}}
    # a deep copy: transformers fills its defaults into the dict it is given
    reference = transformers.LlamaConfig(**copy.deepcopy({k: v for k, v in raw.items() if k != "model_type"}))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](reference, "cpu")
    rope = Rope(ModelConfig.from_dict(raw))
    assert torch.allclose(rope.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert rope.scale == pytest.approx(attention_factor, rel=1e-9)
