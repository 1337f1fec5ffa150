"""The fair gate between tenants and the engines (engine/api/fair.py): a tenant flooding the server never takes
the reserve another tenant enters by, and a free slot goes to the waiting tenant holding fewest."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.api.fair import FairGate

pytestmark = pytest.mark.unit


async def hold(gate: FairGate, tenant: str, entered: list, release: asyncio.Event) -> None:
    async with gate.slot(tenant):
        entered.append(tenant)
        await release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_flooding_tenant_never_takes_the_reserve_and_another_enters_at_once():
    async def run() -> None:
        gate, entered, release = FairGate(slots=8, reserve=2), [], asyncio.Event()
        flood = [asyncio.ensure_future(hold(gate, "a", entered, release)) for _ in range(20)]
        await settle()
        assert entered == ["a"] * 6 and gate.waiting == 14, "alone, a tenant still leaves the reserve"
        interactive = asyncio.ensure_future(hold(gate, "b", entered, release))
        await settle()
        assert entered[-1] == "b", "another tenant is admitted at once, into the reserve"
        release.set()
        await asyncio.gather(*flood, interactive)
        assert entered.count("a") == 20 and not gate.held and gate.waiting == 0

    asyncio.run(run())


def test_a_free_slot_goes_to_the_waiting_tenant_holding_fewest():
    async def run() -> None:
        gate, entered = FairGate(slots=4, reserve=1), []
        releases = {t: asyncio.Event() for t in "abc"}
        tasks = [asyncio.ensure_future(hold(gate, "a", entered, releases["a"])) for _ in range(6)]
        tasks += [asyncio.ensure_future(hold(gate, "b", entered, releases["b"])) for _ in range(3)]
        await settle()
        assert sorted(entered) == ["a", "a", "a", "b"]  # a at its cap of 3; b takes the fourth
        tasks.append(asyncio.ensure_future(hold(gate, "c", entered, releases["c"])))
        await settle()
        releases["a"].set()  # a's end: the first slot goes to c, which holds none, though a's waiters
        await settle()     # queued first
        assert entered[4] == "c"
        for event in releases.values():
            event.set()
        await asyncio.gather(*tasks)
        assert not gate.held and gate.waiting == 0

    asyncio.run(run())


def test_a_request_cancelled_while_waiting_gives_up_its_place():
    async def run() -> None:
        gate, entered, release = FairGate(slots=2, reserve=0), [], asyncio.Event()
        running = [asyncio.ensure_future(hold(gate, "a", entered, release)) for _ in range(2)]
        waiting = asyncio.ensure_future(hold(gate, "a", entered, release))
        await settle()
        assert gate.waiting == 1
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert gate.waiting == 0
        release.set()
        await asyncio.gather(*running)
        assert not gate.held and entered == ["a", "a"]

    asyncio.run(run())


def test_a_waiter_cancelled_as_a_slot_frees_is_skipped():
    """Both at once, as at a shutdown: the slot goes to the next waiter, never to the cancelled one."""
    async def run() -> None:
        gate, entered, release = FairGate(slots=1, reserve=0), [], asyncio.Event()
        first = asyncio.ensure_future(hold(gate, "a", entered, release))
        await settle()
        doomed = asyncio.ensure_future(hold(gate, "b", entered, release))
        after = asyncio.ensure_future(hold(gate, "c", entered, release))
        await settle()
        first.cancel()  # first's clean-up frees the slot on its next turn, before ...
        doomed.cancel()  # ... b's runs, though b's future is cancelled at once
        for task in (first, doomed):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        release.set()
        await after
        assert entered == ["a", "c"] and not gate.held and gate.waiting == 0

    asyncio.run(run())


def test_the_reserve_must_leave_a_slot():
    with pytest.raises(ValueError, match="reserve"):
        FairGate(slots=4, reserve=4)
