"""Properties of the data channel's frame prefix parser (kvstore/wire.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import wire

pytestmark = pytest.mark.unit
PROPERTY = settings(max_examples=200, deadline=None)


@PROPERTY
@given(st.one_of(st.binary(max_size=32), st.binary(min_size=4, max_size=8).map(lambda b: wire.MAGIC + b)))
def test_any_bytes_are_a_frame_error_or_a_valid_prefix(prefix):
    try:
        kind, head_len = wire.parse_prefix(prefix)
    except wire.FrameError:
        return
    assert len(prefix) == wire.PREFIX.size and prefix[:4] == wire.MAGIC
    assert 0 <= kind <= 255 and 0 <= head_len <= wire.MAX_HEAD_BYTES


@PROPERTY
@given(st.integers(0, 255), st.binary(max_size=64))
def test_a_frame_prefix_reads_back_its_kind_and_head_length(kind, head):
    framed = wire.frame(kind, head)
    assert wire.parse_prefix(framed[: wire.PREFIX.size]) == (kind, len(head))
    assert framed[wire.PREFIX.size :] == head


@PROPERTY
@given(st.integers(0, 255), st.integers(wire.MAX_HEAD_BYTES + 1, 2**32 - 1))
def test_a_head_longer_than_the_limit_is_refused_before_anything_is_allocated(kind, head_len):
    with pytest.raises(wire.FrameError, match="exceeds"):
        wire.parse_prefix(wire.PREFIX.pack(wire.MAGIC, kind, head_len))
