"""The adaptive policy follows the candidate its shadow caches see winning, without flapping on a tie."""

from __future__ import annotations

import json
import random

import pytest

from kvstore.analytics.simulate import replay
from kvstore.analytics.workloads import generate
from kvstore.eviction import POLICIES, Adaptive, ReuseHint, make_policy

HOT = ReuseHint(1, 1)  # a short prompt, fully cached: the class of the blocks used again below
COLD = ReuseHint(0, 20)  # a long prompt, nothing cached: the class of the blocks never used again


def serve(policy, key, capacity: int, parent=None, hint: ReuseHint | None = None) -> bool:
    """As an owner does: a hit is read; a miss is put, evicting down to `capacity` blocks first."""
    if key in policy:
        policy.access(key)
        return True
    while len(policy) >= capacity:
        policy.pop_victim()
    policy.insert(key, 1, parent, hint)
    return False


def test_registered_and_made_by_name():
    assert "adaptive" in POLICIES
    policy = make_policy("adaptive", 100)
    assert isinstance(policy, Adaptive) and policy.following == "lru"


def test_follows_prefix_reuse_when_lru_thrashes():
    # 80 hot blocks used in a loop, a never-reused block between each two: LRU (reuse distance 160 > 100)
    # never hits; PrefixReuse learns the cold class is not used again and keeps the hot loop.
    policy = Adaptive(100)
    hits = []
    cold = 10_000
    for _ in range(60):
        for hot in range(80):
            hits.append(serve(policy, hot, 100, hint=HOT))
            serve(policy, cold, 100, hint=COLD)
            cold += 1
    assert policy.following == "prefix-reuse"
    assert sum(hits[-800:]) > 0.8 * 800  # and the cache serves as PrefixReuse would


def test_follows_lru_when_s3fifo_filters_the_reused():
    # Every block is used twice, 30 steps apart (60 other blocks used in between): LRU (capacity 100)
    # hits every second use; S3-FIFO's small queue (10 blocks) lets each go before its second use.
    policy = Adaptive(100, candidates=("s3fifo", "lru"))
    assert policy.following == "s3fifo"
    hits = []
    for t in range(20_000):
        serve(policy, t, 100)
        if t >= 30:
            hits.append(serve(policy, t - 30, 100))
    assert policy.following == "lru" and policy.switches == 1
    assert sum(hits[-2000:]) > 0.95 * 2000


def test_no_flapping_on_a_tie():
    # Keys drawn uniformly: LRU and SIEVE hit alike up to noise, which must not move the choice.
    policy = Adaptive(200, candidates=("lru", "sieve"))
    rng = random.Random(5)
    for _ in range(100_000):
        serve(policy, rng.randrange(1000), 200)
    estimates = policy.estimates()
    assert abs(estimates["lru"] - estimates["sieve"]) < 0.02  # a tie indeed
    assert policy.switches == 0


def test_samples_keys_at_large_capacities():
    policy = Adaptive(1_000_000)
    for key in range(20_000):
        serve(policy, key, 1_000_000)
    assert policy.sample_rate == pytest.approx(2048 / 1_000_000, rel=1e-6)
    assert 0 < len(policy._kept) < 200  # about 41 of the 20,000 keys are sampled


def chains(rng: random.Random, count: int):
    """Prompts of 1-6 blocks branching from earlier ones: (blocks, hint), root first."""
    prompts = [[]]
    for _ in range(count):
        base = rng.choice(prompts)[: rng.randrange(4)]
        prompt = base + [rng.randrange(10**9) for _ in range(rng.randrange(1, 4))]
        prompts.append(prompt)
        yield prompt, ReuseHint(len(base), len(prompt), rng.randrange(5))


@pytest.mark.parametrize("candidates", [("lru", "prefix-reuse"), ("prefix-reuse", "lru")])
def test_victims_leave_every_candidate_and_are_leaves_under_prefix_reuse(candidates):
    # LRU gives up a parent read before its new children were put (reads come before puts); PrefixReuse
    # never does, so victims are leaves whenever it is followed.
    rng = random.Random(1)
    policy = Adaptive(40, candidates=candidates)
    parents: dict = {}  # tracked key -> its parent
    children: dict = {}  # key -> its tracked children
    leaf_checked = 0
    for prompt, hint in chains(rng, 3000):
        hit = 0
        while hit < len(prompt) and prompt[hit] in policy:
            hit += 1
        for key in reversed(prompt[:hit]):  # read, leaf first
            policy.access(key)
        for position in range(len(prompt) - 1, hit - 1, -1):  # put, leaf first
            while len(policy) >= 40:
                following = policy.following
                victim = policy.pop_victim()
                if following == "prefix-reuse":
                    assert not children.get(victim), "evicted a parent"
                    leaf_checked += 1
                assert all(victim not in full for full in policy._full)
                up = parents.pop(victim)
                if up is not None:
                    children[up] -= 1
            key = prompt[position]
            parents[key] = up = prompt[position - 1] if position else None
            if up is not None:
                children[up] = children.get(up, 0) + 1
            policy.insert(key, 1, up, hint)
        assert all(len(full) == len(policy) for full in policy._full)
    assert leaf_checked > 100


def test_snapshot_and_restore():
    policy = Adaptive(100)
    cold = 10_000
    for _ in range(40):  # as above: PrefixReuse wins and is followed
        for hot in range(80):
            serve(policy, hot, 100, hint=HOT)
            serve(policy, cold, 100, hint=COLD)
            cold += 1
    assert policy.following == "prefix-reuse"
    saved = json.loads(json.dumps(policy.snapshot()))
    kept = [(key, policy.class_of(key)) for key in range(80) if key in policy]
    assert kept and any(klass for _, klass in kept)  # the hot blocks have a class worth keeping

    again = Adaptive(100)
    again.load(saved)
    for key, klass in kept:
        again.restore(key, 1, None, klass)
    assert again.following == "prefix-reuse" and len(again) == len(kept)
    assert [again.class_of(key) for key, _ in kept] == [klass for _, klass in kept]
    assert again.pop_victim() in dict(kept)
    with pytest.raises(ValueError):
        again.load(make_policy("prefix-reuse").snapshot())
    with pytest.raises(ValueError):
        again.load({"policy": "adaptive", "following": "belady", "candidates": {}})


@pytest.mark.parametrize("share", [0.02, 0.10, 0.25])
def test_at_least_lru_on_a_generated_mix(share):
    requests = generate("mix", seed=2, scale=0.15)
    unique = len({k for r in requests for k in r.hash_ids[: r.input_length // 512]})
    capacity = int(unique * share)
    lru = replay(requests, "lru", capacity).token_hit_rate
    assert replay(requests, "adaptive", capacity).token_hit_rate >= lru - 0.001
