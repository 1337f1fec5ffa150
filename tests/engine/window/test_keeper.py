"""A session's window records in the store: the older one is deleted only once the save of the newer one is done,
so that a turn resumed meanwhile still finds a record."""

from __future__ import annotations

import signal

import pytest
import torch

from engine.model.kv import WindowState
from engine.window import record as window_records
from engine.window.keeper import WindowKeeper
from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient

pytestmark = pytest.mark.integration
CHAIN = Namespace("keeper", KVLayout(num_layers=2, kv_heads=1, head_dim=8, dtype="float32"), block_tokens=16)
# Longer than the test takes: the save to the paused daemon waits for it rather than failing
PATIENT_S = 120.0


def _state(position: int) -> WindowState:
    return WindowState(position, torch.full((1, 2, 4, 1, 8), float(position)))  # (sliding, K/V, W, heads, dim)


def test_a_superseded_record_stays_readable_until_the_save_that_supersedes_it_is_done(daemons):
    cluster = daemons(2)
    keeper = WindowKeeper(CHAIN.block_tokens, window=4, tier_bytes=2**20, store_records=True, replay_tokens=0,
                          replay_min_prefix_factor=1.0)
    blocks = CHAIN.blocks(range(64 * CHAIN.block_tokens))
    records = [window_records.window_record(CHAIN, block) for block in blocks]
    patient = ClientConfig(tuple(d.address for d in cluster), timeout_s=PATIENT_S, lookup_timeout_s=PATIENT_S)
    with KVClient(patient) as client:
        owners = client.block_sources(records)
        # the newer record on the other daemon than the older one: pausing that daemon holds its save alone
        newer = next(i for i, owner in enumerate(owners) if owner != owners[0])
        keeper.keep(client, blocks[0], _state(CHAIN.block_tokens), CHAIN, "s")
        assert client.write_behind.flush() and client.lookup(records[:1]) == 1
        paused = next(d for d in cluster if d.address == owners[newer])
        paused.proc.send_signal(signal.SIGSTOP)
        try:
            keeper.keep(client, blocks[newer], _state((newer + 1) * CHAIN.block_tokens), CHAIN, "s")
            # whatever was queued before the newer record's save has run (a deletion queued ahead of it included)
            assert client.write_behind.wait_for(client.write_behind.mark() - 1, PATIENT_S)
            assert client.write_behind.pending_bytes > 0, "the newer record's save is not done"
            assert len(client.get(records[:1])) == 1, "the older record is still there to resume from"
        finally:
            paused.proc.send_signal(signal.SIGCONT)
        assert client.write_behind.flush(PATIENT_S)
        assert client.lookup(records[:1]) == 0 and client.lookup([records[newer]]) == 1, "superseded once it is saved"
