"""Reading ahead of a turn (`PrefillEngine.prefetch`): a session's blocks come into the client's host tier and its
window record into the engine before the turn that needs them, so that turn reads neither from a daemon;
records read ahead are bounded, and the oldest unused is counted wasted."""

from __future__ import annotations

import pytest

from engine.prefill.request import CACHED, PrefillRequest
from tests.engine.prefill.test_engine import _check, _client, _engine, _tokens
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def _first_turn(tiny, daemon, prompts: list[list[int]]) -> None:
    """Each prompt served once elsewhere: its blocks and its window record in the store."""
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        for i, prompt in enumerate(prompts):
            engine.prefill(PrefillRequest(prompt, session_id=f"s{i}")).kv.release()
        assert client.write_behind.flush(30)


@pytest.mark.kills_daemons  # left dead on purpose: a dead daemon is what it tests
def test_the_next_turn_after_a_prefetch_reads_nothing_from_the_daemon(tiny_models, daemons):
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    prompt, more = _tokens(150, seed=71), _tokens(20, seed=72)
    _first_turn(tiny, daemon, [prompt])
    probe = _engine(tiny, None)
    with _client(daemon, probe.block_bytes) as client:
        engine = _engine(tiny, client)  # another instance: nothing of the session in its tiers
        blocks = engine.namespace().blocks(prompt)
        engine.prefetch(blocks)
        assert engine.windows.prefetches["fetched"] == 1
        wait_for(lambda: client.stats.prefetched == len(blocks), "the prefetched blocks arriving")
        daemon.kill()  # the turn must not need it
        second = engine.prefill(PrefillRequest(prompt + more, session_id="s0", turn=1))
        assert (second.path, second.window_source) == (CACHED, "store")  # the record, read ahead
        assert second.sources == {"host": len(blocks)} and second.loaded_tokens == len(blocks) * 16
        assert engine.windows.prefetches["used"] == 1 and client.stats.prefetch_used == len(blocks)
        _check(tiny, second, prompt + more)


def test_records_read_ahead_are_bounded_and_the_oldest_unused_is_wasted(tiny_models, daemons):
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    prompts = [_tokens(150, seed=81), _tokens(150, seed=82)]
    _first_turn(tiny, daemon, prompts)
    mc = _engine(tiny, None).model.config
    window_bytes = len(mc.sliding_layers) * 2 * mc.sliding_window * mc.num_kv_heads * mc.head_dim * 4  # fp32 rings
    with _client(daemon) as client:
        engine = _engine(tiny, client, window_tier_bytes=window_bytes + 1024)  # room for one record read ahead
        chains = [engine.namespace().blocks(p) for p in prompts]
        engine.prefetch(chains[0])
        assert engine.windows.prefetches["fetched"] == 1
        engine.prefetch(chains[1])  # the first, never used, makes room
        assert engine.windows.prefetches == {"fetched": 2, "wasted": 1}
        second = engine.prefill(PrefillRequest(prompts[1] + _tokens(10, seed=83), session_id="s1", turn=1))
        assert second.window_source == "store" and engine.windows.prefetches["used"] == 1
        first = engine.prefill(PrefillRequest(prompts[0] + _tokens(10, seed=84), session_id="s0", turn=1))
        assert first.window_source == "store"  # read from the store again: nothing lost but the read ahead
        assert engine.windows.prefetches["used"] == 1
        for result in (first, second):
            result.kv.release()
