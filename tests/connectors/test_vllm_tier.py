"""The vLLM offloading tier through vLLM's own TieringOffloadingSpec and TieringOffloadingManager (its CPU
tier above this project's), over a real daemon (`make test-connectors`, in the vLLM venv)."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks a platform
pytest.importorskip("vllm", reason="the vLLM venv: make test-connectors")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from tests.connectors.vllm_harness import Scheduler, tiering_spec  # noqa: E402

pytestmark = pytest.mark.connectors

CHUNK = 64 * 1024  # bytes of one chunk of the CPU tier


def _keys(*seeds: int) -> list:
    return [make_offload_key(seed.to_bytes(32, "little"), 0) for seed in seeds]


def test_store_restart_lookup_and_promote_gives_the_bytes_back(daemons):
    (daemon,) = daemons(1)
    keys, payloads = _keys(1, 2, 3), [os.urandom(CHUNK) for _ in range(3)]
    writer = Scheduler(tiering_spec(daemon.address, CHUNK))
    writer.store("w", keys, payloads)
    assert writer.tier.leading(keys) == 3, "the cascade stored every chunk in the daemon"
    writer.shutdown()

    daemon.stop()
    daemon.start()  # the same data directory and port: the records survive a restart

    reader = Scheduler(tiering_spec(daemon.address, CHUNK))  # a fresh vLLM: its CPU tier is empty
    with reader.manager.lock:
        first = reader.manager.lookup(keys[0], ReqContext("probe"))
    assert first is LookupResult.RETRY, "the first lookup is asked in the background, never blocking"
    assert reader.lookup("r", keys) == [LookupResult.HIT] * 3, "found in the tier and promoted to the CPU tier"
    assert reader.read(keys) == payloads
    reader.shutdown()


def test_a_missing_key_is_a_miss_and_a_failed_promotion_is_reported(daemons):
    (daemon,) = daemons(1)
    keys = _keys(11, 12, 13)
    writer = Scheduler(tiering_spec(daemon.address, CHUNK))
    writer.store("w", keys[:2], [b"a" * CHUNK, b"b" * CHUNK])
    writer.shutdown()
    reader = Scheduler(tiering_spec(daemon.address, CHUNK))
    assert reader.lookup("r", keys) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    assert reader.read(keys[:2]) == [b"a" * CHUNK, b"b" * CHUNK]
    reader.shutdown()


def test_a_record_lost_between_lookup_and_promotion_fails_the_load_and_is_then_a_miss(daemons):
    (daemon,) = daemons(1)
    keys = _keys(21, 22)
    writer = Scheduler(tiering_spec(daemon.address, CHUNK))
    writer.store("w", keys, [b"c" * CHUNK, b"d" * CHUNK])
    writer.tier.client.delete([writer.tier.identity.block(keys[1])])  # the daemon loses key 22 ...
    writer.shutdown()
    reader = Scheduler(tiering_spec(daemon.address, CHUNK))
    context = ReqContext("r")
    with reader.manager.lock:
        reader.manager.on_new_request(context)
    # ... after a lookup found it: key 22 is HIT in the tier's cache (a second lookup of the same request)
    reader.tier._lookups._lookup_state.clear()
    with reader.manager.lock:
        assert reader.manager.lookup(keys[0], context) is LookupResult.RETRY
    reader.step()
    deadline = time.monotonic() + 30
    while (state := reader.tier._lookups._lookup_state.get(keys[0])) is None or state.result is None:
        reader.tier._lookups.drain_results()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    reader.tier._lookups._lookup_state[keys[1]] = type(state)(generation=10**6, phase=state.phase, result=True)
    with reader.manager.lock:
        assert [reader.manager.lookup(k, context) for k in keys] == [LookupResult.HIT_PENDING] * 2  # promoting
    reader.settle()  # submit_load: key 21 arrives, key 22 fails
    with reader.manager.lock:
        assert [reader.manager.lookup(k, context) for k in keys] == [LookupResult.HIT, LookupResult.MISS]
        reader.manager.on_request_finished(context)
    assert reader.read(keys[:1]) == [b"c" * CHUNK]
    reader.shutdown()


def test_models_ranks_and_tenants_do_not_see_each_others_chunks(daemons):
    (daemon,) = daemons(1)
    keys = _keys(31)
    writer = Scheduler(tiering_spec(daemon.address, CHUNK, world=2, rank=0))
    writer.store("w", keys, [b"x" * CHUNK])
    assert writer.tier.leading(keys) == 1
    writer.shutdown()
    for other in [dict(model="org/other", world=2, rank=0), dict(world=2, rank=1), dict(world=2, rank=0, tenant="b"),
                  dict(world=1, rank=0)]:
        reader = Scheduler(tiering_spec(daemon.address, CHUNK, **other))
        assert reader.tier.leading(keys) == 0, other
        assert reader.lookup("r", keys) == [LookupResult.MISS], other
        reader.shutdown()


@pytest.mark.kills_daemons  # left dead on purpose: a dead daemon is what it tests
def test_a_dead_daemon_is_a_miss_and_failed_jobs_within_the_deadline(daemons):
    (daemon,) = daemons(1)
    keys = _keys(41, 42)
    scheduler = Scheduler(tiering_spec(daemon.address, CHUNK))
    scheduler.store("w", keys[:1], [b"y" * CHUNK])
    daemon.kill()
    fresh = Scheduler(tiering_spec(daemon.address, CHUNK))
    assert fresh.lookup("r", keys[:1]) == [LookupResult.MISS]  # no exception in vLLM's thread
    scheduler.store("w2", keys[1:], [b"z" * CHUNK])  # the cascade's job fails; vLLM's CPU tier keeps the chunk
    assert scheduler.lookup("r2", keys[1:]) == [LookupResult.HIT]
    scheduler.shutdown()
    fresh.shutdown()


def test_building_the_tier_connects_to_nothing():
    scheduler = Scheduler(tiering_spec("127.0.0.1:1", CHUNK))  # no daemon there
    assert scheduler.tier.store.existing is None
    scheduler.shutdown()
