"""Every policy's exact figures on a small seeded trace, pinned: making the replay faster must not change
a single decision. The numbers below were computed by the implementation before the speed work (commit
0128b20) and must not change; a policy whose decisions are meant to change updates them in its commit."""

import itertools
import random

import pytest

from kvstore.analytics import simulate
from kvstore.analytics.simulate import replay
from kvstore.analytics.trace import CONVERSATION_TRACE, Request, read_trace
from kvstore.eviction import adaptive, reuse

pytestmark = pytest.mark.unit


def seeded_trace(seed: int = 3) -> list[Request]:
    """Chats and agent sessions over a few shared system prompts: turns that grow by 1-4 blocks, most
    prompts ending in a partial block, interleaved in time, two traffic classes."""
    rng = random.Random(seed)
    names: dict = {}  # block -> its hash id, numbered as first met

    def hash_id(block: tuple) -> int:
        return names.setdefault(block, 1_000_003 * (len(names) + 1) % 2**40)

    events = []
    for session in range(70):
        system = [(-1, rng.randrange(3), i) for i in range(1 + session % 3)]
        blocks = list(system)
        kind = "agent" if session % 4 == 0 else "chat"
        t = rng.randrange(600_000)
        for turn in range(rng.randrange(1, 12)):
            blocks += [(session, len(blocks) + i) for i in range(rng.randrange(1, 5))]
            partial = rng.choice((0, rng.randrange(1, 512)))
            ids = [hash_id(key) for key in blocks] + ([hash_id((session, turn, "partial"))] if partial else [])
            events.append((t, len(blocks) * 512 + partial, tuple(ids), kind))
            t += rng.randrange(1_000, 120_000)
    events.sort(key=lambda e: e[0])
    return [Request(t, length, 50, ids, kind) for t, length, ids, kind in events]


VARIANTS = {  # name -> replay keyword arguments
    "plain": {},
    "ttl": {"ttl_s": {"agent": 60.0, "chat": 600.0}},
    "watermarks": {"low_blocks": "low"},
    "advised": {"continuation_signal": 0.8},
}
POLICIES = ("lru", "s3fifo", "sieve", "prefix-lfu", "prefix-reuse", "adaptive", "belady")

# (policy, variant, capacity share) -> (hit blocks, hit tokens, evictions, expiries), by the old implementation
PINNED: dict = {
    ('lru', 'plain', 0.05): (744, 380928, 4377, 0),
    ('lru', 'plain', 0.2): (2175, 1113600, 2834, 0),
    ('lru', 'ttl', 0.05): (744, 380928, 4377, 0),
    ('lru', 'ttl', 0.2): (2121, 1085952, 2716, 137),
    ('lru', 'watermarks', 0.05): (715, 366080, 4403, 0),
    ('lru', 'watermarks', 0.2): (2144, 1097728, 2882, 0),
    ('lru', 'advised', 0.05): (744, 380928, 4377, 0),
    ('lru', 'advised', 0.2): (2175, 1113600, 2834, 0),
    ('s3fifo', 'plain', 0.05): (1193, 610816, 3965, 0),
    ('s3fifo', 'plain', 0.2): (2210, 1131520, 2648, 0),
    ('s3fifo', 'ttl', 0.05): (1194, 611328, 3944, 20),
    ('s3fifo', 'ttl', 0.2): (2209, 1131008, 2436, 259),
    ('s3fifo', 'watermarks', 0.05): (1156, 591872, 4004, 0),
    ('s3fifo', 'watermarks', 0.2): (2032, 1040384, 2816, 0),
    ('s3fifo', 'advised', 0.05): (1193, 610816, 3965, 0),
    ('s3fifo', 'advised', 0.2): (2210, 1131520, 2648, 0),
    ('sieve', 'plain', 0.05): (1105, 565760, 4064, 0),
    ('sieve', 'plain', 0.2): (1965, 1006080, 3048, 0),
    ('sieve', 'ttl', 0.05): (1112, 569344, 4014, 43),
    ('sieve', 'ttl', 0.2): (1933, 989696, 2935, 131),
    ('sieve', 'watermarks', 0.05): (1084, 555008, 4088, 0),
    ('sieve', 'watermarks', 0.2): (1873, 958976, 3146, 0),
    ('sieve', 'advised', 0.05): (1105, 565760, 4064, 0),
    ('sieve', 'advised', 0.2): (1965, 1006080, 3048, 0),
    ('prefix-lfu', 'plain', 0.05): (1050, 537600, 4119, 0),
    ('prefix-lfu', 'plain', 0.2): (2236, 1144832, 2777, 0),
    ('prefix-lfu', 'ttl', 0.05): (1050, 537600, 4118, 1),
    ('prefix-lfu', 'ttl', 0.2): (2159, 1105408, 2672, 169),
    ('prefix-lfu', 'watermarks', 0.05): (1034, 529408, 4137, 0),
    ('prefix-lfu', 'watermarks', 0.2): (2116, 1083392, 2904, 0),
    ('prefix-lfu', 'advised', 0.05): (1050, 537600, 4119, 0),
    ('prefix-lfu', 'advised', 0.2): (2236, 1144832, 2777, 0),
    ('prefix-reuse', 'plain', 0.05): (1151, 589312, 4007, 0),
    ('prefix-reuse', 'plain', 0.2): (2349, 1202688, 2664, 0),
    ('prefix-reuse', 'ttl', 0.05): (1161, 594432, 3974, 23),
    ('prefix-reuse', 'ttl', 0.2): (2281, 1167872, 2454, 265),
    ('prefix-reuse', 'watermarks', 0.05): (1141, 584192, 4025, 0),
    ('prefix-reuse', 'watermarks', 0.2): (2284, 1169408, 2750, 0),
    ('prefix-reuse', 'advised', 0.05): (1258, 644096, 3890, 0),
    ('prefix-reuse', 'advised', 0.2): (2650, 1356800, 2361, 0),
    # adaptive's figures were recorded from commit 9681722, before its speed work
    ('adaptive', 'plain', 0.05): (996, 509952, 4149, 0),
    ('adaptive', 'plain', 0.2): (2235, 1144320, 2778, 0),
    ('adaptive', 'ttl', 0.05): (996, 509952, 4142, 7),
    ('adaptive', 'ttl', 0.2): (2236, 1144832, 2592, 172),
    ('adaptive', 'watermarks', 0.05): (1022, 523264, 4137, 0),
    ('adaptive', 'watermarks', 0.2): (2189, 1120768, 2838, 0),
    ('adaptive', 'advised', 0.05): (1004, 514048, 4140, 0),
    ('adaptive', 'advised', 0.2): (2489, 1274368, 2508, 0),
    # with shadows of 32 blocks, so that keys are sampled (at 5% and 20% the shadows see 62% and 15% of them)
    ('adaptive-sampled', 'plain', 0.05): (955, 488960, 4184, 0),
    ('adaptive-sampled', 'plain', 0.2): (2182, 1117184, 2826, 0),
    ('adaptive-sampled', 'ttl', 0.05): (955, 488960, 4174, 10),
    ('adaptive-sampled', 'ttl', 0.2): (2154, 1102848, 2689, 132),
    ('adaptive-sampled', 'watermarks', 0.05): (911, 466432, 4221, 0),
    ('adaptive-sampled', 'watermarks', 0.2): (2142, 1096704, 2882, 0),
    ('adaptive-sampled', 'advised', 0.05): (926, 474112, 4220, 0),
    ('adaptive-sampled', 'advised', 0.2): (2227, 1140224, 2782, 0),
    ('belady', 'plain', 0.05): (1947, 996864, 1224, 0),
    ('belady', 'plain', 0.2): (3583, 1834496, 997, 0),
    ('lru', 'conversation'): (1717, 879104, 37030, 0),
    ('s3fifo', 'conversation'): (2087, 1068544, 36660, 0),
    ('sieve', 'conversation'): (2085, 1067520, 36662, 0),
    ('prefix-lfu', 'conversation'): (1785, 913920, 36962, 0),
    ('prefix-reuse', 'conversation'): (2157, 1104384, 36590, 0),
    ('adaptive', 'conversation'): (1753, 897536, 36994, 0),
    ('belady', 'conversation'): (8469, 4336128, 11402, 0),
    'infinite': (415, 5435, 2728980, 4177, 2138624),
}


