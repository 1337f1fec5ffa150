"""The eviction hint, as the client writes it into a PutHead and the daemon reads it back."""

import pytest

from kvstore.client.dataplane import put_head
from kvstore.eviction import ReuseHint
from kvstore.proto import pb
from kvstore.server.requests import RequestError, reuse_hint

pytestmark = pytest.mark.unit


def test_a_hint_survives_the_wire():
    head = pb.PutHead.FromString(put_head(100, ReuseHint(3, 8, 5)))
    assert head.record_bytes == 100 and reuse_hint(head) == ReuseHint(3, 8, 5)


def test_no_hint_reads_as_none():
    assert reuse_hint(pb.PutHead.FromString(put_head(100, None))) is None


def test_a_hint_claiming_more_cached_blocks_than_the_prompt_has_is_refused():
    with pytest.raises(RequestError, match="5 of 4 blocks"):
        reuse_hint(pb.PutHead(record_bytes=1, request_hit_blocks=5, request_blocks=4))
