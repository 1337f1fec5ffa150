"""The end every daemon a test started must reach: a graceful stop with exit code 0 and no traceback in its log.

A crash in a daemon's background task (eviction, compaction, the sweep) answers no request, so only the daemon's
exit code and log can show it; fixtures that start daemons end them through `stop_clean`."""

from __future__ import annotations

import signal

from kvstore.server.process import DaemonProcess


def stop_clean(daemon: DaemonProcess, *, killed_on_purpose: bool = False) -> list[str]:
    """Stop `daemon` (SIGTERM, or SIGKILL when that times out) and return what was wrong with its end: a nonzero
    exit code, unless the test killed it on purpose and left it dead, and any traceback in its log."""
    problems = []
    was_dead = daemon.proc is not None and daemon.proc.poll() is not None
    try:
        code = daemon.stop()
    except Exception as exc:  # the stop itself timed out: stop() killed it
        daemon.kill()
        problems.append(f"{daemon.data_dir.name} did not stop on SIGTERM: {exc!r}")
    else:
        # A fault point's kill can land while the stop drains a Get that was still reading: a test that kills on
        # purpose accepts SIGKILL's code whenever it comes.
        if code != 0 and not (killed_on_purpose and (was_dead or code == -signal.SIGKILL)):
            problems.append(f"{daemon.data_dir.name} exited with {code}")
    log = daemon.log()
    if "Traceback" in log:
        problems.append(f"{daemon.data_dir.name} logged a traceback")
    if problems:
        problems.append(f"its log ({daemon.log_path}), last 3000 characters:\n{log[-3000:]}")
    return problems

