"""Ranks as processes on this host: a gloo (or NCCL) group on loopback.

`run_ranks` (tests and benchmarks): every rank spawned, every process ends with the call: daemonic, joined with a
deadline, terminated past it. `start_followers` (a serving engine, engine/experts/serving.py): this process is rank
0 and the others follow it until it ends them (`Followers.end`: a deadline, then terminated).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable[..., Any], ranks: int, *args: Any, timeout_s: float = 120.0,
              backend: str = "gloo") -> list[Any]:
    """target(rank, ranks, *args) in `ranks` spawned processes joined in one process group (the default group);
    their return values by rank. Raises RuntimeError with the rank's traceback if one raises, TimeoutError past
    `timeout_s` (the processes are terminated)."""
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(target, rank, ranks, port, backend, timeout_s, results,
                                                          args), daemon=True) for rank in range(ranks)]
    for process in processes:
        process.start()
    try:
        by_rank: dict[int, Any] = {}
        while len(by_rank) < ranks:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"run_ranks: {ranks - len(by_rank)} of {ranks} ranks gave no result in "
                                   f"{timeout_s} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            by_rank[rank] = value
        for process in processes:
            process.join(timeout_s)
        return [by_rank[rank] for rank in range(ranks)]
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(5)


def _rank_main(target: Callable[..., Any], rank: int, ranks: int, port: int, backend: str, timeout_s: float,
               results: mp.Queue, args: tuple) -> None:
    torch.set_num_threads(1)  # several ranks share a few cores: one thread each, or OpenMP threads spin
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                                timeout=timedelta(seconds=timeout_s))
        try:
            results.put((rank, True, target(rank, ranks, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


@dataclass
class Followers:
    """Ranks 1..N-1 of a group whose rank 0 is this process (`start_followers`)."""

    processes: list[BaseProcess]  # by rank - 1
    results: mp.Queue  # (rank, ok, return value or traceback) as each ends

    def failure(self) -> str | None:
        """The traceback of a follower that raised, if one did (without waiting)."""
        while True:
            try:
                rank, ok, value = self.results.get_nowait()
            except queue.Empty:
                return None
            if not ok:
                return f"rank {rank} failed:\n{value}"

    def end(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the followers to end (told to by their caller), then terminate any left."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)


def start_followers(target: Callable[..., Any], ranks: int, rank_args: Sequence[tuple], timeout_s: float = 120.0,
                    backend: str = "gloo") -> Followers:
    """target(rank, ranks, *rank_args[rank - 1]) in spawned processes for ranks 1..ranks-1, and this process
    joined to their group as rank 0 (the default group, so one such group a process). The followers are daemonic:
    they end with this process's interpreter; a target that must also end when this process is killed watches
    for it (a pipe from here reads EOF). Collectives and the group's start time out after `timeout_s`; the
    followers are terminated if this process fails to join."""
    if len(rank_args) != ranks - 1:
        raise ValueError(f"start_followers: {ranks - 1} followers need {ranks - 1} argument tuples, "
                         f"got {len(rank_args)}")
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    port = free_port()
    followers = Followers([context.Process(target=_rank_main, args=(target, rank, ranks, port, backend, timeout_s,
                                                                     results, rank_args[rank - 1]), daemon=True)
                           for rank in range(1, ranks)], results)
    for process in followers.processes:
        process.start()
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=ranks,
                                timeout=timedelta(seconds=timeout_s))
    except BaseException:
        followers.end(0)
        raise
    return followers
