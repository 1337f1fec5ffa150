from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.config import ModelConfig
from engine.model.weights import load_weights, model_identity

pytestmark = pytest.mark.unit


def _copy(tiny, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny.path, target)
    return target, next(target.glob("*.safetensors"))


def test_missing_and_misshapen_weights_are_named(tiny_models, tmp_path):
    target, file = _copy(tiny_models["qwen3"], tmp_path)
    config = ModelConfig.from_file(target)
    weights = load_file(str(file))
    name = "model.layers.1.self_attn.k_proj.weight"
    save_file({k: v for k, v in weights.items() if k != name}, str(file))
    with pytest.raises(ValueError, match="missing"):
        load_weights(target, config, torch.float32)
    save_file({**weights, name: torch.zeros(3, 3)}, str(file))
    with pytest.raises(ValueError, match="k_proj.weight has shape"):
        load_weights(target, config, torch.float32)


def test_identity_changes_with_any_weight(tiny_models, tmp_path):
    target, file = _copy(tiny_models["qwen3"], tmp_path)
    before = model_identity(target)
    assert before == model_identity(target)
    weights = load_file(str(file))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1e-3
    save_file(weights, str(file))
    assert model_identity(target) != before


def test_a_tensor_the_config_does_not_use_is_named(tiny_models, tmp_path):
    target, file = _copy(tiny_models["qwen3"], tmp_path)
    config = ModelConfig.from_file(target)
    weights = load_file(str(file))
    save_file({**weights, "model.layers.2.mlp.gate_proj.bias": torch.zeros(config.intermediate_size)}, str(file))
    with pytest.raises(ValueError, match=r"1 tensors .* layers\.\*\.mlp\.gate_proj\.bias \(layers 2\)"):
        load_weights(target, config, torch.float32)


def test_qwen2_biases_under_a_config_without_them_are_named(tiny_models, tmp_path):
    # what happened before: a checkpoint's q/k/v biases dropped because the config did not call for them
    target, file = _copy(tiny_models["qwen3"], tmp_path)
    config = ModelConfig.from_file(target)
    weights = load_file(str(file))
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}.self_attn."
        weights |= {p + "q_proj.bias": torch.zeros(q), p + "k_proj.bias": torch.zeros(kv),
                    p + "v_proj.bias": torch.zeros(kv)}
    save_file(weights, str(file))
    with pytest.raises(ValueError) as refusal:
        load_weights(target, config, torch.float32)
    for name in ("q_proj.bias", "k_proj.bias", "v_proj.bias"):
        assert f"layers.*.self_attn.{name} (layers 0,1,2)" in str(refusal.value)


def test_gemma3_weights_under_a_llama_config_are_named(tmp_path):
    import transformers

    fields = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, head_dim=8, tie_word_embeddings=True)
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**fields)).save_pretrained(tmp_path)
    # what a relabelled config says: a plain Llama of the same shapes
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, **{
        k: v for k, v in fields.items() if k != "num_hidden_layers"}}))
    config = ModelConfig.from_file(tmp_path)
    with pytest.raises(ValueError) as refusal:
        load_weights(tmp_path, config, torch.float32)
    for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "q_norm", "k_norm"):
        assert name in str(refusal.value)


def test_a_stored_head_of_tied_embeddings_must_be_the_embedding(tiny_models, tmp_path):
    target, file = _copy(tiny_models["qwen3"], tmp_path)
    raw = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    config = ModelConfig.from_file(target)
    weights = load_file(str(file))
    with pytest.raises(ValueError, match="lm_head.weight differs from embed_tokens.weight"):
        load_weights(target, config, torch.float32)
    save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}, str(file))
    assert "lm_head.weight" not in load_weights(target, config, torch.float32)


def test_a_tensor_stored_twice_is_named(tiny_models, tmp_path):
    target, file = _copy(tiny_models["qwen3"], tmp_path)
    config = ModelConfig.from_file(target)
    name = "model.norm.weight"
    save_file({name: load_file(str(file))[name]}, str(target / "zz-extra.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight is stored twice"):
        load_weights(target, config, torch.float32)


def test_a_gguf_folder_is_named_with_what_to_do(tiny_models, tmp_path):
    config = ModelConfig.from_file(tiny_models["qwen3"].path)
    (tmp_path / "gemma-3-270m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\xff\xff")
    for given in (tmp_path, tmp_path / "gemma-3-270m.gguf"):
        with pytest.raises(ValueError, match="gemma-3-270m.gguf is a GGUF file.*engine.checkpoints"):
            load_weights(given, config, torch.float32)
        with pytest.raises(ValueError, match="is a GGUF file"):
            model_identity(given)
