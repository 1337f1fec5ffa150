import pytest

from kvstore.eviction import LRU, make_policy

pytestmark = pytest.mark.unit


def test_lru_evicts_least_recently_used_and_tracks_bytes():
    lru = LRU()
    for key, size in ((b"a", 1), (b"b", 2), (b"c", 3)):
        lru.insert(key, size)
    lru.access(b"a")
    assert lru.tracked_bytes == 6 and len(lru) == 3
    assert lru.pop_victim() == b"b"
    lru.remove(b"c")
    assert lru.tracked_bytes == 1 and b"c" not in lru
    lru.insert(b"a", 5)  # re-insert replaces the size
    assert lru.tracked_bytes == 5
    assert lru.pop_victim() == b"a" and lru.pop_victim() is None
    lru.access(b"zzz")
    lru.remove(b"zzz")


def test_leaf_first_access_keeps_parents_longer():
    lru = LRU()
    prefix = [b"root", b"mid", b"leaf"]
    for key in reversed(prefix):  # owners report a prefix leaf first
        lru.insert(key, 1)
    assert [lru.pop_victim() for _ in prefix] == [b"leaf", b"mid", b"root"]


def test_unknown_policy_name():
    with pytest.raises(ValueError, match="lru"):
        make_policy("fifo-ish")
