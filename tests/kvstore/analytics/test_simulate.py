import pytest

from kvstore.analytics.simulate import continuation_signals, replay, reuse_statistics
from kvstore.analytics.trace import Request

pytestmark = pytest.mark.unit


def requests(*prompts, gap_ms=1000, tokens=512, classes=None):
    """One request per prompt (a sequence of hash ids, all full 512-token blocks)."""
    return [Request(i * gap_ms, len(ids) * tokens, 10, tuple(ids), (classes or {}).get(i, "chat"))
            for i, ids in enumerate(prompts)]


def test_belady_and_infinite_on_a_known_sequence():
    trace = requests(*[[k] for k in "ABCABDA"])
    # Belady, 2 blocks: keeps A and B, never admits C or D (needed later than anything cached): 3 hits.
    assert replay(trace, "belady", 2).hit_blocks == 3
    assert replay(trace, "infinite", None).hit_blocks == 3
    assert replay(trace, "lru", 2).hit_blocks == 0, "LRU thrashes on this loop"


def test_belady_gives_up_the_deepest_of_blocks_needed_at_once():
    # 2 blocks. After [1, 2], block 3 arrives and is needed before them; 1 and 2 are next needed together
    # (request 3). Evicting 1, the root, would leave 2 unreadable (hits are a leading run): evict 2.
    trace = requests([1, 2], [3], [3], [1, 2])
    result = replay(trace, "belady", 2)
    assert result.hit_blocks == 2, "request 2 hits 3, request 3 hits 1 (2 was given up)"
    assert result.evictions == 1  # 2 for 3; 2 is not readmitted after (never used again)


def test_hits_are_the_leading_run_and_weigh_tokens():
    trace = [Request(0, 1300, 0, (1, 2, 3)), Request(1, 1300, 0, (1, 2, 4)), Request(2, 1024, 0, (9, 2))]
    result = replay(trace, "lru", 100)
    assert result.hit_blocks == 2, "request 2 hits 1 and 2; request 3 misses 9, so 2 does not count"
    assert result.hit_tokens == 1024 and result.tokens == 3624
    assert result.token_hit_rate == pytest.approx(1024 / 3624)


def test_partial_last_blocks_are_never_cached():
    trace = [Request(0, 700, 0, (1, 2)), Request(1, 700, 0, (1, 2))]  # block 2 holds 188 tokens
    for policy in ("lru", "belady", "infinite"):
        result = replay(trace, policy, None if policy == "infinite" else 10)
        assert result.hit_blocks == 1 and result.hit_tokens == 512, policy


def test_ttl_per_class_with_the_trace_clock():
    trace = requests([1], [1], [1], gap_ms=10_000, classes={1: "agent"})
    # chat TTL 5 s: expired at the second request (agent), which puts it again with agent's 60 s TTL.
    assert replay(trace, "lru", 10, ttl_s={"chat": 5, "agent": 60}).hit_blocks == 1
    assert replay(trace, "lru", 10, ttl_s={"chat": 15, "agent": 60}).hit_blocks == 2
    # Used by agent traffic once, the block keeps agent's longer TTL.
    assert replay(requests([1], [1], [1], gap_ms=20_000, classes={0: "agent"}), "lru", 10,
                  ttl_s={"chat": 15, "agent": 30}).hit_blocks == 2


def test_expired_blocks_are_evicted_before_the_policy_is_asked():
    trace = [Request(t, 512, 0, (key,)) for t, key in ((0, 1), (10_000, 2), (12_000, 1), (20_000, 3), (21_000, 2))]
    # Capacity 2, TTL 9 s: block 1 has expired at 12 s (a miss, put again); when 3 needs room at 20 s, 2 has
    # expired (at 19 s) and goes; when 2 comes back at 21 s, 1 has expired (at 21 s) and goes. The policy is
    # never asked: every block that left had expired.
    result = replay(trace, "lru", 2, ttl_s={"chat": 9})
    assert (result.expiries, result.evictions, result.hit_blocks) == (3, 0, 0)
    without = replay(trace, "lru", 2)
    assert (without.expiries, without.evictions, without.hit_blocks) == (0, 2, 1)


def test_reuse_distance_and_time():
    stats = reuse_statistics(requests([1], [2], [3], [1], [1], gap_ms=1000))
    assert stats["reuses"] == 2 and stats["unique_blocks"] == 3
    distance = stats["reuse_distance_blocks"]
    assert sorted([distance["p10"], distance["p99"]])[0] == pytest.approx(0.2)


def test_a_simulated_continuation_signal_is_right_as_often_as_asked_and_the_same_each_time():
    # 200 conversations of two turns: the first goes on, the second ends
    trace = requests(*(list(range(10 * c, 10 * c + 2 + turn)) for c in range(200) for turn in (0, 1)))
    truth = [turn == 0 for _ in range(200) for turn in (0, 1)]
    for right in (1.0, 0.8, 0.0):
        signals = continuation_signals(trace, right)
        agreement = sum(s == t for s, t in zip(signals, truth)) / len(truth)
        assert agreement == pytest.approx(right, abs=0.06)
        assert signals == continuation_signals(trace, right)
    with pytest.raises(ValueError, match="probability"):
        continuation_signals(trace, 1.2)


def test_only_policies_that_take_advice_change_with_it():
    # 20 chats that go on, between one-off questions that look alike when they arrive
    prompts, turns = [], [0] * 20
    for step in range(600):
        if step % 2:
            prompts.append([0] + [(1000 + step, i) for i in range(2)])  # a one-off question
        else:
            chat = (step // 2) % 20
            turns[chat] += 1
            prompts.append([0] + [(chat, i) for i in range(2 * turns[chat])])
    trace = requests(*prompts)
    for policy, changes in (("lru", False), ("prefix-reuse", True)):
        plain = replay(trace, policy, 40).hit_tokens
        advised = replay(trace, policy, 40, continuation_signal=1.0).hit_tokens
        assert (advised > plain) if changes else (advised == plain), (policy, plain, advised)
