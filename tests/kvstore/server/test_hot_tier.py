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


@pytest.mark.parametrize("capacity", [0, 50])
def test_a_put_buffer_the_tier_cannot_keep_is_recycled_only_when_the_caller_is_done_with_it(capacity):
    tier = HotTier(capacity_bytes=capacity)
    sent = tier.buffer(100)
    tier.put(b"read", b"", sent)  # a read too big for the tier: the caller still sends from it
    assert tier.buffer(100) is not sent
    stored = tier.buffer(100)
    tier.put(b"put", b"", stored, done_with=True)  # a put, stored: its receive buffer serves the next put
    assert tier.pin(b"put") is None and tier.buffer(100) is stored


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


def test_a_prefetch_never_evicts_a_pinned_entry_nor_an_unread_prefetch_and_is_refused_without_room():
    tier = HotTier(capacity_bytes=300, prefetch_bytes=300)
    pinned = tier.buffer(100)
    pinned[:] = b"p" * 100
    tier.put(b"read", b"", pinned)
    reading = tier.pin(b"read")
    tier.put(b"idle", b"", bytearray(100))
    assert tier.put_prefetched(b"a", b"", bytearray(100)) is None  # room: the tier is not full
    assert tier.put_prefetched(b"b", b"", bytearray(100)) is None  # evicts "idle", neither pinned nor prefetched
    assert b"idle" not in tier and len(tier) == 3
    assert tier.put_prefetched(b"c", b"", bytearray(100)) == "no_room", "only pinned and unread prefetches left"
    assert b"read" in tier and b"c" not in tier and bytes(reading.payload) == b"p" * 100
    assert tier.put_prefetched(b"a", b"", bytearray(100)) == "in_dram"
    tier.unpin(reading)  # no longer read: it may go now
    assert tier.put_prefetched(b"c", b"", bytearray(100)) is None
    assert b"read" not in tier and tier.bytes == 300 and tier.prefetched_bytes == 300
    assert tier.buffer(100) is pinned, "the evicted entry's buffer is recycled once its reader is done"


def test_the_prefetch_budget_bounds_unread_bytes_and_reads_and_evictions_end_prefetches():
    ended: list[tuple[str, int]] = []
    tier = HotTier(capacity_bytes=1000, prefetch_bytes=250, on_prefetch_end=lambda how, n: ended.append((how, n)))
    assert tier.put_prefetched(b"a", b"h", bytearray(99)) is None
    assert tier.put_prefetched(b"b", b"h", bytearray(99)) is None
    assert tier.put_prefetched(b"c", b"h", bytearray(99)) == "budget"
    refused = bytearray(99)
    tier.put_prefetched(b"c", b"h", refused)
    assert tier.reuse(99) is refused, "a refused buffer is the tier's to recycle"
    tier.unpin(tier.pin(b"a"))  # its first read: used, and no longer counted against the budget
    tier.unpin(tier.pin(b"a"))
    assert ended == [("used", 100)] and tier.prefetched_bytes == 100
    assert tier.put_prefetched(b"c", b"h", bytearray(99)) is None
    tier.discard(b"b")  # deleted unread
    tier.put(b"d", b"h", bytearray(949))  # with nothing else left, a plain put evicts the unread "c" too
    assert ended == [("used", 100), ("wasted", 100), ("wasted", 100)]
    assert tier.prefetched_bytes == 0 and b"c" not in tier and len(tier) == 1


def test_a_prefetch_makes_room_again_once_pins_are_gone():
    # What a prefetch may evict follows pins as they come and go, entries evicted while pinned included.
    tier = HotTier(capacity_bytes=200, prefetch_bytes=200)
    tier.put(b"x", b"", bytearray(100))
    first, second = tier.pin(b"x"), tier.pin(b"x")
    tier.put(b"y", b"", bytearray(100))
    tier.put(b"z", b"", bytearray(100))  # a plain put evicts "x" while it is read
    assert b"x" not in tier
    tier.unpin(first)
    tier.unpin(second)
    assert tier.put_prefetched(b"a", b"", bytearray(100)) is None
    assert tier.put_prefetched(b"b", b"", bytearray(100)) is None
    assert set(tier._entries) == {b"a", b"b"}


def test_plain_traffic_passes_unread_prefetches_over_and_a_held_entry_is_kept_until_read():
    tier = HotTier(4 * 100, prefetch_bytes=2 * 100)
    tier.put(b"held", b"h", b"x" * 99)
    assert tier.hold(b"held") and not tier.hold(b"absent")
    assert tier.put_prefetched(b"ahead", b"h", bytearray(99)) is None
    for i in range(6):  # traffic that would have evicted both three times over
        tier.put(b"plain%d" % i, b"h", b"y" * 99)
    assert b"held" in tier and b"ahead" in tier and len(tier) == 4
    entry = tier.pin(b"held")  # its read: an ordinary entry again
    tier.unpin(entry)
    for i in range(3):  # the two plain entries left, then the one that was held
        tier.put(b"later%d" % i, b"h", b"z" * 99)
    assert b"held" not in tier and b"ahead" in tier



def test_holding_entries_already_here_never_takes_more_than_the_prefetch_budget():
    tier = HotTier(capacity_bytes=10_000, prefetch_bytes=100)
    for key in (b"a", b"b", b"c"):
        tier.put(key, b"h", bytearray(99))  # 100 bytes each
    assert [tier.hold(key) for key in (b"a", b"b", b"c")] == [True, False, False]
    assert tier.prefetched_bytes == 100 and [tier._entries[k].prefetched for k in (b"a", b"b", b"c")] == \
        [True, False, False]

