"""The API layer's Advisor wired to a real client and daemon: what it advises shows in the daemon's
advised-blocks counters (blocks it holds, by whether their conversation goes on)."""

from __future__ import annotations

import pytest

from engine.api.advice import Advisor
from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient

pytestmark = pytest.mark.integration

LAYOUT = KVLayout(num_layers=1, kv_heads=1, head_dim=8, dtype="float16")
NAMESPACE = Namespace("test-advice", LAYOUT, block_tokens=4)
IDLE_S = {"agent": 60.0, "chat": 600.0}


@pytest.fixture
def store(daemons):
    daemon, = daemons(1)
    with KVClient(ClientConfig((daemon.address,), timeout_s=10)) as client:
        yield client


def turn(store: KVClient, conversation: int, blocks: int) -> list:
    """The first `blocks` full blocks of a conversation, put in the store: a later turn's prompt extends
    an earlier one's."""
    tokens = [conversation * 1000 + t for t in range(blocks * NAMESPACE.block_tokens)]
    out = NAMESPACE.blocks(tokens)
    store.put([(block, bytes(NAMESPACE.block_bytes)) for block in out], LAYOUT.num_layers)
    return out


def advised(store: KVClient) -> tuple[int, int]:
    """Blocks the daemon was advised on: (going on, ended)."""
    stats, = store.server_stats().values()
    return (int(stats.value("kvstore_advised_blocks_total", continues="true")),
            int(stats.value("kvstore_advised_blocks_total", continues="false")))


def test_a_reply_ending_in_a_tool_call_is_advised_going_on_at_once(store):
    advisor = Advisor(store.advise, IDLE_S)
    blocks = turn(store, 1, 3)
    advisor.replied(blocks, "agent", 0.0, goes_on=True)
    assert advised(store) == (3, 0)
    advisor.replied(turn(store, 2, 2), "chat", 0.0)  # a plain reply: nothing is known yet
    assert advised(store) == (3, 0)
    assert advisor.advised["goes_on"] == 1 and advisor.open == 1
    assert advisor.sweep(10**6) == 1 and advised(store) == (3, 2), \
        "the tool call's conversation is never swept as ended: a slow tool must not unsay the advice"


def test_the_next_turn_closes_its_conversation_so_no_sweep_advises_it_ended(store):
    advisor = Advisor(store.advise, IDLE_S)
    advisor.replied(turn(store, 1, 3), "chat", 0.0)
    advisor.replied(turn(store, 1, 5), "chat", 500.0)  # its prompt holds the first reply's blocks
    assert advisor.open == 1
    assert advisor.sweep(700.0) == 0, "the first turn is past the limit but was continued"
    assert advised(store) == (0, 0)
    assert advisor.sweep(1101.0) == 1
    assert advised(store) == (0, 5), "the second turn's blocks, once it idled"


def test_a_conversation_idle_past_its_limit_is_advised_ended_once_and_not_before(store):
    advisor = Advisor(store.advise, IDLE_S)
    blocks = turn(store, 1, 4)
    advisor.replied(blocks, "chat", 100.0)
    assert advisor.sweep(700.0) == 0 and advised(store) == (0, 0)  # idle exactly the limit: not past it
    assert advisor.sweep(701.0) == 1 and advised(store) == (0, 4)
    assert advisor.sweep(5000.0) == 0 and advised(store) == (0, 4)
    assert advisor.advised["idle"] == 1 and advisor.open == 0


def test_each_traffic_class_has_its_own_idle_limit(store):
    advisor = Advisor(store.advise, IDLE_S)
    advisor.replied(turn(store, 1, 2), "chat", 0.0)
    advisor.replied(turn(store, 2, 3), "agent", 100.0)  # younger than the chat, but agents idle out sooner
    assert advisor.sweep(161.0) == 1
    assert advised(store) == (0, 3), "the agent conversation only"
    assert advisor.sweep(601.0) == 1
    assert advised(store) == (0, 5)


def test_a_closed_conversation_is_advised_ended_and_forgotten(store):
    advisor = Advisor(store.advise, IDLE_S)
    blocks = turn(store, 1, 3)
    advisor.replied(blocks, "chat", 0.0)
    advisor.closed(blocks)
    assert advised(store) == (0, 3) and advisor.open == 0
    assert advisor.sweep(10_000.0) == 0 and advised(store) == (0, 3)


def test_the_open_set_is_bounded_dropping_the_oldest_without_advice(store):
    advisor = Advisor(store.advise, IDLE_S, max_open=2)
    for conversation, blocks in enumerate((1, 2, 4)):
        advisor.replied(turn(store, conversation, blocks), "chat", float(conversation))
    assert advisor.open == 2 and advised(store) == (0, 0)
    assert advisor.sweep(10_000.0) == 2
    assert advised(store) == (0, 6), "the two newest (2 + 4 blocks); the oldest was forgotten, not advised"
