"""Many replays of one trace at once: worker processes forked after the trace is read.

A replay is single-threaded Python, so `kvstore analytics replay` of every policy at every capacity runs
them side by side, one per worker. The workers are forked once the trace is in memory and read it from
there (copy-on-write) instead of each reading or unpickling it again; each still copies the pages its
reading touches, so memory is about workers x (trace + one policy's state). They report the requests
they have replayed through one shared counter, which the parent turns into one progress line, and they
end with the parent: they ignore Ctrl-C (the parent stops them) and leave once it is gone.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.analytics.simulate import replay
from kvstore.analytics.trace import Request

_REPORT_EVERY = 1024  # requests a worker replays between two updates of the shared counter

# set in the parent before the workers fork; the workers read them
_requests: Sequence[Request] = ()
_options: dict = {}
_replayed = None  # multiprocessing.Value: requests replayed over every replay
_parent = 0


@dataclass(frozen=True)
class Job:
    policy: str
    capacity_blocks: int
    label: str = ""  # the capacity as the user gave it ("10%")


class Progress:
    """What the caller is told while replays run: requests replayed over all of them, and each replay done."""

    def requests(self, replayed: int) -> None:
        pass

    def finished(self, job: Job, seconds: float) -> None:
        """`job` is done, after `seconds` of replaying."""


def replay_many(requests: Sequence[Request], jobs: Sequence[Job], workers: int, progress: Progress | None = None,
                **options) -> list[dict]:
    """`replay(requests, job.policy, job.capacity_blocks, **options).as_dict()` for every job, in the order
    given, over `workers` processes (in this one when `workers` is 1)."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    progress = progress or Progress()
    if workers == 1 or len(jobs) == 1:
        return _in_this_process(requests, jobs, progress, options)
    global _requests, _options, _replayed, _parent
    context = multiprocessing.get_context("fork")
    _requests, _options, _replayed, _parent = requests, options, context.Value("q", 0), os.getpid()
    gc.freeze()  # the trace's objects stay out of the collector's sweeps, which would touch (copy) their pages
    pool = context.Pool(min(workers, len(jobs)), initializer=_ignore_interrupts)
    try:
        pending = {index: pool.apply_async(_replay_one, (job,)) for index, job in enumerate(jobs)}
        results: list[dict | None] = [None] * len(jobs)
        while pending:
            time.sleep(0.1)
            progress.requests(_replayed.value)
            for index in [i for i, result in pending.items() if result.ready()]:
                results[index], seconds = pending.pop(index).get()  # raises what the replay raised
                progress.finished(jobs[index], seconds)
        progress.requests(_replayed.value)  # every request of every replay
        pool.close()
        return results  # type: ignore[return-value]
    finally:
        pool.terminate()  # at once on Ctrl-C or an error; after close() the workers are already gone
        pool.join()
        gc.unfreeze()
        _requests, _options, _replayed = (), {}, None


def _in_this_process(requests: Sequence[Request], jobs: Sequence[Job], progress: Progress,
                     options: dict) -> list[dict]:
    results, before = [], 0
    for job in jobs:
        started = time.monotonic()
        results.append(replay(requests, job.policy, job.capacity_blocks, progress=_after(before, progress),
                              **options).as_dict())
        before += len(requests)
        progress.finished(job, time.monotonic() - started)
    return results


def _after(before: int, progress: Progress) -> Callable[[int], None]:
    """A replay's progress callback that tells `progress` of its requests after `before` already replayed."""
    return lambda done: progress.requests(before + done)


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent handles it


def _replay_one(job: Job) -> tuple[dict, float]:
    started, counted = time.monotonic(), 0
    total, replayed = len(_requests), _replayed
    assert replayed is not None, "replay_many sets the counter before it forks the workers"

    def count(done: int) -> None:
        nonlocal counted
        if done - counted >= _REPORT_EVERY or done == total:
            if os.getppid() != _parent:  # the parent is gone (killed): nobody waits for this replay
                os._exit(1)
            with replayed.get_lock():
                replayed.value += done - counted
            counted = done

    result = replay(_requests, job.policy, job.capacity_blocks, progress=count, **_options).as_dict()
    return result, time.monotonic() - started
