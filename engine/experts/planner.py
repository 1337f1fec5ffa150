"""Where each expert's replicas live: DeepSeek's expert-parallel load balancer (EPLB), written from its description.

DeepSeek's `eplb.py` (github.com/deepseek-ai/EPLB) plans in three steps, each a greedy heuristic:

1. pack the expert *groups* onto nodes so that every node gets as many groups and about the same load
   (a token's experts are limited to a few groups, so keeping a group on one node keeps its traffic there);
2. within each node, give each redundant slot, one at a time, to the expert whose load *per replica* is highest;
3. pack the node's replicas onto its devices so that every device gets as many replicas and about the same load.

It is *hierarchical* when the groups divide evenly among the nodes; otherwise *global*: the same three steps with
one group and one node, so replicas may land on any device.

The plan is per MoE layer. Loads are tokens routed to each logical expert over a window
(`engine.experts.stats.LoadStats`); the plan maps each physical slot to a logical expert. Slot s lives on device
s // slots_per_device: the slots of a device are consecutive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Plan:
    """Physical slots (devices x slots_per_device) -> logical experts, per layer."""

    slot_expert: torch.Tensor  # (layers, slots) int64: the logical expert each physical slot holds
    replicas: torch.Tensor  # (layers, experts) int64: how many slots hold each logical expert, all >= 1
    devices: int

    @property
    def slots_per_device(self) -> int:
        return self.slot_expert.shape[1] // self.devices

    def device_loads(self, load: torch.Tensor) -> torch.Tensor:
        """Tokens each device computes (layers, devices) for a routed load (layers, experts), each expert's tokens
        split evenly among its replicas (what `engine.experts.placement`'s round-robin rule does to within a
        token per sending rank)."""
        per_replica = load.double() / self.replicas  # (layers, experts)
        per_slot = per_replica.gather(1, self.slot_expert)  # (layers, slots)
        return per_slot.view(per_slot.shape[0], self.devices, -1).sum(-1)

    def replica_slots(self) -> torch.Tensor:
        """(layers, experts, max replicas) int64: the slots holding each expert in ascending order, -1 padded."""
        layers, experts = self.replicas.shape
        table = torch.full((layers, experts, int(self.replicas.max())), -1, dtype=torch.int64)
        for layer in range(layers):
            filled = [0] * experts
            for slot, expert in enumerate(self.slot_expert[layer].tolist()):
                table[layer, expert, filled[expert]] = slot
                filled[expert] += 1
        return table


def imbalance(device_loads: torch.Tensor) -> torch.Tensor:
    """max / mean tokens per device (..., devices) -> (...); 1.0 where nothing was routed."""
    mean = device_loads.double().mean(-1)
    return torch.where(mean > 0, device_loads.double().amax(-1) / mean.clamp(min=1e-12), torch.ones_like(mean))


def contiguous_plan(layers: int, experts: int, devices: int) -> Plan:
    """Expert parallelism without a balancer: expert e on device e // (experts / devices), one replica each."""
    if experts % devices:
        raise ValueError(f"contiguous_plan: {experts} experts do not divide among {devices} devices")
    slot_expert = torch.arange(experts).expand(layers, experts).clone()
    return Plan(slot_expert, torch.ones(layers, experts, dtype=torch.int64), devices)


def plan(load: torch.Tensor, slots: int, groups: int, nodes: int, devices: int) -> Plan:
    """DeepSeek's plan for `load` (layers, experts) on `devices` devices of `slots` slots in all.

    Hierarchical where `groups` divide among `nodes`, global otherwise. `slots` - experts redundant slots go
    to the hottest experts. Deterministic: every rank planning on the same load gets the same plan.
    """
    layers, experts = load.shape
    if slots < experts or slots % devices:
        raise ValueError(f"plan: slots ({slots}) must be >= experts ({experts}) and a multiple of devices "
                         f"({devices})")
    if experts % groups or devices % nodes:
        raise ValueError(f"plan: groups ({groups}) must divide experts ({experts}) and nodes ({nodes}) devices "
                         f"({devices})")
    load = load.double()
    if groups % nodes:  # global: any replica on any device
        groups = nodes = 1
    best = Plan(*_hierarchical(load, slots, groups, nodes, devices), devices)
    if experts % devices:
        return best
    # DeepSeek's greedy steps can lose to plain expert parallelism on a few loads (33 of 3,000 random ones, global
    # policy): keep, per layer, whichever has the lowest busiest device among its plan, the contiguous placement
    # and the greedy placement without replicas, the last two with spare slots given to replicas on the same device
    # (which changes no device's load). Every candidate keeps a group's experts on one node.
    without_replicas = _hierarchical(load, experts, groups, nodes, devices)[0]
    for base in (contiguous_plan(layers, experts, devices).slot_expert, without_replicas):
        candidate = Plan(*_replicate_in_place(base, load, slots, devices), devices)
        better = candidate.device_loads(load).amax(1) < best.device_loads(load).amax(1) * (1 - 1e-9)  # (layers,)
        if better.any():
            best = Plan(torch.where(better[:, None], candidate.slot_expert, best.slot_expert),
                        torch.where(better[:, None], candidate.replicas, best.replicas), devices)
    return best


