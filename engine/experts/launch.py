"""Ranks as processes on this host: a gloo (or NCCL) group on loopback, for tests and benchmarks.

Every process started here ends with the call: daemonic, joined with a deadline, terminated past it.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
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
