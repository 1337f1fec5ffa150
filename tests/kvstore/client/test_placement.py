import os
from collections import Counter

import pytest

from kvstore.client.config import ClientConfig
from kvstore.client.placement import place

pytestmark = pytest.mark.unit
MEMBERS = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]


def test_keys_spread_evenly_and_deterministically():
    keys = [os.urandom(16) for _ in range(3000)]
    counts = Counter(place(k, MEMBERS) for k in keys)
    assert set(counts) == set(MEMBERS) and min(counts.values()) > 800
    assert [place(k, MEMBERS) for k in keys[:50]] == [place(k, list(reversed(MEMBERS))) for k in keys[:50]]


def test_removing_a_member_moves_only_its_keys():
    keys = [os.urandom(16) for _ in range(2000)]
    before = {k: place(k, MEMBERS) for k in keys}
    after = {k: place(k, MEMBERS[:2]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == MEMBERS[2] for k in moved)


def test_client_config_validation():
    assert ClientConfig("a:1,b:2").servers == ("a:1", "b:2")
    for bad in ("", "nohost", "a:1,a:1", "a:x"):
        with pytest.raises(ValueError):
            ClientConfig(bad)
    with pytest.raises(ValueError, match="timeout_s"):
        ClientConfig(("a:1",), timeout_s=0)
