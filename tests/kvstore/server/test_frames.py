"""Record frames (kvstore/server/frames.py): a frame is valid for one record, at one place, under one key."""

from __future__ import annotations

import os
import secrets

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.record import build_record
from kvstore.server.frames import FRAME_BYTES, Frames, Kind, parse_frame
from kvstore.server.segments import Segment, scan

pytestmark = pytest.mark.unit

NS = Namespace("frames", KVLayout(num_layers=2, kv_heads=1, head_dim=16, dtype="float16"), block_tokens=8)


def record(seed: int) -> tuple[bytes, bytes]:
    block = NS.blocks(range(seed * 8, seed * 8 + 8))[0]
    return build_record(block, os.urandom(NS.block_bytes), NS.num_layers, "chat")


def test_a_record_frame_holds_for_its_segment_offset_length_header_and_key_alone():
    frames = Frames(secrets.token_bytes(32))
    header, payload = record(1)
    other_header, _ = record(2)
    length = len(header) + len(payload)
    frame = frames.record(7, 4096, header, length)
    assert parse_frame(frame) == (Kind.RECORD, length) and len(frame) == FRAME_BYTES
    assert frames.check_record(7, 4096, frame, header, length)
    assert not frames.check_record(8, 4096, frame, header, length), "another segment"
    assert not frames.check_record(7, 4128, frame, header, length), "another place"
    assert not frames.check_record(7, 4096, frame, other_header, length), "another header"
    assert not frames.check_record(7, 4096, frame, header, length + 1), "another length"
    assert not Frames(secrets.token_bytes(32)).check_record(7, 4096, frame, header, length), "another key"
    assert frames.check_reserved(7, 4096, frame) is None, "a record's frame reserves nothing"


def test_a_reservation_holds_for_its_place_alone():
    frames = Frames(secrets.token_bytes(32))
    frame = frames.reserved(3, 8192, 65536)
    assert frames.check_reserved(3, 8192, frame) == 65536
    assert frames.check_reserved(3, 0, frame) is None and frames.check_reserved(4, 8192, frame) is None
    forged = frame[:8] + (1 << 40).to_bytes(8, "little") + frame[16:]  # a longer reach, the same tag
    assert frames.check_reserved(3, 8192, forged) is None
    assert not frames.check_record(3, 8192, frame, b"", 65536), "a reservation is no record"


def test_a_scan_takes_no_record_whose_frame_and_header_disagree_on_its_length(tmp_path):
    """Only the daemon makes frames, so this is a bug of its own, not an attack: the record is not taken."""
    frames = Frames(secrets.token_bytes(32))
    header, payload = record(1)
    path = tmp_path / "0000000001-100.open"
    good = frames.record(1, 0, header, len(header) + len(payload)) + header + payload
    wrong = frames.record(1, len(good), header, len(header) + len(payload) - 8) + header + payload
    path.write_bytes(good + wrong)
    fd = os.open(path, os.O_RDONLY)
    try:
        segment = Segment(1, 100, path, fd, len(good + wrong), sealed=True)
        assert [offset for offset, _ in scan(segment, frames)] == [FRAME_BYTES]
    finally:
        os.close(fd)


@pytest.mark.parametrize("key", [b"", b"x" * 31, b"x" * 33])
def test_a_frame_key_is_32_bytes(key):
    with pytest.raises(ValueError):
        Frames(key)
