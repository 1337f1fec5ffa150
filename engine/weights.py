"""Loading a model's safetensors weights, checked against what its config needs."""

from __future__ import annotations

from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file

from engine.config import ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, by its HuggingFace name without the `model.` prefix."""
    c = config
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (c.vocab_size, h), "norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
        if c.attention_sinks:
            shapes[p + "self_attn.sinks"] = (c.num_heads,)
        e, i_ = c.num_experts, c.intermediate_size
        if e:
            shapes |= {p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,),
                       p + "mlp.experts.gate_up_proj": (e, h, 2 * i_), p + "mlp.experts.gate_up_proj_bias": (e, 2 * i_),
                       p + "mlp.experts.down_proj": (e, i_, h), p + "mlp.experts.down_proj_bias": (e, h)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (i_, h), p + "mlp.up_proj.weight": (i_, h),
                       p + "mlp.down_proj.weight": (h, i_)}
    return shapes


def load_weights(path: Path | str, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All `*.safetensors` files under `path`, checked name by name and shape by shape."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        raw.update(load_file(str(file)))
    weights = {name.removeprefix("model."): tensor for name, tensor in raw.items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    wanted = expected_shapes(config)
    if missing := sorted(set(wanted) - set(weights)):
        raise ValueError(f"{path}: weights missing for {len(missing)} tensors, e.g. {missing[:3]}")
    for name, shape in wanted.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{path}: {name} has shape {tuple(weights[name].shape)}, the config needs {shape}")
    return {name: weights[name].to(device=device, dtype=dtype) for name in wanted}


def model_identity(path: Path | str) -> str:
    """The namespace's model identity: directory name and a digest of the config and every weight byte.

    Two models differing in one weight never share KV, whatever their directories are called."""
    path = Path(path)
    digest = xxhash.xxh3_128()
    for file in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        with open(file, "rb") as f:
            while chunk := f.read(16 * 2**20):
                digest.update(chunk)
    return f"{path.resolve().name}@{digest.hexdigest()[:16]}"
