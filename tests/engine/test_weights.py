from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.weights import load_weights, model_identity

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
