"""Rotary position embeddings (Su et al., 2021), with YaRN context extension (Peng et al., 2023).

YaRN, section 3 of the paper: dimensions that turn more than `beta_fast` times over the original
context keep their frequency (extrapolation), those turning fewer than `beta_slow` times are divided
by `factor` (interpolation), a linear ramp blends the band between, and attention logits are scaled
by 0.1·ln(factor) + 1, applied here to cos and sin.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


class Rope:
    def __init__(self, config: ModelConfig) -> None:
        dim, base = config.head_dim, config.rope_theta
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # (dim/2,)
        inv_freq = 1.0 / base ** exponents
        self.scale = 1.0
        scaling = config.rope_scaling
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "yarn":
            inv_freq, self.scale = _yarn(inv_freq, dim, base, scaling)
        elif kind:
            raise ValueError(f"config: rope_type {kind!r} is not supported (default and yarn are)")
        self.inv_freq = inv_freq  # (head_dim/2,) float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each (T, head_dim/2), for positions (T,)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim) rotated by position; the two halves of head_dim form the pairs."""
    first, second = x.chunk(2, dim=-1)  # each (T, heads, head_dim/2)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dimension_turning(turns: float) -> float:  # the dimension that turns `turns` times over `original`
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # (dim/2,)
    extrapolated = 1 - ramp
    blended = inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return blended, float(attention_factor)
