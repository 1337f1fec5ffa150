"""Loading a model's safetensors weights, checked against what its config needs."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model.config import ModelConfig, refuse_gguf
from kvstore.connectors.identity import checkpoint_identity


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
        if c.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
        if c.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
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
            if c.mlp_bias:
                shapes |= {p + "mlp.gate_proj.bias": (i_,), p + "mlp.up_proj.bias": (i_,),
                           p + "mlp.down_proj.bias": (h,)}
    return shapes


def load_weights(path: Path | str, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All `*.safetensors` files under `path`, checked name by name and shape by shape.

    Every tensor of the checkpoint is accounted for: one the config does not call for is an error naming
    it, since a model computed without it would be silently wrong."""
    refuse_gguf(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for stored, tensor in load_file(str(file)).items():
            name = stored.removeprefix("model.")
            if name in weights:
                raise ValueError(f"{file}: {stored} is stored twice in {path}; remove one copy")
            weights[name] = tensor
    if config.tie_word_embeddings and "lm_head.weight" in weights:
        # a tied checkpoint may still store the head; it must then be the embedding it is tied to
        head, embedding = weights.pop("lm_head.weight"), weights.get("embed_tokens.weight")
        if embedding is None or not torch.equal(head, embedding):
            raise ValueError(f"{path}: lm_head.weight differs from embed_tokens.weight, but the config ties them "
                             "(tie_word_embeddings); untie them in config.json or drop the stored head")
    wanted = expected_shapes(config)
    if unexpected := sorted(set(weights) - set(wanted)):
        raise ValueError(f"{path}: {len(unexpected)} tensors that a {config.model_type} of this config does not "
                         f"use: {_grouped(unexpected)}. The config does not describe this checkpoint; "
                         "check its model_type and fields")
    if missing := sorted(set(wanted) - set(weights)):
        raise ValueError(f"{path}: weights missing for {len(missing)} tensors: {_grouped(missing)}")
    for name, shape in wanted.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{path}: {name} has shape {tuple(weights[name].shape)}, the config needs {shape}")
    return {name: weights[name].to(device=device, dtype=dtype) for name in wanted}


def _grouped(names: list[str]) -> str:
    """Tensor names with the layer index folded: `layers.*.mlp.gate_proj.bias (layers 0,1,2)`; at most eight."""
    layers: dict[str, list[int]] = {}
    for name in names:
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
            layers.setdefault(".".join(["layers", "*", *parts[2:]]), []).append(int(parts[1]))
        else:
            layers.setdefault(name, [])
    shown = [f"{name} (layers {','.join(map(str, sorted(found)))})" if found else name
             for name, found in sorted(layers.items())]
    return ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")


def model_identity(path: Path | str) -> str:
    """The namespace's model identity: directory name and a digest of the config and every weight byte.

    Two models differing in one weight never share KV, whatever their directories are called."""
    path = Path(path)
    refuse_gguf(path)
    return checkpoint_identity(path)
