"""A decode engine serving a MoE model with its experts spread over real gloo ranks (this process rank 0, spawned
followers): greedy replies are the one-process engine's token for token, with rebalancing every few steps, and the
followers end when the engine is closed or when its process is killed.

Marked `experts` (make test-experts): each case spawns 1 or 2 followers that import torch."""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time

import psutil
import pytest
import torch

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
from engine.experts.decoder import ExpertParallelConfig
from engine.model.decoder import Decoder
from tests.engine.decode.conftest import drive, tokens
from tests.engine.experts import ranks as rank_main

pytestmark = pytest.mark.experts

REPLY = 16
# several lengths, joining at different steps (two in one step): prompts prefill beside decoding sequences
JOINS = {0: [7], 2: [30, 3], 5: [12]}
DEADLINE_S = 60.0  # for a killed rank 0's follower to end (it reads EOF at once; this only bounds a failure)


def _drive(engine: DecodeEngine) -> list[list[int]]:
    results = drive(engine, {step: [DecodeRequest(tokens(n, seed=n), SamplingParams(max_tokens=REPLY))
                                    for n in lengths] for step, lengths in JOINS.items()})
    return [results[i].tokens for i in range(len(results))]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:  # a zombie has ended: its parent reaps it
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("ranks, speculative", [(2, False), (3, True)])
def test_served_replies_equal_one_process_with_rebalancing(tiny_models, ranks, speculative):
    model = Decoder.from_pretrained(tiny_models["gpt_oss"].path, torch.float32)
    # speculation with a fixed draft count: the chunks differ from plain steps, the SPS profile is not needed
    common = dict(block_tokens=16, kv_pages=64, speculative=speculative, fixed_drafts=3 if speculative else None)
    expected = _drive(DecodeEngine(model, None, DecodeConfig(**common)))
    # 4 experts + 2 redundant slots: 3 slots a rank at 2 ranks, 2 at 3
    engine = DecodeEngine(model, None, DecodeConfig(**common, expert_ranks=ranks, experts=ExpertParallelConfig(
        redundant_slots=2, window_steps=4, rebalance_every=3)))
    assert engine.experts is not None
    followers = engine.experts.followers
    assert len(followers) == ranks - 1 and len(_alive(followers)) == ranks - 1
    try:
        served = _drive(engine)
        rebalances = list(engine.experts.model.rebalances)
    finally:
        engine.close()
    assert served == expected
    assert len(rebalances) >= 3, "a rebalance every 3 steps"
    assert sum(report.moved.slots_changed for report in rebalances) > 0, "the recorded loads moved experts"
    # joined by close: gone, not even zombies, and no other child of this process is a follower
    children = {child.pid for child in psutil.Process().children(recursive=True)}
    assert not set(followers) & children
    with pytest.raises(RuntimeError, match="stopped"):
        engine.experts.begin_step()


def test_followers_end_when_rank_0_is_killed(tiny_models):
    context = mp.get_context("spawn")
    pids: mp.Queue = context.Queue()
    # not daemonic: a daemonic process may not start the followers; killed below whatever happens
    rank_0 = context.Process(target=rank_main.serve_then_wait, args=(tiny_models["gpt_oss"].path, pids))
    rank_0.start()
    try:
        followers = None
        while followers is None and rank_0.is_alive():  # a rank 0 that fails ends the wait (its error on stderr)
            try:
                followers = pids.get(timeout=1)
            except queue.Empty:
                pass
        assert followers is not None, f"rank 0 ended with {rank_0.exitcode} before serving"
        assert len(_alive(followers)) == 1
    finally:
        rank_0.kill()  # SIGKILL: no atexit runs, nothing tells the follower but its pipe's end
        rank_0.join(10)
    assert rank_0.exitcode == -signal.SIGKILL
    deadline = time.monotonic() + DEADLINE_S
    while _alive(followers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(followers), "the follower outlived its killed rank 0"
