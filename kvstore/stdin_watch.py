"""End a process when its stdin ends: the parent holding the other end of the pipe died or closed it.

However a parent ends (SIGKILL included), the kernel closes its end of the pipe, so a child started with
stdin on a pipe learns of it without PR_SET_PDEATHSIG, which a child can only be given between fork and
exec (`preexec_fn`, unsafe in a parent that runs threads)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable


def watch_stdin(ended: Callable[[], object]) -> threading.Thread:
    """Call `ended()` from a daemon thread once stdin reaches its end (or cannot be read)."""
    thread = threading.Thread(target=_read_until_end, args=(ended,), name="stdin-watch", daemon=True)
    thread.start()
    return thread


def _read_until_end(ended: Callable[[], object]) -> None:
    # the raw descriptor, not sys.stdin: a daemon thread blocked inside a buffered reader aborts the
    # interpreter's exit (it cannot take the buffer's lock)
    try:
        while os.read(sys.stdin.fileno(), 4096):
            pass
    except (OSError, ValueError):
        pass
    ended()
