"""In one process (a gloo group of one rank): the expert-parallel decoder equals the plain one, replicas and
rebalancing included, and the replica rule spreads an expert's tokens evenly. Fast; part of make test."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from engine.experts.decoder import ExpertParallelConfig, ExpertParallelDecoder
from engine.experts.launch import free_port
from engine.experts.planner import Plan
from engine.model.config import ModelConfig
from engine.model.decoder import Decoder
from engine.model.weights import load_weights
from tests.engine.experts.ranks import skewed_load
from tests.engine.greedy import greedy

pytestmark = pytest.mark.unit


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def _models(path, redundant: int, rebalance_every: int = 0) -> tuple[Decoder, ExpertParallelDecoder]:
    config = ModelConfig.from_file(path)
    weights = load_weights(path, config, torch.float32, "cpu")
    return Decoder(config, dict(weights)), ExpertParallelDecoder(
        config, weights, ExpertParallelConfig(redundant_slots=redundant, window_steps=2,
                                              rebalance_every=rebalance_every))


def test_moe_layers_equal_with_replicas_before_and_after_a_rebalance(one_rank, tiny_models):
    alone, parallel = _models(tiny_models["gpt_oss"].path, redundant=3)
    x = torch.randn(9, alone.config.hidden_size, generator=torch.Generator().manual_seed(0))  # (T, hidden)
    for load in (None, skewed_load(alone.config)):
        if load is not None:
            report = parallel.rebalance(load)
            assert report.moved.slots_changed > 0
            assert (parallel.experts.plan.replicas[:, 0] >= 2).all(), "the hot expert got replicas"
        for layer in range(alone.config.num_layers):
            p = f"layers.{layer}."
            torch.testing.assert_close(parallel._moe(p, x), alone._moe(p, x), atol=1e-5, rtol=1e-5)


def test_greedy_decoding_with_periodic_rebalancing_is_identical(one_rank, tiny_models):
    alone, parallel = _models(tiny_models["gpt_oss"].path, redundant=2)
    prompt = [5, 17, 300, 41, 2, 99, 123]
    assert greedy(parallel, prompt, 10) == greedy(alone, prompt, 10)  # greedy() calls no end_step: rebalance here
    parallel.rebalance()
    assert greedy(parallel, prompt, 10) == greedy(alone, prompt, 10)
    # the experts' weights now live only in the parallel model's slots, not in its `w`
    assert not any(".mlp.experts." in name for name in parallel.w)


def test_load_statistics_count_every_routed_pair(one_rank, tiny_models):
    _, parallel = _models(tiny_models["gpt_oss"].path, redundant=0)
    greedy(parallel, [5, 17, 300], 1)  # one forward of 3 tokens
    k = parallel.config.experts_per_token
    assert (parallel.stats.window_load().sum(1) == 3 * k).all()


def test_replica_rule_takes_replicas_in_turn(one_rank, tiny_models):
    _, parallel = _models(tiny_models["gpt_oss"].path, redundant=2)
    experts = parallel.config.num_experts
    # expert 0 in slots 0, 4, 5; the others one slot each
    slot_expert = torch.tensor([[0, 1, 2, 3, 0, 0]]).expand(parallel.config.num_layers, -1)
    replicas = torch.tensor([[3] + [1] * (experts - 1)]).expand(parallel.config.num_layers, -1)
    parallel.experts.move_to(Plan(slot_expert.clone(), replicas.clone(), devices=1))
    chosen = torch.tensor([[0, 1], [0, 2], [3, 0], [0, 1], [2, 0], [0, 3], [0, 1]])  # (T, k): expert 0 seven times
    slots = parallel.experts.choose_slots(0, chosen)
    assert slots[chosen == 0].tolist() == [0, 4, 5, 0, 4, 5, 0]  # in token order, replicas in turn
    assert slots[chosen == 3].tolist() == [3, 3]
