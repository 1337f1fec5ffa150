"""The decoder of one expert-parallel rank: attention and everything else for its own tokens, experts shared.

`ExpertParallelDecoder` is a `Decoder` whose MoE layers route as the single-process one does (router, top-k,
softmax over the chosen logits), record the routing in `LoadStats`, and compute through `ExpertParallelMoE`.
Every rank of the group must run the same number of forwards, in step (a rank with no tokens runs an empty one:
`idle_forward`), and call `end_step` after each: that is where rebalancing happens, between steps, never inside one.
`ExpertRank` is the part every rank holds (its experts, its recorded routing, the rebalance): a serving engine's
follower ranks hold it alone (engine/experts/serving.py).
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


def check_layout(config: ModelConfig, parallel: ExpertParallelConfig, ranks: int) -> None:
    """Raise ValueError unless `config` is a MoE model whose experts (and redundant slots) divide among `ranks`."""
    if not config.num_experts:
        raise ValueError("expert parallelism: the model has no experts (a dense MLP)")
    slots = config.num_experts + parallel.redundant_slots
    if slots % ranks:
        raise ValueError(f"expert parallelism: {config.num_experts} experts + {parallel.redundant_slots} redundant "
                         f"slots do not divide among {ranks} ranks; change redundant_slots")


class ExpertRank:
    """What every rank of the group holds: its slots' experts, the routing it recorded, and the rebalancing. A
    follower of a serving engine (engine/experts/serving.py) holds this alone; `ExpertParallelDecoder` adds the
    rest of the model around it."""

    def __init__(self, config: ModelConfig, experts: dict[str, torch.Tensor], parallel: ExpertParallelConfig,
                 group: dist.ProcessGroup | None = None) -> None:
        """`experts`: every MoE layer's expert tensors by checkpoint name (`layers.{l}.mlp.experts.*`), all
        experts; this rank keeps only its slots'. The first plan balances a uniform load (no traffic seen yet)."""
        check_layout(config, parallel, dist.get_world_size(group))
        self.config, self.parallel, self.group = config, parallel, group
        self.slots = config.num_experts + parallel.redundant_slots
        first = experts[f"layers.0.mlp.experts.{EXPERT_TENSORS[0]}"]
        self.dtype, self.device = first.dtype, first.device
        self.experts = ExpertParallelMoE(config, experts, self._plan(torch.ones(config.num_layers,
                                                                                config.num_experts)), group)
        self.stats = LoadStats(config.num_layers, config.num_experts, parallel.window_steps, self.device)
        self.rebalances: list[RebalanceReport] = []

    def _plan(self, load: torch.Tensor) -> Plan:
        return plan(load, self.slots, self.parallel.groups, self.parallel.nodes, dist.get_world_size(self.group))

    def idle_forward(self) -> None:
        """A forward with no tokens, for a rank with nothing to compute while the others step: it answers the
        other ranks' collectives."""
        empty = torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
        none = torch.empty(0, self.config.experts_per_token, dtype=torch.int64, device=self.device)
        for layer in range(self.config.num_layers):
            self.experts.forward(layer, empty, none, none.to(self.dtype))

    def rebalance_due(self) -> bool:
        """Does the step now running end with a rebalance (every `rebalance_every` steps)?"""
        every = self.parallel.rebalance_every
        return bool(every) and (self.stats.steps + 1) % every == 0

    def end_step(self, rebalance: bool | None = None) -> RebalanceReport | None:
        """Close the step's statistics, then rebalance if `rebalance` (None: when `rebalance_due` said so). The
        rebalance is a collective: every rank must be told the same (a serving engine's followers are told by
        rank 0; ranks stepping in lockstep all count the same steps)."""
        if rebalance is None:
            rebalance = self.rebalance_due()
        self.stats.end_step()
        return self.rebalance() if rebalance else None

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


class ExpertParallelDecoder(Decoder):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], parallel: ExpertParallelConfig,
                 group: dist.ProcessGroup | None = None) -> None:
        """`weights` as `Decoder` takes them, with every expert; this rank keeps only its slots' experts. The first
        plan balances a uniform load (no traffic seen yet)."""
        expert_names = set(expert_tensor_names(config))
        self.expert_rank = ExpertRank(config, {name: weights[name] for name in expert_names}, parallel, group)
        # the same objects as the rank's (moves and records change them in place), under the names callers use
        ranked = self.expert_rank
        self.parallel, self.group, self.slots = parallel, group, ranked.slots
        self.experts, self.stats, self.rebalances = ranked.experts, ranked.stats, ranked.rebalances
        super().__init__(config, {name: tensor for name, tensor in weights.items() if name not in expert_names})

    @classmethod
    def from_pretrained_parallel(cls, path: Path | str, parallel: ExpertParallelConfig,
                                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | str = AUTO,
                                 device: torch.device | str = "cpu") -> ExpertParallelDecoder:
        config = ModelConfig.from_file(path)
        return cls(config, load_weights(path, config, resolve(dtype, device), device), parallel, group)

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        layer = int(p.split(".")[1])
        logits = self._linear(x, p + "mlp.router")  # (T, experts)
        top, chosen = torch.topk(logits, self.config.experts_per_token, dim=-1)  # (T, k)
        self.stats.record(layer, chosen)
        return self.experts.forward(layer, x, chosen, torch.softmax(top, dim=-1))

    def idle_forward(self) -> None:
        """A forward with no tokens (`ExpertRank.idle_forward`)."""
        self.expert_rank.idle_forward()

    def rebalance_due(self) -> bool:
        return self.expert_rank.rebalance_due()

    def end_step(self, rebalance: bool | None = None) -> RebalanceReport | None:
        """Close the step's statistics; every `rebalance_every` steps, rebalance (a collective: every rank calls
        `end_step` after every step). `ExpertRank.end_step`."""
        return self.expert_rank.end_step(rebalance)

    def rebalance(self, load: torch.Tensor | None = None) -> RebalanceReport:
        """`ExpertRank.rebalance`: a collective."""
        return self.expert_rank.rebalance(load)


def expert_tensor_names(config: ModelConfig) -> list[str]:
    """Every MoE layer's expert tensors' checkpoint names."""
    return [f"layers.{layer}.mlp.experts.{name}" for layer in range(config.num_layers) for name in EXPERT_TENSORS]
