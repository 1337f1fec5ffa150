import os

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client.host_tier import HostTier
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
