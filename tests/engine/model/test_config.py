from __future__ import annotations

import json

import pytest

from engine.model.config import FULL, SLIDING, ModelConfig

pytestmark = pytest.mark.unit

QWEN3 = {"model_type": "qwen3", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
         "max_position_embeddings": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def test_reads_a_saved_config(tiny_models):
    config = ModelConfig.from_file(tiny_models["gpt_oss"].path)
    assert config.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert config.full_layers == [1, 3] and config.sliding_layers == [0, 2]
    assert config.sliding_window == 128 and config.attention_sinks and config.num_experts == 4
    assert config.rope_scaling["rope_type"] == "yarn"
    dense = ModelConfig.from_file(tiny_models["qwen3"].path)
    assert dense.qk_norm and not dense.sliding_layers and not dense.rope_scaling


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mamba"}, "not supported"),
    ({"num_key_value_heads": 3}, "KV groups"),
    ({"layer_types": [FULL]}, "layer_types"),
    ({"layer_types": [FULL, "linear_attention"]}, "unknown layer types"),
    ({"layer_types": [FULL, SLIDING]}, "sliding_window"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"head_dim": 7}, "even head_dim"),
])
def test_bad_configs_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**QWEN3, **change})


def test_missing_field_and_unreadable_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in QWEN3.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match="missing 'hidden_size'"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        ModelConfig.from_file(tmp_path)


def test_gpt_oss_without_layer_types_alternates_as_transformers_does():
    raw = {**QWEN3, "model_type": "gpt_oss", "num_hidden_layers": 4, "sliding_window": 8}
    assert ModelConfig.from_dict(raw).layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert ModelConfig.from_dict({**raw, "model_type": "qwen3"}).layer_types == (FULL,) * 4


def _saved_by_transformers(name: str, **fields) -> dict:
    """The config.json transformers writes for its config class `name`."""
    import transformers

    return json.loads(getattr(transformers, name)(**fields).to_json_string())


SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64)


@pytest.mark.parametrize("name", ["LlamaConfig", "Qwen2Config", "Qwen3Config", "GptOssConfig", "Gemma3TextConfig"])
def test_what_transformers_writes_is_accepted(name):
    # every field transformers writes for a family is read, metadata, or a feature switched off
    ModelConfig.from_dict(_saved_by_transformers(name, **SMALL))


# config.json of Llama 3.2 1B and Qwen2.5 0.5B as the Hub serves them (transformers 4 era)
LLAMA32 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
           "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
           "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
           "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
           "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
          "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
          "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
          "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
          "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
          "use_sliding_window": False, "vocab_size": 151936}


def test_hub_configs_are_read_whole():
    llama = ModelConfig.from_dict(LLAMA32)
    assert llama.rope_theta == 500000.0 and llama.rope_scaling["rope_type"] == "llama3"
    assert not (llama.qkv_bias or llama.o_bias or llama.mlp_bias)
    qwen = ModelConfig.from_dict(QWEN25)
    assert (qwen.qkv_bias, qwen.o_bias) == (True, False)  # Qwen2 always biases q/k/v, never o_proj
    assert qwen.sliding_window is None and not qwen.sliding_layers  # use_sliding_window is off


def test_qwen2_biases_are_fixed_by_the_family():
    assert (ModelConfig.from_dict({**QWEN25, "attention_bias": None}).qkv_bias) is True  # what transformers writes
    with pytest.raises(ValueError, match="attention_bias=False"):
        ModelConfig.from_dict({**QWEN25, "attention_bias": False})  # says what Qwen2 cannot be


def test_llama_biases_follow_attention_bias_and_mlp_bias():
    config = ModelConfig.from_dict({**LLAMA32, "attention_bias": True, "mlp_bias": True})
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (True, True, True)
    with pytest.raises(ValueError, match="mlp_bias=True"):
        ModelConfig.from_dict({**QWEN25, "mlp_bias": True})  # only Llama has MLP biases


@pytest.mark.parametrize("name", ["Qwen2Config", "Qwen3Config"])
def test_qwen_sliding_layers_are_derived_as_transformers_does(name):
    fields = dict(SMALL, num_hidden_layers=5, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    saved = _saved_by_transformers(name, **fields)
    raw = {**{k: v for k, v in saved.items() if k != "layer_types"}, "sliding_window": 16}
    config = ModelConfig.from_dict(raw)
    assert list(config.layer_types) == saved["layer_types"] == [FULL, FULL, SLIDING, SLIDING, SLIDING]
    assert config.sliding_window == 16
    assert not ModelConfig.from_dict({**raw, "use_sliding_window": False}).sliding_layers


@pytest.mark.parametrize("change, names", [
    ({"sliding_window": 4096}, ["sliding_window=4096"]),  # a windowed Mistral relabelled llama
    ({"num_local_experts": 8, "quantization_config": {}}, ["num_local_experts", "quantization_config"]),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["rope_type 'dynamic'"]),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1], "long_factor": [1]}}, ["'longrope'"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, ["high_freq_factor"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "mrope_section": [2]}}, ["mrope_section"]),
    ({"rope_scaling": {"rope_type": "default", "factor": 2.0}}, ["factor"]),
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor=0.5"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}, ["partial_rotary"]),
    ({"hidden_act": "gelu"}, ["hidden_act 'gelu'"]),
    ({"layer_types": [FULL, SLIDING] * 8}, ["layer_types", "llama does not have"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, ["disagree"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, ["rope_theta"]),
])
def test_what_the_engine_does_not_implement_is_refused_by_name(change, names):
    with pytest.raises(ValueError) as refusal:
        ModelConfig.from_dict({**LLAMA32, **change})
    for name in names:
        assert name in str(refusal.value)


def test_a_gemma3_or_windowed_mistral_config_claiming_llama_is_refused():
    gemma = _saved_by_transformers("Gemma3TextConfig", **SMALL)
    with pytest.raises(ValueError) as refusal:
        ModelConfig.from_dict({**gemma, "model_type": "llama"})
    for name in ("query_pre_attn_scalar", "hidden_activation", "sliding_window", "_sliding_window_pattern"):
        assert name in str(refusal.value)
    mistral = _saved_by_transformers("MistralConfig", **SMALL, sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window=64"):
        ModelConfig.from_dict({**mistral, "model_type": "llama"})
    # a Mistral without a window is a Llama, and loads as one
    ModelConfig.from_dict({**_saved_by_transformers("MistralConfig", **SMALL, sliding_window=None),
                           "model_type": "llama"})


def test_a_gguf_file_or_folder_is_named_with_what_to_do(tmp_path):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)))  # the magic, then bytes that are not UTF-8
    for given in (gguf, tmp_path):
        with pytest.raises(ValueError, match=r"model-Q4_K_M\.gguf is a GGUF file.*python -m engine\.checkpoints"):
            ModelConfig.from_file(given)


def test_a_binary_config_is_an_error_not_a_decode_traceback(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="cannot read model config"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_file(tmp_path)