def _replicate_in_place(slot_expert: torch.Tensor, load: torch.Tensor, slots: int,
                        devices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A placement without replicas (layers, experts) widened to `slots` slots: each device's spare slots go to
    its own experts, hottest per replica first, so no device's load changes."""
    layers, experts = slot_expert.shape
    per_device = experts // devices
    local = slot_expert.reshape(layers * devices, per_device)  # (layers*devices, per_device) logical ids
    local_item, _ = _replicate(load.repeat_interleave(devices, 0).gather(1, local), slots // devices)
    widened = local.gather(1, local_item).view(layers, slots)
    replicas = torch.zeros(layers, experts, dtype=torch.int64)
    replicas.scatter_add_(1, widened, torch.ones_like(widened))
    return widened, replicas


def _hierarchical(load: torch.Tensor, slots: int, groups: int, nodes: int,
                  devices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_expert (layers, slots), replicas (layers, experts)); see the module's three steps."""
    layers, experts = load.shape
    group_size, node_experts = experts // groups, experts // nodes
    node_slots, node_devices = slots // nodes, devices // nodes
    if node_slots < node_experts:
        raise ValueError(f"plan: each node needs at least its {node_experts} experts' slots, has {node_slots}")

    # 1. groups onto nodes; experts renumbered node-major: node n holds new ids [n * node_experts, (n+1) * ...)
    group_node, group_rank = _pack(load.view(layers, groups, group_size).sum(-1), nodes)  # (layers, groups) each
    within_group = torch.arange(group_size)
    new_id = ((group_node * (groups // nodes) + group_rank)[:, :, None] * group_size + within_group).view(layers, -1)
    new_to_expert = torch.argsort(new_id, dim=1)  # (layers, experts): renumbered id -> logical expert
    node_load = load.gather(1, new_to_expert).view(layers * nodes, node_experts)

    # 2. each node's redundant slots to its experts with the highest load per replica
    slot_new, replicas = _replicate(node_load, node_slots)  # (layers*nodes, node_slots), (layers*nodes, node_experts)

    # 3. the node's replicas onto its devices, evenly by load per replica
    slot_load = (node_load / replicas).gather(1, slot_new)  # (layers*nodes, node_slots)
    device, rank = _pack(slot_load, node_devices)
    placed = device * (node_slots // node_devices) + rank  # (layers*nodes, node_slots): where each slot goes
    placed_new = torch.empty_like(slot_new).scatter_(1, placed, slot_new)
    placed_new = placed_new.view(layers, nodes, node_slots) + node_experts * torch.arange(nodes)[:, None]
    slot_expert = new_to_expert.gather(1, placed_new.view(layers, slots))
    return slot_expert, torch.empty_like(replicas.view(layers, experts)).scatter_(1, new_to_expert,
                                                                                  replicas.view(layers, experts))


def _pack(weight: torch.Tensor, packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items (rows, items) into `packs` packs of items/packs each: heaviest first, each into the lightest pack with
    room. Returns each item's pack and its position in the pack, both (rows, items)."""
    rows, items = weight.shape
    per_pack = items // packs
    pack = torch.empty(rows, items, dtype=torch.int64)
    position = torch.empty(rows, items, dtype=torch.int64)
    for row in range(rows):
        loads, counts = [0.0] * packs, [0] * packs
        for item in torch.argsort(weight[row], descending=True, stable=True).tolist():
            target = min((p for p in range(packs) if counts[p] < per_pack), key=lambda p: loads[p])
            pack[row, item], position[row, item] = target, counts[target]
            loads[target] += float(weight[row, item])
            counts[target] += 1
    return pack, position


def _replicate(weight: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots for items (rows, items): one each, then each further slot to the item of the highest weight per
    replica. Returns each slot's item (rows, slots) and each item's replica count (rows, items)."""
    rows, items = weight.shape
    slot_item = torch.arange(slots).remainder(items).expand(rows, slots).clone()
    replicas = torch.ones(rows, items, dtype=torch.int64)
    every_row = torch.arange(rows)
    for slot in range(items, slots):
        hottest = (weight / replicas).argmax(dim=1)  # (rows,): the first of equals
        slot_item[:, slot] = hottest
        replicas[every_row, hottest] += 1
    return slot_item, replicas
