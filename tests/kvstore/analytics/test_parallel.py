"""Replays side by side in worker processes: the same figures as one after the other, and no worker outlives
the command, whether it is interrupted or killed."""

import contextlib
import json
import os
import pty
import re
import signal
import subprocess
import sys

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


def slow_trace(path, requests=48_000, conversations=3_989):
    """Long prompts of many branching conversations: an adaptive replay of it takes seconds (14 s on a 2-core
    VM), where the command reads it and replays the infinite cache in about one."""
    lines = []
    for i in range(requests):
        conversation = i % conversations
        turn = i // conversations
        ids = [conversation * 10_000 + j for j in range(8 + 3 * turn)] + [10**9 + i]
        lines.append(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


REPLAYING = re.compile(r"replays, [1-9][\d,]*/")  # the progress bar counts requests the workers replayed


def start_replay(trace):
    """The command in a process group of its own, as a shell runs it, its stderr a terminal so that it draws
    its progress bar, with two workers in replays that take many seconds (adaptive's, at 1% and 2%).

    Returns once the bar counts replayed requests: the workers are replaying, and the adaptive replays are
    far from done, so whatever the test does next reaches them while they run."""
    command = [sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(trace), "--policies", "adaptive",
               "--capacity", "1%,2%", "--jobs", "2"]
    terminal, stderr = pty.openpty()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    os.close(stderr)  # the command and its workers hold it; the terminal reads end of file once they are gone
    shown = ""
    while not REPLAYING.search(shown):
        chunk = read(terminal)
        assert chunk, f"the command ended before replaying: {shown}{process.communicate()}"
        shown += chunk
    return process, terminal, psutil.Process(process.pid).children()


def read(terminal):
    """What the command wrote to its terminal next; "" once no process holds it."""
    try:
        return os.read(terminal, 4096).decode(errors="replace")
    except OSError:  # EIO: every writer closed it
        return ""


def read_to_the_end(terminal):
    text = ""
    while chunk := read(terminal):
        text += chunk
    os.close(terminal)
    return text


def running(process):
    return process.is_running() and process.status() != psutil.STATUS_ZOMBIE


def frozen(process, workers):
    """SIGSTOP the command's whole group and check that the command and both workers are there: whatever the
    test sends next reaches replays that are under way, however slow or fast the machine is."""
    os.killpg(process.pid, signal.SIGSTOP)
    if not (process.poll() is None and len(workers) == 2 and all(running(w) for w in workers)):
        ended(process)
        raise AssertionError("the command and its two workers must be alive before the signal")


def ended(process):
    """Whatever is left of the command's group killed (a stopped process takes SIGKILL too): no process this
    test started outlives it, whether it passed or not."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def wait_gone(processes):
    """Until every process has ended. A pool worker that misses its parent's end never ends at all (it waits
    for the next task of a pool whose queue it holds open itself), so this waits on that event: the bound is
    only there to fail a test that would otherwise hang."""
    _, alive = psutil.wait_procs([p for p in processes if running(p)], timeout=120)
    return not [p for p in alive if running(p)]


def signal_state(pid: int) -> str:
    """The process's blocked and ignored signals as the kernel has them: a command started with SIGINT blocked or
    ignored (inherited from whatever started it) cannot see a Ctrl-C."""
    with open(f"/proc/{pid}/status") as status:
        return " ".join(line.strip() for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def test_ctrl_c_stops_every_replay_with_one_line_and_exit_130(tmp_path):
    process, terminal, workers = start_replay(slow_trace(tmp_path / "trace.jsonl"))
    try:
        frozen(process, workers)
        state = signal_state(process.pid)  # seen once under xdist on a busy machine: exit 0, Ctrl-C unseen
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group, workers too (pending...)
        os.killpg(process.pid, signal.SIGCONT)  # ...until the group runs again
        err = read_to_the_end(terminal)
        process.communicate(timeout=120)
        assert process.returncode == 130 and err.strip().endswith("kvstore analytics: interrupted"), \
            f"{state}; {err[-2000:]}"
        assert "Traceback" not in err
        assert wait_gone(workers), "workers outlived the interrupted command"
    finally:
        ended(process)


def test_workers_end_when_the_command_is_killed(tmp_path):
    process, terminal, workers = start_replay(slow_trace(tmp_path / "trace.jsonl"))
    try:
        frozen(process, workers)
        process.kill()  # the command alone, as the OOM killer would
        for worker in workers:
            worker.send_signal(signal.SIGCONT)
        # They notice within 1,024 requests; one that did not would wait for a next task forever.
        assert wait_gone(workers), "workers outlived the killed command"
        process.communicate(timeout=120)  # its stdout reaches end of file once the workers, which share it, are gone
    finally:
        ended(process)
        for worker in workers:
            if running(worker):
                worker.kill()
        read_to_the_end(terminal)
