"""A serving decode engine's MoE model with its experts spread over N gloo ranks on this host.

    engine = DecodeEngine(Decoder.from_pretrained(folder), None, DecodeConfig(
        expert_ranks=2, experts=ExpertParallelConfig(redundant_slots=2, rebalance_every=64)))

Rank 0 is the serving process: its `DecodeEngine` schedules every request, and its model is an
`ExpertParallelDecoder` (attention and all else for every sequence, its slots' experts). Ranks 1..N-1 are
followers (`follow`): spawned processes that hold only their slots' experts (`ExpertRank`) and have no sequences of
their own. Each step rank 0 tells every follower, over a pipe, that a step begins (and whether it ends with a
rebalance); each follower then answers every MoE layer's collectives with no tokens (`idle_forward`), closes the
step and, when told, takes part in the rebalance from the recorded loads, after the forward, never inside it.

Why a pipe and not a gloo broadcast: a follower waits for the next step as long as the engine is idle (minutes,
hours), past any collective's timeout, and a pipe reads EOF once rank 0 is gone, whatever ended it (a kill too),
so no follower outlives it. The gloo group (the default group of each process: one such engine a process) carries
only the collectives of a step and of a rebalance, which every rank enters together.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.experts.decoder import (
    ExpertParallelConfig,
    ExpertParallelDecoder,
    ExpertRank,
    RebalanceReport,
    check_layout,
    expert_tensor_names,
)
from engine.experts.launch import Followers, start_followers
from engine.model.config import ModelConfig
from engine.model.decoder import Decoder

# what rank 0 writes to each follower's pipe; one byte, so a step costs each follower one small write
STOP, STEP, STEP_THEN_REBALANCE = b"0", b"1", b"2"
TIMEOUT_S = 120.0  # the group's start and each collective (every rank is inside a step when one runs)
STOP_TIMEOUT_S = 30.0  # a stopped follower leaves its loop and the group; past this it is terminated


class ExpertGroup:
    """Rank 0's side: the expert-parallel model the engine computes with, and the followers it steps."""

    def __init__(self, model: Decoder, ranks: int, parallel: ExpertParallelConfig,
                 timeout_s: float = TIMEOUT_S) -> None:
        """Spread `model`'s experts (a plain `Decoder` of a MoE model, every expert in it) over `ranks` ranks:
        this process joins as rank 0, the followers are spawned. Raises ValueError for a dense model, experts that
        do not divide among the ranks, or a model that is already expert-parallel; RuntimeError if this process
        already has a process group."""
        if isinstance(model, ExpertParallelDecoder):
            raise ValueError("expert_ranks > 1: give the engine the plain Decoder (every expert in it); it builds "
                             "the expert-parallel model and its ranks itself")
        check_layout(model.config, parallel, ranks)
        if dist.is_initialized():
            raise RuntimeError("expert_ranks > 1: this process already has a torch.distributed process group; "
                               "the experts' group is the default group, so one expert-parallel engine a process")
        experts = {name: model.w[name] for name in expert_tensor_names(model.config)}
        # the followers receive every expert once, through shared memory (torch's pickling of tensors), and keep
        # their slots' copies; every follower's pipe is read only by it and written only here
        pipes = [mp.get_context("spawn").Pipe(duplex=False) for _ in range(ranks - 1)]
        self._followers: Followers = start_followers(
            follow, ranks, [(model.config, experts, parallel, reader) for reader, _ in pipes], timeout_s)
        for reader, _ in pipes:
            reader.close()  # the follower has its own copy; EOF on it then means this process is gone
        self._steps: list[Connection] = [writer for _, writer in pipes]
        self._rebalance: bool | None = None  # inside a step: whether it ends with a rebalance; None between steps
        self._stopped = False
        try:
            self.model = ExpertParallelDecoder(model.config, dict(model.w), parallel)
        except BaseException:
            self.stop()
            raise

    @property
    def followers(self) -> list[int]:
        """The followers' process ids, by rank - 1."""
        return [process.pid for process in self._followers.processes if process.pid is not None]

    def begin_step(self) -> None:
        """Before the step's forward: tell every follower a step begins, and whether it ends with a rebalance."""
        if self._stopped:
            raise RuntimeError("the expert-parallel ranks are stopped (the engine was closed)")
        if self._rebalance is not None:
            raise RuntimeError("the expert-parallel ranks are out of step: a forward failed inside a step, and the "
                               "followers may be waiting inside a collective; close the engine and start another")
        if dead := [process.pid for process in self._followers.processes if not process.is_alive()]:
            raise RuntimeError(f"expert-parallel followers {dead} have ended; close the engine and start another"
                               + (f"\n{failure}" if (failure := self._followers.failure()) else ""))
        self._rebalance = self.model.rebalance_due()  # decided here alone, so every rank rebalances together
        for pipe in self._steps:
            pipe.send_bytes(STEP_THEN_REBALANCE if self._rebalance else STEP)

    def end_step(self) -> RebalanceReport | None:
        """After the step's forward, between steps: close the step's statistics and rebalance if it was said to.
        Call it only when the forward returned (`begin_step` refuses the next step otherwise)."""
        assert self._rebalance is not None, "end_step follows begin_step"
        report = self.model.end_step(self._rebalance)
        self._rebalance = None
        return report

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """End the followers and leave the group. A follower caught inside a step (a forward failed) is
        terminated at once: nothing it waits for will come."""
        if self._stopped:
            return
        self._stopped = True
        for pipe in self._steps:
            try:
                pipe.send_bytes(STOP)
            except OSError:  # that follower has ended already
                pass
            pipe.close()
        self._followers.end(0 if self._rebalance is not None else timeout_s)
        dist.destroy_process_group()  # after the followers: rank 0 holds the group's store, which they leave by


def follow(rank: int, ranks: int, config: ModelConfig, experts: dict[str, torch.Tensor],
           parallel: ExpertParallelConfig, steps: Connection) -> int:
    """A follower rank (run by `start_followers` in the group): hold this rank's experts and step when rank 0 says
    so, until it says stop; the steps taken. Exits at once if rank 0 is gone (EOF): nobody waits for it then."""
    expert_rank = ExpertRank(config, experts, parallel)
    taken = 0
    while True:
        try:
            code = steps.recv_bytes()
        except EOFError:
            os._exit(0)  # not destroy_process_group: its store was rank 0's
        if code == STOP:
            return taken
        expert_rank.idle_forward()
        expert_rank.end_step(rebalance=code == STEP_THEN_REBALANCE)
        taken += 1