def figures(trace, policy, variant, share):
    unique = len({k for r in trace for k in r.hash_ids[: r.input_length // 512]})
    capacity = max(1, int(unique * share))
    kwargs = dict(VARIANTS[variant])
    if kwargs.get("low_blocks") == "low":
        kwargs["low_blocks"] = capacity * 9 // 10
    if policy == "belady":
        if variant != "plain":
            return None
        result = replay(trace, policy, capacity)
    else:
        result = replay(trace, policy, capacity, **kwargs)
    return result.hit_blocks, result.hit_tokens, result.evictions, result.expiries


CASES = [(p, v, s) for p in POLICIES for v in VARIANTS for s in (0.05, 0.2) if p != "belady" or v == "plain"]


@pytest.mark.parametrize("policy, variant, share", CASES)
def test_every_policy_decides_as_it_did(policy, variant, share):
    assert figures(seeded_trace(), policy, variant, share) == PINNED[policy, variant, share]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_decides_as_it_did_on_the_conversation_trace(policy, conversation):
    assert figures(conversation, policy, "plain", 0.05) == PINNED[policy, "conversation"]


@pytest.mark.parametrize("variant, share", [(v, s) for v in VARIANTS for s in (0.05, 0.2)])
def test_adaptive_with_sampled_shadows_decides_as_it_did(variant, share, monkeypatch):
    # the trace's capacities are below SHADOW_BLOCKS, where every key is sampled: smaller shadows sample
    monkeypatch.setattr(adaptive, "SHADOW_BLOCKS", 32)
    assert figures(seeded_trace(), "adaptive", variant, share) == PINNED["adaptive-sampled", variant, share]


@pytest.fixture(scope="module")
def conversation() -> list[Request]:
    """The first 1,500 requests of the shipped Mooncake trace: long prompts, real sharing."""
    return list(itertools.islice(read_trace(CONVERSATION_TRACE), 1500))


HEAPED = ("prefix-reuse", "adaptive", "belady")  # the policies that skip stale heap entries


@pytest.mark.parametrize("policy, variant, share", [case for case in CASES if case[0] in HEAPED])
def test_dropping_stale_heap_entries_at_once_changes_no_decision(policy, variant, share, monkeypatch):
    # with no slack the heaps are rebuilt from their entries in force whenever stale ones outnumber them
    monkeypatch.setattr(reuse, "_STALE_SLACK", 0)
    monkeypatch.setattr(reuse, "_STALE_PER_KEY", 0.5)
    monkeypatch.setattr(simulate, "_STALE_SLACK", 0)
    assert figures(seeded_trace(), policy, variant, share) == PINNED[policy, variant, share]


def test_the_infinite_cache_as_it_did():
    trace = seeded_trace()
    result = replay(trace, "infinite", None)
    assert (result.requests, result.blocks, result.tokens, result.hit_blocks, result.hit_tokens) == PINNED["infinite"]
