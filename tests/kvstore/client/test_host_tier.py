import os

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client.host_tier import HostTier
from kvstore.client.stats import ClientStats
from kvstore.record import build_record, decode_header

pytestmark = pytest.mark.unit
NS = Namespace("host", KVLayout(2, 1, 8, "float16"), 4)


def blocks(n, start=0):
    out = []
    for block in NS.blocks(range(start, start + 4 * n)):
        header, payload = build_record(block, os.urandom(NS.block_bytes), 2, "chat")
        out.append((decode_header(header), payload))
    return out


def test_slots_are_allocated_once_and_reused():
    tier = HostTier(capacity_bytes=3 * NS.block_bytes, slot_bytes=NS.block_bytes)
    buffer = tier.buffer
    held = blocks(5)
    for header, payload in held:
        assert tier.put(header, payload)
    assert tier.buffer is buffer and len(tier) == 3 and tier.counters["evicted"] == 2
    assert tier.leading_hits([h.key for h, _ in held]) == 0, "LRU dropped the oldest: the prefix's head"
    assert tier.leading_hits([h.key for h, _ in held[2:]]) == 3
    pinned = tier.pin([held[2][0].key])
    assert bytes(tier.slot_view(pinned[0].slot, NS.block_bytes)) == held[2][1]
    tier.unpin(pinned)


def test_pinned_blocks_are_never_evicted_and_oversized_ones_not_kept():
    tier = HostTier(capacity_bytes=2 * NS.block_bytes, slot_bytes=NS.block_bytes)
    held = blocks(4)
    tier.put(*held[0])
    tier.put(*held[1])
    pinned = tier.pin([held[0][0].key, held[1][0].key])
    assert not tier.put(*held[2]), "every slot is pinned"
    tier.unpin(pinned[1:])
    assert tier.put(*held[2])
    assert held[0][0].key in tier and held[1][0].key not in tier
    assert bytes(tier.slot_view(pinned[0].slot, NS.block_bytes)) == held[0][1]
    big_header, _ = blocks(1, start=900)[0]
    assert not tier.put(big_header, b"x" * (NS.block_bytes + 1)) and tier.counters["too_large"] == 1


def test_bad_sizes():
    with pytest.raises(ValueError, match="slot"):
        HostTier(capacity_bytes=10, slot_bytes=100)


def test_a_prefetch_never_evicts_a_pinned_block_nor_an_unread_prefetch_and_counts_use_and_waste():
    stats = ClientStats()
    tier = HostTier(capacity_bytes=3 * NS.block_bytes, slot_bytes=NS.block_bytes, stats=stats)
    held = blocks(6)
    assert tier.put(*held[0])
    reading = tier.pin([held[0][0].key])
    assert tier.put(*held[1], prefetched=True) and tier.put(*held[2], prefetched=True)
    assert not tier.put(*held[3], prefetched=True), "every slot is pinned or holds an unread prefetch"
    assert [h.key in tier for h, _ in held[:3]] == [True, True, True]
    assert bytes(tier.slot_view(reading[0].slot, NS.block_bytes)) == held[0][1]
    tier.unpin(tier.pin([held[1][0].key]))  # read: used once, and an ordinary block from then on
    tier.unpin(tier.pin([held[1][0].key]))
    assert stats.prefetch_used == 1
    assert tier.put(*held[3], prefetched=True), "the read prefetch may go"
    assert held[1][0].key not in tier and stats.prefetch_wasted == 0
    tier.unpin(reading)
    assert tier.put(*held[4]) and held[0][0].key not in tier, "no longer pinned, the oldest goes first"
    assert tier.put(*held[5]), "a plain put passes the unread prefetches over"
    assert held[4][0].key not in tier and held[2][0].key in tier and stats.prefetch_wasted == 0


def test_plain_puts_pass_held_blocks_over_until_their_read_and_holds_take_at_most_half():
    tier = HostTier(capacity_bytes=4 * NS.block_bytes, slot_bytes=NS.block_bytes)
    held = blocks(13)
    keys = [header.key for header, _ in held]
    for header, payload in held[:4]:
        assert tier.put(header, payload)
    assert tier.hold(keys[:3]) == [True, True, False]  # at most half the slots
    for header, payload in held[4:10]:  # traffic that would have evicted them
        assert tier.put(header, payload)
    assert tier.present(keys[:3]) == [True, True, False]
    tier.unpin(tier.pin(keys[:1]))  # read: an ordinary block again
    assert tier.stats.prefetch_used == 1
    for header, payload in held[10:13]:
        assert tier.put(header, payload)
    assert tier.present(keys[:2]) == [False, True]


def test_with_only_held_blocks_left_a_plain_put_takes_the_oldest_and_counts_it_wasted():
    tier = HostTier(capacity_bytes=2 * NS.block_bytes, slot_bytes=NS.block_bytes)
    held = blocks(4)
    assert tier.put(*held[0], prefetched=True) and tier.put(*held[1], prefetched=True)
    assert not tier.put(*held[2], prefetched=True), "a prefetch never takes another unread prefetch's slot"
    assert tier.put(*held[3])
    assert tier.present([held[0][0].key, held[1][0].key]) == [False, True] and tier.stats.prefetch_wasted == 1
