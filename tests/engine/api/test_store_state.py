"""kvstore-api's view of the store (engine/api/store_state.py) against real daemons: which answered, a store
that goes away and comes back logged (at most a line per interval), and misses without a store told apart."""

from __future__ import annotations

import logging

import pytest

from engine.api.store_state import DEGRADED, REACHABLE, UNKNOWN, UNREACHABLE, StoreState
from kvstore.client import ClientConfig, KVClient
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def _client(*addresses: str) -> KVClient:
    return KVClient(ClientConfig(addresses, timeout_s=2.0, lookup_timeout_s=2.0, down_backoff_s=0.05,
                                 max_down_backoff_s=0.05))


def test_a_store_that_goes_away_and_comes_back_is_logged(daemons, caplog):
    daemon, = daemons(1)
    with _client(daemon.address) as client:
        state = StoreState(client, log_every_s=0.0)  # every change logged
        assert state.state == UNKNOWN and not state.missing_store()
        caplog.set_level(logging.WARNING, "kvstore.api.store")
        assert state.probe().state == REACHABLE and state.daemons == {daemon.address: None}
        assert not caplog.records  # reachable from the start: nothing to say
        daemon.stop()
        found = state.probe()
        assert found.state == UNREACHABLE and state.missing_store()
        assert "UNAVAILABLE" in (state.daemons[daemon.address] or "")
        (went,) = caplog.records
        assert f"store unreachable: did not answer: {daemon.address}" in went.getMessage()
        daemon.start()  # on its port again; the client's channel reconnects on gRPC's backoff, probed until then
        wait_for(lambda: state.probe().state == REACHABLE, "the restarted daemon reachable again")
        assert not state.missing_store()
        assert "store reachable again" in caplog.records[-1].getMessage() and len(caplog.records) == 2


def test_changes_within_the_interval_are_folded_into_the_next_line(daemons, caplog):
    daemon, = daemons(1)
    with _client(daemon.address, "127.0.0.1:1") as client:
        state = StoreState(client, log_every_s=3600.0)
        caplog.set_level(logging.WARNING, "kvstore.api.store")
        found = state.probe()
        assert found.state == DEGRADED and "answered: " + daemon.address in found.line()
        assert "did not answer: 127.0.0.1:1" in found.line()
        (line,) = caplog.records  # the first change is said at once
        daemon.stop()
        assert state.probe().state == UNREACHABLE
        assert caplog.records == [line]  # the next within the interval is not
        daemon.start()
        wait_for(lambda: state.probe().state == DEGRADED, "the restarted daemon answering again")
        state.log_every_s = 0.0  # the interval over: the next change is said, with those folded in
        assert state.probe().state == DEGRADED
        assert caplog.records == [line], "back to what the log said: nothing to say"
        daemon.stop()
        assert state.probe().state == UNREACHABLE
        assert "store unreachable" in caplog.records[-1].getMessage()
        assert "(2 earlier changes not logged)" in caplog.records[-1].getMessage() and len(caplog.records) == 2


def test_without_a_store_there_is_nothing_to_miss():
    state = StoreState(None)
    assert state.state == "none" and not state.missing_store() and state.probe().daemons == {}
