"""Regression: a block too big for the DRAM tier was served with another block's bytes.

Reading a whole block from SSD fills a buffer from the DRAM tier's free list and offers it to the tier;
a block larger than the tier (every block, with hot_tier_bytes=0) was refused *and its buffer put back
on the free list* while the Get still had to send it. The read-ahead of the next blocks took the same
buffer and overwrote it, so gRPC Gets of 3 or more blocks answered OK with the wrong payload (the client
library's checksums turned that into misses; a raw reader got wrong KV).
"""

import pytest

from kvstore.proto import pb

from .conftest import NS, client_for, items, raw_get

pytestmark = pytest.mark.crash


@pytest.mark.parametrize("hot_tier", ["0", "8KiB"])  # no tier; a tier smaller than one block
def test_blocks_bigger_than_the_dram_tier_are_served_with_their_own_bytes(daemons, hot_tier):
    daemon, = daemons(1, "--hot-tier-bytes", hot_tier)
    stored = items(1, 8)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == len(stored)
    daemon.stop()
    daemon.start()  # an empty DRAM tier: every block comes from the segment file
    for _ in range(2):
        served = raw_get(daemon.address, [block.key for block, _ in stored])
        assert [got.status for got in served] == [pb.OK] * len(stored)
        assert [got.payload for got in served] == [payload for _, payload in stored]
