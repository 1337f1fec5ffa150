"""A routing trace skewed and drifting the way published expert loads are, for benchmarks (the tiny random models
route almost evenly, and no trained MoE model is on the package registry).

Shape. TensorRT-LLM's study of DeepSeek-R1's routing ("Scaling Expert Parallelism in TensorRT-LLM, Part 1",
nvidia.github.io/TensorRT-LLM/blogs/tech_blog/blog4_Scaling_Expert_Parallelism_in_TensorRT-LLM.html) shows per-layer
expert loads with a few hot experts far above a long flat tail, hot spots differing between layers, and the hot
experts changing over iterations; at EP32 without replicas the busiest rank had (max - mean)/mean = 1.56. We draw
each layer's log-popularity of each expert from a normal law (a log-normal load: a heavy right tail), with the
spread `SIGMA` fitted so that contiguous EP32 over 256 experts, top 8, has max/mean ≈ 2.56 on average
(`bench/eplb.py` prints the fit), and let it drift as an Ornstein-Uhlenbeck process with a correlation time of
`drift_steps` steps: the same spread at every moment, different hot experts after a few correlation times.
Each token picks its top k experts without replacement in proportion to popularity (Gumbel top-k).
"""

from __future__ import annotations

import math

import torch

SIGMA = 1.25  # spread of log-popularity; see the module docstring for the fit


class SkewedRouting:
    def __init__(self, layers: int, experts: int, top_k: int, sigma: float = SIGMA, drift_steps: float = 0.0,
                 seed: int = 0) -> None:
        """`drift_steps`: correlation time of the popularity in steps; 0: no drift."""
        if not 1 <= top_k <= experts:
            raise ValueError(f"SkewedRouting: top_k must lie in 1..{experts}")
        self.layers, self.experts, self.top_k, self.sigma = layers, experts, top_k, sigma
        self.generator = torch.Generator().manual_seed(seed)
        self.log_popularity = sigma * torch.randn(layers, experts, generator=self.generator)  # (layers, experts)
        self.keep = math.exp(-1 / drift_steps) if drift_steps else 1.0

    def chosen(self, tokens: int) -> torch.Tensor:
        """This step's choices (layers, tokens, top_k) logical expert ids; then the popularity drifts one step."""
        gumbel = -torch.log(-torch.log(torch.rand(self.layers, tokens, self.experts, generator=self.generator)
                                       .clamp_min(1e-20)))
        picks = torch.topk(self.log_popularity[:, None, :] + gumbel, self.top_k, dim=-1).indices
        if self.keep < 1.0:
            noise = torch.randn(self.layers, self.experts, generator=self.generator)
            self.log_popularity = self.keep * self.log_popularity + math.sqrt(1 - self.keep**2) * self.sigma * noise
        return picks

    def counts(self, tokens: int) -> torch.Tensor:
        """This step's tokens per expert (layers, experts) int64, from `chosen`."""
        picks = self.chosen(tokens)
        return torch.stack([torch.bincount(row.reshape(-1), minlength=self.experts) for row in picks])
