import pytest

from kvstore.server.hot_tier import HotTier

pytestmark = pytest.mark.unit


def test_capacity_bound_and_lru_order():
    tier = HotTier(capacity_bytes=300)
    for key in (b"a", b"b", b"c"):
        tier.put(key, b"h" * 10, bytearray(80))
    assert tier.bytes == 270 and len(tier) == 3
    tier.unpin(tier.pin(b"a"))  # a is now the most recent
    tier.put(b"d", b"h" * 10, bytearray(80))
    assert tier.pin(b"b") is None and tier.pin(b"a") is not None
    tier.put(b"huge", b"", bytearray(1000))  # larger than the tier: not kept
    assert tier.pin(b"huge") is None


def test_evicted_buffers_are_recycled_for_the_next_put():
    tier = HotTier(capacity_bytes=200)
    first = tier.buffer(100)
    tier.put(b"a", b"", first)
    tier.put(b"b", b"", tier.buffer(100))
    tier.put(b"c", b"", tier.buffer(100))  # evicts a
    assert tier.buffer(100) is first
    assert tier.buffer(50) is not first


def test_a_pinned_buffer_is_never_handed_out_while_read():
    tier = HotTier(capacity_bytes=100)
    buffer = tier.buffer(100)
    buffer[:] = b"x" * 100
    tier.put(b"a", b"", buffer)
    reading = tier.pin(b"a")
    tier.put(b"b", b"", tier.buffer(100))  # evicts a while it is being read
    fresh = tier.buffer(100)
    assert fresh is not buffer
    fresh[:] = b"y" * 100
    assert bytes(reading.payload) == b"x" * 100
    tier.unpin(reading)
    assert tier.buffer(100) is buffer, "recycled once the last reader is done"
