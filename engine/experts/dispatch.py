"""Expert parallelism over `torch.distributed`: each rank holds some experts' replicas; tokens travel to them and back.

Attention runs data-parallel: every rank computes its own sequences' tokens. At each MoE layer a rank sends each
(token, chosen expert) pair's hidden state to the rank holding the replica it picked, that rank runs the expert,
and the result comes back to be weighted and summed, as DeepEP's dispatch and combine do on GPUs. Three
collectives per layer, all `all_to_all_single` (gloo implements it on CPU, NCCL on CUDA):

1. counts: how many rows each rank sends to each slot of each other rank, (ranks * slots_per_rank,) int64;
2. dispatch: the rows, grouped by destination rank and slot, (pairs, hidden);
3. combine: the expert outputs, back along the same splits, (pairs, hidden).

Which replica a pair goes to (the rule): the pairs of this rank that chose expert e, in token order, take e's
replicas in turn, starting at replica (rank mod replicas(e)), so each replica gets an expert's tokens to within
one per sending rank, and two ranks with one token each for e send it to different replicas. The rule depends
on nothing but the step's routing, so every replica choice is reproducible.

Weights move (`move_to`) between steps: for every slot whose expert changes, a rank that held the expert sends
it to the slot's rank, point to point (`batch_isend_irecv`); a slot whose rank already held the expert copies it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.experts.planner import Plan
from engine.model.config import ModelConfig
from engine.model.moe import EXPERT_TENSORS, expert_forward


@dataclass(frozen=True)
class MoveReport:
    """What a rebalance moved: slots whose expert changed, the bytes this rank sent and received."""

    slots_changed: int
    bytes_sent: int
    bytes_received: int


class ExpertParallelMoE:
    """The MoE layers' experts of one rank, and their dispatch and combine across the group's ranks."""

    def __init__(self, config: ModelConfig, experts: dict[str, torch.Tensor], plan: Plan,
                 group: dist.ProcessGroup | None = None) -> None:
        """`experts`: every MoE layer's expert tensors by checkpoint name (`layers.{l}.mlp.experts.*`), all
        experts; only the slots `plan` gives this rank are kept. `plan.devices` must equal the group's size."""
        self.config, self.group = config, group
        self.rank, self.ranks = dist.get_rank(group), dist.get_world_size(group)
        if plan.devices != self.ranks:
            raise ValueError(f"ExpertParallelMoE: the plan is for {plan.devices} devices, the group has {self.ranks}")
        self.plan = plan
        self.slots_per_rank = plan.slots_per_device
        # per MoE layer, this rank's slots: name -> (slots_per_rank, ...) e.g. gate_up_proj (S, hidden, 2 * inter)
        self.slots: list[dict[str, torch.Tensor]] = []
        for layer in range(config.num_layers):
            mine = self._my_slot_experts(plan, layer)
            self.slots.append({name: experts[f"layers.{layer}.mlp.experts.{name}"][mine].clone()
                               for name in EXPERT_TENSORS})
        self._replica_slots = plan.replica_slots()  # (layers, experts, max replicas), -1 padded

    def _my_slot_experts(self, plan: Plan, layer: int) -> torch.Tensor:
        begin = self.rank * self.slots_per_rank
        return plan.slot_expert[layer, begin : begin + self.slots_per_rank]  # (S,) logical expert ids

    def choose_slots(self, layer: int, chosen: torch.Tensor) -> torch.Tensor:
        """The physical slot of each (token, choice) pair, chosen (T, k) -> (T, k) int64: the module's rule."""
        flat = chosen.reshape(-1)  # (T * k,) in token order
        order = torch.argsort(flat, stable=True)
        sorted_experts = flat[order]
        first = torch.searchsorted(sorted_experts, sorted_experts)  # index of each expert's first pair
        turn = torch.arange(flat.numel(), device=flat.device) - first  # the pair's ordinal among its expert's
        replicas = self.plan.replicas[layer].to(flat.device)[sorted_experts]
        pick = (turn + self.rank) % replicas
        slots = torch.empty_like(flat)
        slots[order] = self._replica_slots[layer].to(flat.device)[sorted_experts, pick]
        return slots.view_as(chosen)

    def forward(self, layer: int, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Σ_k gates[t, k] · expert_{chosen[t, k]}(x[t]), computed where the replicas live: x (T, hidden),
        chosen (T, k) logical expert ids, gates (T, k) -> (T, hidden). Every rank of the group must call it for
        the same layer in the same step (with T = 0 where it has no tokens)."""
        ranks, per_rank = self.ranks, self.slots_per_rank
        slots = self.choose_slots(layer, chosen).reshape(-1)  # (T * k,) destination slot, global
        order = torch.argsort(slots, stable=True)  # grouped by destination rank, then slot (slots are rank-major)
        token = order // chosen.shape[1]  # (pairs,) source token of each sent row
        send_counts = torch.bincount(slots, minlength=ranks * per_rank)  # (ranks * S,)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # (source ranks * S,): rows per my slot
        send_split = send_counts.view(ranks, per_rank).sum(1).tolist()
        recv_split = recv_counts.view(ranks, per_rank).sum(1).tolist()
        received = x.new_empty(sum(recv_split), x.shape[1])  # (rows, hidden)
        dist.all_to_all_single(received, x[token].contiguous(), recv_split, send_split, group=self.group)

        local_slot = torch.arange(per_rank, device=x.device).repeat(ranks).repeat_interleave(recv_counts)  # (rows,)
        computed = torch.empty_like(received)
        weights = self.slots[layer]
        for slot in torch.unique(local_slot).tolist():
            rows = torch.where(local_slot == slot)[0]
            computed[rows] = expert_forward(received[rows], weights["gate_up_proj"][slot],
                                            weights["gate_up_proj_bias"][slot], weights["down_proj"][slot],
                                            weights["down_proj_bias"][slot], self.config)
        returned = x.new_empty(len(token), x.shape[1])  # (pairs, hidden) in send order
        dist.all_to_all_single(returned, computed, send_split, recv_split, group=self.group)
        out = torch.zeros_like(x)
        out.index_add_(0, token, returned * gates.reshape(-1)[order, None].to(x.dtype))
        return out

    def tokens_per_rank(self, layer: int, chosen: torch.Tensor) -> torch.Tensor:
        """Rows this rank's pairs send to each rank (ranks,) under the rule, without sending them."""
        slots = self.choose_slots(layer, chosen).reshape(-1)
        return torch.bincount(slots // self.slots_per_rank, minlength=self.ranks)

    def move_to(self, plan: Plan) -> MoveReport:
        """Take on `plan`'s placement, moving expert weights between ranks; a collective every rank calls with the
        same plan, between steps."""
        old = self.plan
        if plan.devices != self.ranks or plan.slot_expert.shape != old.slot_expert.shape:
            raise ValueError("ExpertParallelMoE.move_to: the new plan must have the old one's devices and slots")
        per_rank, changed, sent, received = self.slots_per_rank, 0, 0, 0
        new_slots = []
        for layer in range(self.config.num_layers):
            held = old.slot_expert[layer].view(self.ranks, per_rank)  # (ranks, S): who held what
            wanted = plan.slot_expert[layer].view(self.ranks, per_rank)
            changed += int((held != wanted).sum())
            mine = {name: tensor.clone() for name, tensor in self.slots[layer].items()}
            ops: list[dist.P2POp] = []
            inbox: list[tuple[int, torch.Tensor]] = []
            # every rank walks the same moves in the same order, so sends and receives pair up
            for rank in range(self.ranks):
                for slot, expert in enumerate(wanted[rank].tolist()):
                    if expert in held[rank].tolist():  # the rank already holds it: a local copy
                        if rank == self.rank:
                            source_slot = held[rank].tolist().index(expert)
                            for name in mine:
                                mine[name][slot] = self.slots[layer][name][source_slot]
                        continue
                    source = int((held == expert).any(1).nonzero()[0])  # the lowest rank that held it
                    if source == self.rank:
                        source_slot = held[source].tolist().index(expert)
                        flat = torch.cat([self.slots[layer][name][source_slot].reshape(-1) for name in mine])
                        ops.append(dist.P2POp(dist.isend, flat, rank, self.group))
                        sent += flat.numel() * flat.element_size()
                    elif rank == self.rank:
                        flat = torch.empty(sum(t[0].numel() for t in mine.values()), dtype=mine["down_proj"].dtype,
                                           device=mine["down_proj"].device)
                        ops.append(dist.P2POp(dist.irecv, flat, source, self.group))
                        inbox.append((slot, flat))
                        received += flat.numel() * flat.element_size()
            if ops:
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
            for slot, flat in inbox:
                for name, part in zip(mine, flat.split([t[0].numel() for t in mine.values()])):
                    mine[name][slot] = part.view_as(mine[name][slot])
            new_slots.append(mine)
        self.slots, self.plan, self._replica_slots = new_slots, plan, plan.replica_slots()
        return MoveReport(changed, sent, received)
