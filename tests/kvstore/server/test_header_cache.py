"""The header cache: bounded in bytes, least recently used first out, and a header is served only for the
place it was written at (a block moved or stored again is read from its file)."""

from __future__ import annotations

from kvstore.server.header_cache import ENTRY_OVERHEAD_BYTES, HeaderCache

KEY = [bytes([i]) * 32 for i in range(8)]
HEADER = b"h" * 500
COST = len(HEADER) + 32 + ENTRY_OVERHEAD_BYTES


def test_a_header_is_served_only_for_its_place():
    cache = HeaderCache(10 * COST)
    cache.put(KEY[0], (1, 4096), HEADER)
    assert cache.get(KEY[0], (1, 4096)) == HEADER
    assert cache.get(KEY[0], (2, 4096)) is None, "moved by compaction: read from the file"
    assert cache.get(KEY[1], (1, 4096)) is None


def test_the_cache_keeps_to_its_bytes_and_drops_the_least_recently_used():
    cache = HeaderCache(3 * COST)
    for i in range(3):
        cache.put(KEY[i], (1, i), HEADER)
    assert cache.get(KEY[0], (1, 0)) == HEADER  # now the most recent
    cache.put(KEY[3], (1, 3), HEADER)
    assert cache.get(KEY[1], (1, 1)) is None and cache.get(KEY[0], (1, 0)) == HEADER
    assert len(cache) == 3 and cache.bytes == 3 * COST
    cache.put(KEY[3], (2, 3), HEADER)  # stored again elsewhere: replaced, not counted twice
    assert cache.bytes == 3 * COST and cache.get(KEY[3], (2, 3)) == HEADER
    cache.discard(KEY[3])
    assert cache.bytes == 2 * COST


def test_a_cache_of_no_bytes_holds_nothing():
    cache = HeaderCache(0)
    cache.put(KEY[0], (1, 0), HEADER)
    assert len(cache) == 0 and cache.bytes == 0
