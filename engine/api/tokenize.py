"""Prompt encoding off the event loop, in worker processes that each hold the tokenizer.

A chat template and a tokenizer hold the GIL for as long as they run (tens of milliseconds for a 100k
character prompt), so in a thread they would still pause every stream the loop is sending. The workers
are spawned, not forked (the server's process runs torch threads), and import no more than the tokenizer.

A worker ends with the server however the server ends: `close` stops the pool, and each worker watches its
parent and exits once it is gone (SIGKILL, a crash), rather than live on, reparented, holding its tokenizer.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

_tokenizer: Any = None  # in a worker: the tokenizer it loaded
PARENT_POLL_S = 0.5  # how often a worker checks that the server that started it is still there


class PromptEncoder:
    """Encodes chat messages (`engine.text.chat_prompt.encode_chat`) in `workers` processes."""

    def __init__(self, tokenizer_folder: Path | str, workers: int = 2) -> None:
        self.folder, self.workers = str(tokenizer_folder), workers
        self.pool = self._start()
        self.restarts = 0
        self._restarting = asyncio.Lock()

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.workers, multiprocessing.get_context("spawn"), initializer=_load,
                                   initargs=(self.folder, os.getpid()))
        for future in [pool.submit(_ready) for _ in range(self.workers)]:
            future.result()  # each worker has loaded the tokenizer: the first request does not wait for it
        return pool

    async def encode(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt's ids; ChatPromptError for messages the template refuses. A worker that died (the OOM
        killer, a crash) breaks the whole pool: it is started again once, and the request retried."""
        loop = asyncio.get_running_loop()
        pool = self.pool
        try:
            return await loop.run_in_executor(pool, _encode, list(messages))
        except BrokenProcessPool:
            async with self._restarting:
                if self.pool is pool:  # the first request to see it restarts it; the others retry on the new one
                    pool.shutdown(wait=False, cancel_futures=True)
                    self.pool = await loop.run_in_executor(None, self._start)
                    self.restarts += 1
            return await loop.run_in_executor(self.pool, _encode, list(messages))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)  # the workers have exited when this returns

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.pool._processes.values()]  # the executor exposes no public list


def _load(folder: str, server_pid: int) -> None:
    global _tokenizer
    threading.Thread(target=_exit_with, args=(server_pid,), name="parent-watch", daemon=True).start()
    import transformers

    _tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    _encode([{"role": "user", "content": "x"}])  # the content tokenizer is made on first use: not on a request's time


def _exit_with(server_pid: int) -> None:
    """Exit once the server is gone: this process is then another's child (init's, or a subreaper's)."""
    while os.getppid() == server_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def _ready() -> bool:
    return _tokenizer is not None


def _encode(messages: list[dict[str, str]]) -> list[int]:
    from engine.text.chat_prompt import encode_chat

    return encode_chat(_tokenizer, messages)
