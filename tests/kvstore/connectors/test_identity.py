"""Engine keys as block identities: a hit is what was stored for that key under exactly this identity."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.client import ClientConfig, KVClient
from kvstore.connectors.identity import EngineIdentity

BASE = EngineIdentity("sglang", "Qwen/Qwen3-0.6B", "page_first bfloat16 [28,2,64,8,128]", 64, rank=0, world=2,
                      tenant="team-a")
OTHERS = [dataclasses.replace(BASE, **change) for change in (
    {"engine": "lmcache"}, {"model": "Qwen/Qwen3-8B"}, {"layout": "layer_first bfloat16 [28,2,64,8,128]"},
    {"page_tokens": 32}, {"rank": 1}, {"world": 4}, {"tenant": "team-b"}, {"tenant": ""})]


@pytest.mark.unit
def test_every_field_of_the_identity_changes_the_block_and_the_key_is_stable():
    blocks = {identity.block("page-0").key for identity in [BASE, *OTHERS]}
    assert len(blocks) == 1 + len(OTHERS)
    assert BASE.block("page-0") == dataclasses.replace(BASE).block(b"page-0"), "str and bytes keys agree"
    assert BASE.block("page-0").key != BASE.block("page-1").key


@pytest.mark.unit
@pytest.mark.parametrize("bad", [{"engine": ""}, {"model": "a|b"}, {"page_tokens": 0}, {"rank": 2}, {"world": 0}])
def test_an_identity_that_could_be_confused_is_refused(bad):
    with pytest.raises(ValueError):
        dataclasses.replace(BASE, **bad)


@pytest.mark.integration
def test_a_page_stored_under_one_identity_is_a_miss_under_every_other(daemons):
    (daemon,) = daemons(1)
    with KVClient(ClientConfig((daemon.address,))) as client:
        client.put([(BASE.block("page-0"), b"\x01" * 4096)], 1)
        assert client.lookup([BASE.block("page-0")]) == 1
        assert client.get([BASE.block("page-0")])[0].payload == b"\x01" * 4096
        for other in OTHERS:
            assert client.lookup([other.block("page-0")]) == 0 and client.get([other.block("page-0")]) == []
