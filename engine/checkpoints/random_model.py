"""Random-weight models in the HuggingFace layout (config.json + model.safetensors), for demos and benchmarks.

Compute cost and KV size depend only on the shapes, so a random model of a real model's shapes
measures what caching saves; no download, no tokenizer. Matrices are drawn with std 1/sqrt(fan-in),
so activations stay of order one through the layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.config import ModelConfig
from engine.model.weights import expected_shapes

# A small gpt-oss-style hybrid: sliding-window (128) and full layers alternating, 8 experts, top 2.
DEMO = {"model_type": "gpt_oss", "vocab_size": 32_000, "hidden_size": 384, "num_hidden_layers": 8,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 384,
        "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 128, "max_position_embeddings": 16_384,
        "layer_types": ["sliding_attention", "full_attention"] * 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 150_000.0}}

# A Qwen3-0.6B-shaped dense model, reduced to 12 layers: big enough that compute dominates on a CPU.
BENCH = {"model_type": "qwen3", "vocab_size": 32_000, "hidden_size": 1024, "num_hidden_layers": 12,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
         "max_position_embeddings": 40_960, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}


def write_random_model(path: Path | str, config: dict, seed: int = 0) -> ModelConfig:
    """Write config.json and model.safetensors for `config` under `path` (created); the parsed config."""
    parsed = ModelConfig.from_dict(config)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(parsed).items():
        if name.endswith("norm.weight"):  # the identity: 1, or 0 where the norm scales by (1 + weight)
            tensor = torch.full(shape, 1.0 - parsed.norm_offset)
        elif name.endswith(("bias", "sinks")):
            tensor = torch.zeros(shape)
        elif name == "embed_tokens.weight":
            tensor = torch.randn(shape, generator=generator)
        else:
            fan_in = shape[-1] if "experts" not in name else shape[-2]  # experts are stored (in, out)
            tensor = torch.randn(shape, generator=generator) / fan_in ** 0.5
        tensors[name if name == "lm_head.weight" else f"model.{name}"] = tensor.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return parsed
