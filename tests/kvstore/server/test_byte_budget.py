"""The daemon's byte budgets (kvstore/server/limits.py) under cancellation: a waiter whose call is cancelled as its
wait times out must leave the budget's lock as it found it. It once released the lock of whoever held it, then
took the lock for good, and the daemon's puts and Gets waited on that budget forever (a daemon that did not stop
on SIGTERM, found by the daemons fixture's clean-stop check in test_transport_limits.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.server.limits import ByteBudget

pytestmark = pytest.mark.unit


def test_a_waiter_cancelled_as_its_wait_times_out_leaves_the_lock_to_its_holder():
    async def scenario() -> None:
        budget = ByteBudget(100)
        await budget.acquire(100, "holder")
        waiter = asyncio.create_task(budget.acquire(50, "waiter", timeout_s=0.01))
        while not budget._changed._waiters:  # the waiter waits for room, the lock given up meanwhile
            await asyncio.sleep(0)
        async with budget._changed:  # another call inside the budget (a release, say) as the waiter's time ends
            # the event loop runs due timers in deadline order: the waiter's timeout fires before this sleep ends
            await asyncio.sleep(0.05)
            waiter.cancel()  # and its call is cancelled (the client left, the daemon stops) while it undoes its wait
            await asyncio.sleep(0)
            assert budget._changed.locked(), "the waiter released a lock it did not hold"
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not budget._changed.locked(), "the waiter kept the lock"
        await budget.release(100, "holder")
        await budget.acquire(100, "next")  # the budget still serves

    asyncio.run(scenario())
