"""PrefixReuse on small hand-computed sequences."""

import json

import pytest

from kvstore.eviction import PrefixReuse, ReuseHint
from kvstore.eviction.reuse import reuse_class

pytestmark = pytest.mark.unit

CONTINUING = ReuseHint(10, 10)  # a prompt fully cached: a conversation that goes on
FRESH = ReuseHint(0, 10)  # nothing of it cached


def test_classes_by_cached_fraction_and_length():
    assert reuse_class(None) == reuse_class(ReuseHint(0, 0)) != reuse_class(FRESH)
    assert reuse_class(ReuseHint(9, 10)) == reuse_class(CONTINUING) != reuse_class(ReuseHint(8, 10))
    assert reuse_class(ReuseHint(0, 3)) != reuse_class(FRESH) != reuse_class(ReuseHint(0, 16))
    assert reuse_class(ReuseHint(0, 10, 1)) == reuse_class(ReuseHint(0, 10, 3)) != reuse_class(ReuseHint(0, 10, 4))
    assert reuse_class(FRESH) != reuse_class(ReuseHint(0, 10, 1))
    every = {reuse_class(ReuseHint(hit, blocks, turn)) for blocks in (3, 10, 20) for hit in (0, blocks // 2 + 1, blocks)
             for turn in (0, 1, 4)}
    assert len(every) == 27, "3 cached fractions x 3 lengths x 3 turn depths, no two alike"
    advised = {reuse_class(ReuseHint(0, 10, 0, continues)) for continues in (None, True, False)}
    assert len(advised) == 3 and not advised & (every - {reuse_class(FRESH)}), "advice refines a class"


def test_only_leaves_go_and_without_hints_it_is_lru():
    policy = PrefixReuse()
    policy.insert("leaf", 1, parent="mid")  # puts go leaf first
    policy.insert("mid", 1, parent="root")
    policy.insert("root", 1)
    policy.insert("other", 1, parent="root")
    policy.access("leaf")
    assert [policy.pop_victim() for _ in range(4)] == ["other", "leaf", "mid", "root"]


def test_a_class_never_used_again_goes_before_an_older_class_that_is():
    policy = PrefixReuse()
    for i in range(10):
        policy.insert(f"h{i}", 1, hint=CONTINUING)  # operations 1-10
    for i in range(40):
        policy.insert(f"f{i}", 1)  # 11-50: no hint, never used again
    for i in range(10):
        policy.access(f"h{i}")  # 51-60: each h used again after 50 operations
    for i in range(10):
        policy.insert(f"l{i}", 1, hint=FRESH)  # 61-70: the newest blocks
    # now 70. p(no hint) = 0.5/41, p(fresh) = 0.5/11, p(continuing) = 10.5/21, and every block is
    # younger than the gaps seen (50), so survival is 1: the order is by p, then by age.
    victims = [policy.pop_victim() for _ in range(60)]
    assert victims[:40] == [f"f{i}" for i in range(40)]
    assert victims[40:50] == [f"l{i}" for i in range(10)], "LRU would evict the older h blocks here"
    assert victims[50:] == [f"h{i}" for i in range(10)]
    assert policy.reuse_probability(reuse_class(CONTINUING), 19) == pytest.approx(10.5 / 21)


def test_blocks_older_than_every_gap_seen_are_given_up():
    policy = PrefixReuse()
    policy.insert("a", 1, hint=CONTINUING)
    policy.access("a")  # a gap of 1 operation
    klass = reuse_class(CONTINUING)
    assert policy.reuse_probability(klass, 0) == pytest.approx(1.5 / 3)  # (1 reuse + 0.5) / (2 uses + 1)
    assert policy.reuse_probability(klass, 100) == 0.0


def test_an_evicted_key_used_again_still_counts_as_reused():
    policy = PrefixReuse()
    klass = reuse_class(FRESH)
    policy.insert("a", 1, hint=FRESH)
    before = policy.reuse_probability(klass, 0)
    assert policy.pop_victim() == "a" and "a" not in policy
    policy.insert("a", 1, hint=FRESH)  # back from the ghost list: the first use had a reuse after all
    assert policy.reuse_probability(klass, 0) > before


def test_advice_moves_a_block_to_its_fate_without_counting_a_use():
    policy = PrefixReuse()
    for i in range(8):
        policy.insert(f"a{i}", 1, hint=FRESH)  # operations 1-8: eight conversations' first turns, alike
    for i in range(4):
        policy.advise(f"a{i}", FRESH._replace(continues=True))  # the engine: these go on...
        policy.access(f"a{i}")  # 9-12: ...and they do
    for i in range(4, 8):
        policy.advise(f"a{i}", FRESH._replace(continues=False))  # these ended
    policy.advise("never put", FRESH._replace(continues=False))  # ignored
    policy.insert("b", 1, hint=FRESH)  # 13
    policy.insert("c", 1, hint=FRESH)  # 14
    policy.advise("b", FRESH._replace(continues=True))
    policy.advise("c", FRESH._replace(continues=False))
    goes_on, ended = (reuse_class(FRESH._replace(continues=c)) for c in (True, False))
    # p(goes on) = (4 reuses + 0.5) / (4 puts + 4 reads + b's put + 1): the puts moved with the advice
    assert policy.reuse_probability(goes_on, 0) == pytest.approx(4.5 / 10)
    assert policy.reuse_probability(ended, 0) == pytest.approx(0.5 / 6)  # 4 puts + c's put, no reuse
    victims = [policy.pop_victim() for _ in range(10)]
    assert victims[:5] == ["a4", "a5", "a6", "a7", "c"], "the ended go first, oldest first"
    assert victims[5:] == ["a0", "a1", "a2", "a3", "b"]


def test_advice_leaves_alone_a_block_several_prompts_branch_from():
    policy = PrefixReuse()
    policy.insert("c1", 1, parent="sys", hint=FRESH)
    policy.insert("c2", 1, parent="sys", hint=FRESH)
    policy.insert("sys", 1, hint=FRESH)
    policy.insert("d1", 1, parent="c1", hint=FRESH)
    for key in ("sys", "c1", "d1"):  # conversation 1's prompt, sys -> c1 -> d1, ended
        policy.advise(key, FRESH._replace(continues=False))
    # c1 and d1 moved to the ended class (their puts with them); sys, which c1 and c2 branch from, stayed
    ended = reuse_class(FRESH._replace(continues=False))
    assert policy.reuse_probability(ended, 0) == pytest.approx(0.5 / (2 + 1))
    assert policy.reuse_probability(reuse_class(FRESH), 0) == pytest.approx(0.5 / (2 + 1))


def test_a_snapshot_round_trips_and_restore_is_not_a_use():
    policy = PrefixReuse()
    policy.insert("a", 1, hint=CONTINUING)
    policy.access("a")
    policy.insert("b", 1, hint=FRESH)
    learned = json.loads(json.dumps(policy.snapshot()))  # as the store keeps it
    again = PrefixReuse()
    again.load(learned)
    again.restore("a", 1, None, policy.class_of("a"))
    again.restore("b", 1, None, policy.class_of("b"))
    again.restore("c", 1, None, 10**6)  # a class this version does not have: no class
    assert [again.class_of(k) for k in "abc"] == [policy.class_of("a"), policy.class_of("b"), 0]
    for klass in {policy.class_of("a"), policy.class_of("b")}:
        assert again.reuse_probability(klass, 0) == policy.reuse_probability(klass, 0)
    assert again.snapshot()["uses"] == policy.snapshot()["uses"], "restoring a block is not a use of it"


@pytest.mark.parametrize("snapshot", [
    {"policy": "lru"},
    {"policy": "prefix-reuse", "now": 3, "uses": {}, "reuses": {}, "gaps": {}},
    {"policy": "prefix-reuse", "now": 3, "uses": {"x": 1}, "reuses": {}, "gaps": {}, "all_gaps": [0] * 65},
    {"policy": "prefix-reuse", "now": 3, "uses": {}, "reuses": {}, "gaps": {}, "all_gaps": [0] * 3},
    {"policy": "prefix-reuse", "now": 3, "uses": {"999": 1}, "reuses": {}, "gaps": {}, "all_gaps": [0] * 65},
    {"policy": "prefix-reuse", "now": 3, "uses": [], "reuses": {}, "gaps": {}, "all_gaps": [0] * 65},
], ids=["another-policy", "missing-field", "bad-class", "bad-bins", "unknown-class", "wrong-type"])
def test_a_malformed_snapshot_is_refused_and_changes_nothing(snapshot):
    policy = PrefixReuse()
    policy.insert("a", 1, hint=CONTINUING)
    before = policy.snapshot()
    with pytest.raises(ValueError):
        policy.load(snapshot)
    assert policy.snapshot() == before


def test_advice_on_a_block_restored_without_what_was_learned():
    policy = PrefixReuse()
    policy.restore("a", 1, None, reuse_class(FRESH))  # the learned state was lost: no use of its class known
    policy.advise("a", FRESH._replace(continues=False))
    assert policy.class_of("a") == reuse_class(FRESH._replace(continues=False))
    assert policy.pop_victim() == "a"
