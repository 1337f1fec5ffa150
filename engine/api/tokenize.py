"""Prompt encoding off the event loop, in worker processes that each hold the tokenizer.

A chat template and a tokenizer hold the GIL for as long as they run (tens of milliseconds for a 100k
character prompt), so in a thread they would still pause every stream the loop is sending. The workers
are spawned, not forked (the server's process runs torch threads), and import no more than the tokenizer.

What the workers cannot do is refused before they see it: a prompt of more characters than the model's
context times the longest token of the vocabulary (in characters) cannot fit, whatever it encodes to. The
rest waits for a worker in a fair queue: no more jobs go to the pool than it has workers, and a free worker
takes the waiting job of the tenant that has had the fewest characters encoded (start-time fair queueing on
characters), so one tenant's many huge prompts delay another's prompt by about one job, not by all of them.

A worker ends with the server however the server ends: `close` stops the pool, and each worker watches its
parent and exits once it is gone (SIGKILL, a crash), rather than live on, reparented, holding its tokenizer.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Mapping, Sequence
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
        self.jobs = 0  # prompts sent to the workers
        self._restarting = asyncio.Lock()
        self.queue = FairQueue(workers)
        # characters past which a prompt cannot fit the context, whatever its tokens (None: no context known)
        context = _context(Path(self.folder))
        self.max_chars = None if context is None else context * self.pool.submit(_longest_token).result()
        self.context = context

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.workers, multiprocessing.get_context("spawn"), initializer=_load,
                                   initargs=(self.folder, os.getpid()))
        for future in [pool.submit(_ready) for _ in range(self.workers)]:
            future.result()  # each worker has loaded the tokenizer: the first request does not wait for it
        return pool

    async def encode(self, messages: Sequence[Mapping[str, Any]], tenant: str | None = None,
                     image_tokens: int = 0) -> list[int]:
        """The prompt's ids; ChatPromptError for messages the template refuses or too long to fit the context.
        `tenant` (default: the request's, engine.api.metrics.TENANT) waits its fair turn for a worker. With
        `image_tokens`, each image mark is an image's placeholders (engine.text.chat_prompt)."""
        from engine.api.metrics import TENANT
        from engine.text.chat_prompt import ChatPromptError

        chars = sum(len(m.get("content") or "") for m in messages)
        if self.max_chars is not None and chars > self.max_chars:  # refused without a worker's time
            raise ChatPromptError(f"a prompt of {chars} characters is longer than the model's context of "
                                  f"{self.context} tokens can hold (at most {self.max_chars} characters)")
        await self.queue.acquire(TENANT.get() if tenant is None else tenant, chars + 1)
        self.jobs += 1
        job = asyncio.ensure_future(self._encode(messages, image_tokens))
        job.add_done_callback(self._done)  # a worker is free when its job ends, not when its client leaves
        return await asyncio.shield(job)

    def _done(self, job: asyncio.Future) -> None:
        self.queue.release()
        if not job.cancelled():
            job.exception()  # a job whose client left: its error is nobody's to raise

    async def _encode(self, messages: Sequence[Mapping[str, Any]], image_tokens: int = 0) -> list[int]:
        """A worker that died (the OOM killer, a crash) breaks the whole pool: it is started again once, and
        the request retried."""
        loop = asyncio.get_running_loop()
        pool = self.pool
        try:
            return await loop.run_in_executor(pool, _encode, list(messages), image_tokens)
        except BrokenProcessPool:
            async with self._restarting:
                if self.pool is pool:  # the first request to see it restarts it; the others retry on the new one
                    pool.shutdown(wait=False, cancel_futures=True)
                    self.pool = await loop.run_in_executor(None, self._start)
                    self.restarts += 1
            return await loop.run_in_executor(self.pool, _encode, list(messages), image_tokens)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)  # the workers have exited when this returns

    def worker_pids(self) -> list[int]:
        # the executor exposes no public list; a started worker has its pid
        return [p.pid for p in self.pool._processes.values() if p.pid is not None]


class FairQueue:
    """`slots` at once, given out by start-time fair queueing: a job's start tag is where its tenant's jobs
    before it end (or the tag now being served, if later), it ends `cost` later, and the waiting job with the
    smallest start tag goes next. Used from one asyncio loop."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.now = 0.0  # the start tag of the job last let in
        self.ends: dict[str, float] = {}  # tenant -> where its last job queued ends
        self.waiting: list[tuple[float, int, asyncio.Future]] = []  # (start tag, order, its future)
        self._order = itertools.count()

    async def acquire(self, tenant: str, cost: float) -> None:
        """Wait for the job's turn; `release` once it is done."""
        start = max(self.now, self.ends.get(tenant, 0.0))
        self.ends[tenant] = start + cost
        if self.free > 0 and not self.waiting:
            self.free -= 1
            self.now = start
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self.waiting, (start, next(self._order), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # let in as it was cancelled: the turn passes on
                self.release()
            raise

    def release(self) -> None:
        while self.waiting:
            start, _, future = heapq.heappop(self.waiting)
            if not future.done():  # a waiter whose client left is skipped
                self.now = start
                future.set_result(None)
                return
        self.free += 1
        self.ends = {t: end for t, end in self.ends.items() if end > self.now}  # idle tenants start afresh


def _context(folder: Path) -> int | None:
    """The model's context in tokens, from its config.json (None if it names none)."""
    try:
        return int(json.loads((folder / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _longest_token() -> int:
    """The most characters one token of the vocabulary can stand for: its longest piece (a piece has at least
    one character per character of text it decodes to: SentencePiece's ▁ is one space, a byte-level piece
    one character per byte)."""
    return max(len(piece) for piece in _tokenizer.get_vocab())


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


def _encode(messages: list[Mapping[str, Any]], image_tokens: int = 0) -> list[int]:
    from engine.text.chat_prompt import encode_chat

    return encode_chat(_tokenizer, messages, image_tokens=image_tokens)
