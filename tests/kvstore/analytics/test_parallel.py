"""Replays side by side in worker processes: the same figures as one after the other, and no worker outlives
the command, whether it is interrupted or killed."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from kvstore.analytics.parallel import Job, Progress, replay_many
from kvstore.analytics.simulate import replay
from kvstore.analytics.workloads import generate

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def trace():
    return generate("mix", seed=3, scale=0.15)


class Counted(Progress):
    def __init__(self):
        self.replayed, self.done = 0, []

    def requests(self, replayed):
        assert replayed >= self.replayed, "the count only grows"
        self.replayed = replayed

    def finished(self, job, seconds):
        assert seconds >= 0
        self.done.append(job)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_side_by_side_the_figures_are_those_of_one_replay_after_the_other(trace, workers):
    unique = len({key for r in trace for key in r.hash_ids})
    jobs = [Job(policy, max(1, unique * share // 100), f"{share}%")
            for share in (2, 10) for policy in ("lru", "prefix-reuse", "adaptive", "belady")]
    progress = Counted()
    got = replay_many(trace, jobs, workers, progress, ttl_s={"chat": 600.0}, continuation_signal=0.9)
    assert got == [replay(trace, job.policy, job.capacity_blocks, ttl_s={"chat": 600.0},
                          continuation_signal=0.9).as_dict() for job in jobs]
    assert sorted(progress.done, key=jobs.index) == jobs
    assert progress.replayed == len(jobs) * len(trace)


def test_an_error_in_a_worker_is_raised_in_the_caller(trace):
    with pytest.raises(ValueError, match="capacity must be at least one block"):
        replay_many(trace, [Job("lru", 10), Job("sieve", 0)], 2)
    with pytest.raises(ValueError, match="workers must be at least 1"):
        replay_many(trace, [Job("lru", 10)], 0)


def slow_trace(path, requests=12_000):
    """Long prompts of many branching conversations: a prefix-reuse replay of it takes seconds."""
    lines = []
    for i in range(requests):
        conversation = i % 997
        turn = i // 997
        ids = [conversation * 10_000 + j for j in range(8 + 3 * turn)] + [10**9 + i]
        lines.append(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def start_replay(trace):
    """The command in a process group of its own, as a shell runs it, with two workers each in a replay that
    takes seconds (adaptive's, at 1% and 2%)."""
    command = [sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(trace), "--policies", "adaptive",
               "--capacity", "1%,2%", "--jobs", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    parent = psutil.Process(process.pid)
    deadline = time.monotonic() + 60
    while len(parent.children()) < 2:  # the workers are up, and replaying
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    return process, parent.children()


def gone(processes, within_s):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes):
            return True
        time.sleep(0.05)
    return False


def test_ctrl_c_stops_every_replay_with_one_line_and_exit_130(tmp_path):
    process, workers = start_replay(slow_trace(tmp_path / "trace.jsonl"))
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group, workers too
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130 and err.strip().endswith("kvstore analytics: interrupted"), err
    assert "Traceback" not in err
    assert gone(workers, 4.0), "workers outlived the interrupted command"


def test_workers_end_when_the_command_is_killed(tmp_path):
    process, workers = start_replay(slow_trace(tmp_path / "trace.jsonl"))
    process.kill()  # the command alone, as the OOM killer would
    process.communicate(timeout=30)
    try:  # they notice within 1,024 requests (under a second), where their replays go on for seconds more
        assert gone(workers, 4.0), "workers outlived the killed command"
    finally:
        for worker in workers:
            if worker.is_running():
                worker.kill()
