"""The decoder's matrix products, prepared once at load for the machine's kernels.

On a CPU every projection goes through oneDNN with its weight reordered ahead of time into the blocked
layout the kernel reads (`torch.ops.mkldnn._reorder_linear_weight`, what torch's own inductor does for
frozen CPU graphs). `F.linear` on a plain row-major weight reorders it on every call, or runs a slower
generic path: for Gemma 3 270M in bf16 on 2 cores, the tied output head (262,144 x 640) at one token takes
~25 ms through `F.linear` and ~11 ms prepacked; the layers' projections 2-3x less at batch 1 to 8.
bf16 results are bit for bit those of `F.linear` (the same oneDNN kernel, only the weight's layout
differs); fp32 ones differ by the order of the sums (~1e-6 relative).

Elsewhere (a GPU, a torch without oneDNN) a projection is `F.linear`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Linear(Protocol):
    """x (..., in_features) -> (..., out_features), in x's dtype."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class PlainLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias  # weight (out, in)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear:
    """A CPU projection whose weight oneDNN reordered once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)  # opaque blocked layout
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packs(device: torch.device) -> bool:
    """Whether projections on `device` are prepacked for oneDNN."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """The projection by `weight` (out, in) and `bias` (out,), prepared for the weight's device."""
    return PackedLinear(weight, bias) if packs(weight.device) else PlainLinear(weight, bias)


def fused(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> tuple[Linear, list[int]]:
    """One projection computing several that read the same input (q, k and v; gate and up): their weights
    stacked by rows, one kernel call instead of several. Returns it and the output widths to split by."""
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else weights[i].new_zeros(weights[i].shape[0]) for i, b in enumerate(biases)])
    return linear(torch.cat(weights), bias), [w.shape[0] for w in weights]
