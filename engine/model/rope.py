"""Rotary position embeddings (Su et al., 2021), with the context extensions transformers names `linear`,
`llama3` and `yarn`, computed as transformers computes them so that logits match its models.

Linear (position interpolation, Chen et al., 2023) divides every frequency by `factor`. Llama 3.1's
scaling divides by `factor` the frequencies whose wavelength exceeds original/low_freq_factor, keeps
those shorter than original/high_freq_factor, and blends linearly in wavelength's inverse between.
YaRN, section 3 of the paper: dimensions that turn more than `beta_fast` times over the original
context keep their frequency (extrapolation), those turning fewer than `beta_slow` times are divided
by `factor` (interpolation), a linear ramp blends the band between, and attention logits are scaled
by 0.1·ln(factor) + 1, applied here to cos and sin.
"""

from __future__ import annotations

import math

import torch

from engine.model.config import ModelConfig


class Rope:
    def __init__(self, config: ModelConfig) -> None:
        dim, base = config.head_dim, config.rope_theta
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # (dim/2,)
        inv_freq = 1.0 / base ** exponents
        self.scale = 1.0
        scaling = config.rope_scaling
        kind = scaling.get("rope_type", scaling.get("type"))
        original = float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
        if kind == "yarn":
            inv_freq, self.scale = _yarn(inv_freq, dim, base, original, config.max_position_embeddings, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "llama3":
            inv_freq = _llama3(inv_freq, original, scaling)
        elif kind:
            raise ValueError(f"config: rope_type {kind!r} is not supported (default, linear, llama3 and yarn are)")
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


def _llama3(inv_freq: torch.Tensor, original: float, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelength = 2 * math.pi / inv_freq  # (dim/2,)
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, blended, scaled)


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, original: float, max_positions: int,
          scaling: dict) -> tuple[torch.Tensor, float]:
    # DeepSeek-style configs leave factor out: the ratio of the extended context to the original
    factor = float(scaling["factor"] if scaling.get("factor") is not None else max_positions / original)
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
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek: the ratio of two such factors
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return blended, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0
