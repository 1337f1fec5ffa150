"""Each policy against small hand-computed sequences (keys are plain ints, as in the simulator)."""

import pytest

from kvstore.eviction import POLICIES, S3FIFO, SIEVE, PrefixLFU, make_policy

pytestmark = pytest.mark.unit


def test_sieve_sweeps_from_the_oldest_and_keeps_visited_objects():
    sieve = SIEVE()
    for key in "abc":
        sieve.insert(key, 1)
    sieve.access("a")
    assert sieve.pop_victim() == "b", "a was visited: its bit is cleared and the hand moves on"
    sieve.insert("d", 1)
    sieve.access("a")
    assert sieve.pop_victim() == "c", "the hand stayed where b was, and moves towards the newest"
    assert sieve.pop_victim() == "d", "the hand reaches older objects only after wrapping around"
    assert sieve.pop_victim() == "a" and sieve.pop_victim() is None
    assert sieve.tracked_bytes == 0


def test_s3fifo_filters_one_hit_wonders_and_readmits_from_the_ghost():
    s3 = S3FIFO(capacity_bytes=10)  # the small queue holds 10% = 1 object
    s3.insert("hot", 1)
    s3.access("hot")  # accessed on probation: promoted to the main queue when the small one is full
    s3.insert("once", 1)
    assert s3.pop_victim() == "once", "hot moved to main; once goes to the ghost queue"
    assert "hot" in s3 and "once" not in s3
    s3.insert("once", 1)  # back while still a ghost: straight into the main queue
    s3.insert("new", 1)
    assert s3.pop_victim() == "new", "the small queue is over its 10%: evict there first"
    assert s3.pop_victim() == "hot" and s3.pop_victim() == "once", "main: FIFO, frequencies spent"
    assert s3.pop_victim() is None


def test_prefix_lfu_never_evicts_a_parent_before_its_children():
    policy = PrefixLFU()
    policy.insert("root", 1)
    policy.insert("mid", 1, parent="root")
    policy.insert("leaf", 1, parent="mid")
    policy.insert("other", 1, parent="root")
    for _ in range(5):
        policy.access("root")  # the hottest block, but it has children: not a candidate
    policy.access("leaf")
    assert policy.pop_victim() == "other", "the least used leaf"
    assert policy.pop_victim() == "leaf" and policy.pop_victim() == "mid" and policy.pop_victim() == "root"


def test_prefix_lfu_counts_children_that_arrive_before_their_parent():
    policy = PrefixLFU()
    policy.insert("leaf", 1, parent="root")  # puts go leaf first
    policy.insert("root", 1)
    assert policy.pop_victim() == "leaf" and policy.pop_victim() == "root"


def test_prefix_lfu_ages_frequency_so_old_favourites_go():
    policy = PrefixLFU()
    policy.insert("old", 1)
    for _ in range(3):
        policy.access("old")  # priority 4
    for name in ("a", "b", "c"):
        policy.insert(name, 1)
        assert policy.pop_victim() == name  # each newcomer goes at once, but raises the floor by one
    policy.insert("d", 1)  # priority: the floor (3) + 1 = 4, as high as old's, and newer
    assert policy.pop_victim() == "old", "without aging, old would stay for ever"


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_tracks_bytes_and_empties(name):
    policy = make_policy(name, capacity_bytes=100)
    for key in range(10):
        policy.insert(key, 3, parent=key - 1 if key else None)
    assert policy.tracked_bytes == 30 and len(policy) == 10 and 5 in policy
    policy.remove(5)
    victims = [policy.pop_victim() for _ in range(9)]
    assert sorted(victims) == [k for k in range(10) if k != 5] and policy.pop_victim() is None
    assert policy.tracked_bytes == 0
