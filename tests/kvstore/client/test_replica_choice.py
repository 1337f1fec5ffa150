"""The parts of hot-block copies that need no daemon: which reads count a key hot, and which holder of a copied
key a read goes to. (tests/kvstore/client/test_replicas.py copies between real daemons, in `make test-multihost`;
these run in `make test`.)"""

import pytest

from kvstore.client.placement import ranked
from kvstore.client.replicas import Replicas
from kvstore.server.hot_keys import HotKeys

pytestmark = pytest.mark.unit


def test_hot_keys_count_reads_over_one_to_two_windows_within_a_bound():
    now = [0.0]
    hot = HotKeys(min_reads=3, window_s=10.0, max_keys=2, clock=lambda: now[0])
    assert [hot.read(b"a") for _ in range(3)] == [False, False, True]
    now[0] = 11.0  # the next window: last window's reads still count
    assert hot.read(b"a") is True
    now[0] = 35.0  # two windows later: forgotten
    assert hot.read(b"a") is False
    hot.read(b"b")
    assert [hot.read(b"c") for _ in range(5)] == [False] * 5  # past the cap a new key is not counted


def test_reads_of_a_copied_key_go_to_the_least_loaded_holder():
    replicas = Replicas()
    members = ["a:1", "b:1", "c:1"]
    key = b"k" * 16
    owner, *rest = ranked(key, members, 3)
    assert replicas.reader(key, members) == owner  # no copies known: the owner
    replicas.held(key, frozenset(rest))
    chosen = [replicas.reader(key, members) for _ in range(300)]
    assert {m: chosen.count(m) for m in members} == {m: 100 for m in members}
    replicas.missed(key, rest[0])
    assert rest[0] not in {replicas.reader(key, members) for _ in range(10)}
    assert replicas.reader(key, [owner, rest[1]]) in (owner, rest[1])  # a holder that left is not read
