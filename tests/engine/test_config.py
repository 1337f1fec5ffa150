from __future__ import annotations

import json

import pytest

from engine.config import FULL, SLIDING, ModelConfig

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
