"""What each rank runs in the multi-process tests (spawned processes import it by name)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
from engine.experts.decoder import ExpertParallelConfig, ExpertParallelDecoder
from engine.model.config import ModelConfig
from engine.model.decoder import Chunk, Decoder
from engine.model.kv import PagePool, RequestKV
from engine.model.weights import load_weights


def skewed_load(config: ModelConfig) -> torch.Tensor:
    """(layers, experts): expert 0 takes most tokens, a different second favourite per layer, so a plan from it
    differs from the uniform start."""
    load = torch.ones(config.num_layers, config.num_experts)
    load[:, 0] = 50
    load[torch.arange(config.num_layers), 1 + torch.arange(config.num_layers) % (config.num_experts - 1)] += 20
    return load


def moe_layer(rank: int, ranks: int, path: Path, redundant: int) -> dict:
    """Each rank routes its own random tokens (a different count per rank) through every MoE layer, expert-parallel,
    before and after a rebalance to a skewed plan; the largest difference from the single-process layer."""
    config = ModelConfig.from_file(path)
    weights = load_weights(path, config, torch.float32, "cpu")
    reference = Decoder(config, dict(weights))
    parallel = ExpertParallelDecoder(config, weights, ExpertParallelConfig(redundant_slots=redundant))
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(3 + 2 * rank, config.hidden_size, generator=generator)  # (T, hidden), T differs per rank

    def worst() -> float:
        return max(float((parallel._moe(f"layers.{layer}.", x) - reference._moe(f"layers.{layer}.", x)).abs().max())
                   for layer in range(config.num_layers))

    before = worst()
    moved = parallel.rebalance(skewed_load(config)).moved  # weights travel to the skewed plan's ranks
    return {"before": before, "after": worst(), "slots_changed": moved.slots_changed,
            "received": moved.bytes_received, "replicas": parallel.experts.plan.replicas.tolist()}


def greedy(rank: int, ranks: int, path: Path, prompts: list[list[int]], n_tokens: int, redundant: int,
           rebalance_every: int) -> dict:
    """Greedy decoding of prompts[rank], every rank in step (one forward each per step, `end_step` after it, which
    rebalances every `rebalance_every` steps from the group's recorded loads)."""
    parallel = ExpertParallelDecoder.from_pretrained_parallel(
        path, ExpertParallelConfig(redundant_slots=redundant, window_steps=4, rebalance_every=rebalance_every),
        dtype="float32")
    prompt = prompts[rank]
    pool = PagePool(parallel.config, 4, 256, parallel.dtype, parallel.device)
    kv = RequestKV(parallel.config, pool)
    kv.reserve(len(prompt) + n_tokens)
    (logits,) = parallel.forward([Chunk(kv, torch.tensor(prompt), 0)])
    parallel.end_step()
    reply = [int(logits.argmax())]
    while len(reply) < n_tokens:
        (logits,) = parallel.forward([Chunk(kv, torch.tensor(reply[-1:]), len(prompt) + len(reply) - 1)])
        parallel.end_step()
        reply.append(int(logits.argmax()))
    kv.release()
    return {"reply": reply, "changed": [r.moved.slots_changed for r in parallel.rebalances]}


def serve_then_wait(path: Path, pids: Any) -> None:
    """Rank 0 of a serving engine with one follower: serve one greedy request, put the follower's pid on `pids`,
    then wait to be killed (the test kills this process; its follower must end with it)."""
    torch.set_num_threads(1)
    engine = DecodeEngine(Decoder.from_pretrained(path, torch.float32), None,
                          DecodeConfig(block_tokens=16, kv_pages=16, speculative=False, expert_ranks=2))
    engine.submit(DecodeRequest([5, 17, 300], SamplingParams(max_tokens=4)))
    engine.run()
    assert engine.experts is not None
    pids.put(engine.experts.followers)
    time.sleep(600)
