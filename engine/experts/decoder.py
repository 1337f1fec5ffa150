"""The decoder of one expert-parallel rank: attention and everything else for its own tokens, experts shared.

`ExpertParallelDecoder` is a `Decoder` whose MoE layers route as the single-process one does (router, top-k,
softmax over the chosen logits), record the routing in `LoadStats`, and compute through `ExpertParallelMoE`.
Every rank of the group must run the same number of forwards, in step (a rank with no tokens runs an empty one:
`idle_forward`), and call `end_step` after each: that is where rebalancing happens, between steps, never inside one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.experts.dispatch import ExpertParallelMoE, MoveReport
from engine.experts.planner import Plan, plan
from engine.experts.stats import LoadStats
from engine.model.config import ModelConfig
from engine.model.decoder import Decoder
from engine.model.dtype import AUTO, resolve
from engine.model.moe import EXPERT_TENSORS
from engine.model.weights import load_weights


@dataclass(slots=True)
class ExpertParallelConfig:
    """How the experts spread over the group's ranks, and how often they are rebalanced."""

    redundant_slots: int = 0  # slots beyond one per expert, per layer, for replicas of the busiest experts
    groups: int = 1  # expert groups (DeepSeek's group-limited routing); the planner keeps a group on one node
    nodes: int = 1  # ranks are split into nodes of ranks / nodes consecutive ranks
    window_steps: int = 64  # the load the planner sees: tokens per expert over this many latest steps
    rebalance_every: int = 0  # steps between rebalances; 0: never (the first plan stays)

    def __post_init__(self) -> None:
        if self.redundant_slots < 0 or self.groups < 1 or self.nodes < 1 or self.window_steps < 1:
            raise ValueError("ExpertParallelConfig: redundant_slots >= 0, groups, nodes and window_steps >= 1")
        if self.rebalance_every < 0:
            raise ValueError("ExpertParallelConfig: rebalance_every must be >= 0 (0 turns rebalancing off)")


@dataclass(frozen=True)
class RebalanceReport:
    step: int
    plan: Plan
    moved: MoveReport
    plan_s: float  # computing the plan (after the loads' all-reduce)
    pause_s: float  # the whole rebalance on this rank: loads' all-reduce, plan, weights moved; no step runs meanwhile


class ExpertParallelDecoder(Decoder):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], parallel: ExpertParallelConfig,
                 group: dist.ProcessGroup | None = None) -> None:
        """`weights` as `Decoder` takes them, with every expert; this rank keeps only its slots' experts. The first
        plan balances a uniform load (no traffic seen yet)."""
        if not config.num_experts:
            raise ValueError("ExpertParallelDecoder: the model has no experts (a dense MLP)")
        self.parallel, self.group = parallel, group
        ranks = dist.get_world_size(group)
        slots = config.num_experts + parallel.redundant_slots
        if slots % ranks:
            raise ValueError(f"ExpertParallelDecoder: {config.num_experts} experts + {parallel.redundant_slots} "
                             f"redundant slots do not divide among {ranks} ranks; change redundant_slots")
        self.slots = slots
        uniform = torch.ones(config.num_layers, config.num_experts)
        expert_names = [f"layers.{layer}.mlp.experts.{name}" for layer in range(config.num_layers)
                        for name in EXPERT_TENSORS]
        self.experts = ExpertParallelMoE(config, {name: weights[name] for name in expert_names},
                                         self._plan(uniform), group)
        shared = {name: tensor for name, tensor in weights.items() if name not in set(expert_names)}
        super().__init__(config, shared)
        self.stats = LoadStats(config.num_layers, config.num_experts, parallel.window_steps, self.device)
        self.rebalances: list[RebalanceReport] = []

    @classmethod
    def from_pretrained_parallel(cls, path: Path | str, parallel: ExpertParallelConfig,
                                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | str = AUTO,
                                 device: torch.device | str = "cpu") -> ExpertParallelDecoder:
        config = ModelConfig.from_file(path)
        return cls(config, load_weights(path, config, resolve(dtype, device), device), parallel, group)

    def _plan(self, load: torch.Tensor) -> Plan:
        return plan(load, self.slots, self.parallel.groups, self.parallel.nodes, dist.get_world_size(self.group))

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        layer = int(p.split(".")[1])
        logits = self._linear(x, p + "mlp.router")  # (T, experts)
        top, chosen = torch.topk(logits, self.config.experts_per_token, dim=-1)  # (T, k)
        self.stats.record(layer, chosen)
        return self.experts.forward(layer, x, chosen, torch.softmax(top, dim=-1))

    def idle_forward(self) -> None:
        """A forward with no tokens, for a rank with nothing to compute while the others step: it answers the
        other ranks' collectives."""
        empty = torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
        none = torch.empty(0, self.config.experts_per_token, dtype=torch.int64, device=self.device)
        for layer in range(self.config.num_layers):
            self.experts.forward(layer, empty, none, none.to(self.dtype))

    def end_step(self) -> RebalanceReport | None:
        """Close the step's statistics; every `rebalance_every` steps, rebalance (a collective: every rank calls
        `end_step` after every step)."""
        self.stats.end_step()
        every = self.parallel.rebalance_every
        if every and self.stats.steps % every == 0:
            return self.rebalance()
        return None

    def rebalance(self, load: torch.Tensor | None = None) -> RebalanceReport:
        """Plan from the group's window load (summed over ranks) or from `load` (layers, experts) when given (the
        same on every rank), and move the weights. A collective."""
        started = time.perf_counter()
        if load is None:
            load = self.stats.window_load()
            dist.all_reduce(load, group=self.group)
        planned = time.perf_counter()
        new_plan = self._plan(load.cpu())
        plan_s = time.perf_counter() - planned
        moved = self.experts.move_to(new_plan)
        report = RebalanceReport(self.stats.steps, new_plan, moved, plan_s, time.perf_counter() - started)
        self.rebalances.append(report)
        return report
