"""One gpt-oss expert applied to rows: what `Decoder._moe` runs per chosen expert, and what an expert-parallel
rank runs for the experts it holds (engine/experts/dispatch.py)."""

from __future__ import annotations

import torch

from engine.model.config import ModelConfig

# an expert's tensors as the checkpoint names them under `layers.{l}.mlp.experts.`, in `expert_forward`'s order
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def expert_forward(x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                   down_bias: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """x (n, hidden) -> (n, hidden): gpt-oss's clamped SwiGLU with (up + 1). gate_up (hidden, 2 * inter) with gate
    and up interleaved, gate_up_bias (2 * inter,), down (inter, hidden), down_bias (hidden,)."""
    both = x @ gate_up + gate_up_bias  # (n, 2 * intermediate)
    gate = both[:, ::2].clamp(max=config.swiglu_limit)
    up = both[:, 1::2].clamp(-config.swiglu_limit, config.swiglu_limit)
    hidden = (up + 1) * gate * torch.sigmoid(gate * config.swiglu_alpha)  # (n, intermediate)
    return hidden @ down + down_bias