def test_with_nothing_else_to_evict_plain_traffic_takes_the_oldest_unread_prefetch():
    tier = HotTier(2 * 100, prefetch_bytes=2 * 100)
    for key in (b"a", b"b"):
        assert tier.put_prefetched(key, b"h", bytearray(99)) is None
    tier.put(b"plain", b"h", b"y" * 99)
    assert b"a" not in tier and b"b" in tier and b"plain" in tier


# -- the prefetch budget shared between tenants, and unread prefetches let go with age ---------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def prefetch(tier: HotTier, key: bytes, owner: int):
    return tier.put_prefetched(key, b"h", bytearray(99), owner)  # 100 bytes a record


def test_a_lone_tenant_may_use_the_whole_budget_and_a_second_one_takes_its_share_back():
    ended: list[tuple[str, int]] = []
    tier = HotTier(capacity_bytes=10_000, prefetch_bytes=400, on_prefetch_end=lambda how, n: ended.append((how, n)))
    for key in (b"m1", b"m2", b"m3", b"m4"):
        assert prefetch(tier, key, owner=1) is None
    assert prefetch(tier, b"m5", owner=1) == "budget", "alone, a tenant may fill the budget, not more"

    assert prefetch(tier, b"v1", owner=2) is None, "another tenant's first promotion is never shut out"
    assert ended == [("reclaimed", 100)], "the first tenant's oldest, past its half, stops being held"
    assert b"m1" in tier and not tier._entries[b"m1"].prefetched, "it stays in the tier as a plain entry"
    assert prefetch(tier, b"v2", owner=2) is None
    assert ended == [("reclaimed", 100)] * 2
    assert (tier.unread_bytes_of(1), tier.unread_bytes_of(2), tier.prefetched_bytes) == (200, 200, 400)
    assert prefetch(tier, b"v3", owner=2) == "tenant_share"
    assert prefetch(tier, b"m5", owner=1) == "tenant_share"

    tier.unpin(tier.pin(b"v1"))  # a read: the second tenant holds less, and both share the room it left
    assert prefetch(tier, b"m5", owner=1) == "tenant_share", "the first is at its share still"
    assert prefetch(tier, b"v3", owner=2) is None


def test_a_tenant_holding_a_held_entry_counts_it_against_its_share():
    tier = HotTier(capacity_bytes=10_000, prefetch_bytes=200)
    tier.put(b"plain", b"h", bytearray(99))
    assert prefetch(tier, b"m1", owner=1) is None and prefetch(tier, b"m2", owner=1) is None
    assert tier.hold(b"plain", owner=2), "within the second tenant's share: the first's oldest is let go"
    assert tier.unread_bytes_of(1) == 100 and tier.unread_bytes_of(2) == 100
    assert not tier._entries[b"m1"].prefetched and tier._entries[b"m2"].prefetched


def test_an_unread_prefetch_stops_being_held_at_the_age_limit():
    clock = Clock()
    ended: list[tuple[str, int]] = []
    tier = HotTier(capacity_bytes=10_000, prefetch_bytes=200, prefetch_max_age_s=60, clock=clock,
                   on_prefetch_end=lambda how, n: ended.append((how, n)))
    assert prefetch(tier, b"a", owner=1) is None
    clock.now += 30
    assert prefetch(tier, b"b", owner=1) is None
    clock.now += 29.5
    assert prefetch(tier, b"c", owner=1) == "budget", "younger than the limit: still held"
    clock.now += 0.5
    assert prefetch(tier, b"c", owner=1) is None, "the oldest one's budget is free at the limit"
    assert ended == [("aged", 100)] and b"a" in tier and not tier._entries[b"a"].prefetched
    clock.now += 30
    tier.release_aged()
    assert ended == [("aged", 100)] * 2 and tier.prefetched_bytes == 100
    tier.unpin(tier.pin(b"a"))  # a read of a block let go is not a promotion used
    assert ended == [("aged", 100)] * 2


def test_room_is_taken_back_only_from_tenants_past_their_share_oldest_first():
    tier = HotTier(capacity_bytes=10_000, prefetch_bytes=400)
    assert prefetch(tier, b"b", owner=2) is None  # the oldest, and its tenant ends exactly at its share
    assert prefetch(tier, b"e", owner=3) is None and prefetch(tier, b"f", owner=3) is None  # two of four
    assert prefetch(tier, b"g", owner=4) is None
    assert tier.prefetched_bytes == 400
    assert prefetch(tier, b"x", owner=1) is None  # four tenants: 100 each
    assert [key for key, entry in tier._entries.items() if entry.prefetched] == [b"b", b"f", b"g", b"x"]


def test_a_prefetch_let_go_leaves_room_a_later_one_may_evict():
    clock = Clock()
    tier = HotTier(capacity_bytes=300, prefetch_bytes=300, prefetch_max_age_s=60, clock=clock)
    for key in (b"a", b"b", b"c"):
        assert prefetch(tier, key, owner=1) is None
    assert prefetch(tier, b"d", owner=1) == "budget"
    clock.now += 60
    assert prefetch(tier, b"d", owner=1) is None, "the aged ones are plain entries, evicted for it"
    assert b"a" not in tier and len(tier) == 3
