"""Waiting on a state, for the tests: one poll loop instead of a copy in every file.

A test waits for a condition (a counter reached, a process gone, a member seen), never for the clock. The
deadline only ends a hang, so that a broken build fails instead of stalling the run: it never decides a test,
and is generous for that reason. Where a bound does mean something (a deregistration told apart from a lease
expiry), the call passes its own `timeout_s`.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _hang(what: str, timeout_s: float) -> AssertionError:
    return AssertionError(f"hang guard: {what} did not happen within {timeout_s:g} s")


def wait_for(condition: Callable[[], T], what: str, timeout_s: float = 60.0, interval_s: float = 0.02) -> T:
    """Poll `condition()` until it returns a truthy value, and return that value.

    `what` names what is awaited, for the failure. The deadline, `timeout_s`, only ends a hang: a test waits on
    a state, not on the clock, so passing the deadline raises AssertionError as a hang, never as a verdict.
    """
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise _hang(what, timeout_s)
        time.sleep(interval_s)
    return value


async def wait_for_async(condition: Callable[[], T], what: str, timeout_s: float = 60.0,
                         interval_s: float = 0.02) -> T:
    """`wait_for` on an event loop: sleeps with asyncio.sleep, so that the tasks that make `condition` true run
    meanwhile on the same loop."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise _hang(what, timeout_s)
        await asyncio.sleep(interval_s)
    return value


def parked_in(thread: threading.Thread, function: Callable) -> bool:
    """Whether `thread` is parked on a threading.Condition inside `function`: it found what it waits for not
    there yet and went to sleep on it. A "not yet" check made once this is true sees the thread past the point
    where it would have gone on, instead of guessing how long it needs to get there."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None or frame.f_code is not threading.Condition.wait.__code__:
        return False
    while frame is not None and frame.f_code is not function.__code__:
        frame = frame.f_back
    return frame is not None
