"""DaemonProcess's children end with the process that started them, however it ends (kvstore/stdin_watch.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvstore.server.process import DaemonProcess
from tests.clean_stop import stop_clean
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for init to reap it has ended
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_daemon_ends_when_its_parent_is_killed(tmp_path):
    # what a demo killed by a timeout (SIGKILL: no handler runs) does to the daemons it started
    script = ("import sys, time\nfrom pathlib import Path\nfrom kvstore.server.process import DaemonProcess\n"
              f"d = DaemonProcess(Path({str(tmp_path)!r}) / 'd', Path({str(tmp_path)!r})).start()\n"
              "print(d.proc.pid, flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    daemon = int(parent.stdout.readline())
    assert _alive(daemon)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    wait_for(lambda: not _alive(daemon), "the daemon ending after its killed parent", timeout_s=20)


def test_the_end_of_stdin_is_a_graceful_shutdown(tmp_path):
    daemon = DaemonProcess(tmp_path / "d", tmp_path).start()
    try:
        daemon.proc.stdin.close()  # what the kernel does when the parent dies
        assert daemon.proc.wait(timeout=30) == 0
        assert "stopped cleanly" in daemon.log()
        problems = stop_clean(daemon)
        assert not problems, "\n".join(problems)
    finally:
        daemon.kill()


def test_a_daemon_tells_where_its_threads_and_tasks_are_and_serves_on(daemons):
    # what DaemonProcess.stop asks of a daemon that does not stop, before it kills it
    (daemon,) = daemons(1)
    daemon.report_stacks()
    wait_for(lambda: "asyncio task" in daemon.log() and "most recent call first" in daemon.log(),
             "the daemon's thread and task stacks in its log")
    assert daemon.proc.poll() is None  # neither signal stops it: it is stopped cleanly at the test's end
