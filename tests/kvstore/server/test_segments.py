"""Segment appends, buffered and O_DIRECT: where records go, and that scans and recovery find them all."""

from __future__ import annotations

import mmap
import os

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.record import build_record, decode_header, encode_header
from kvstore.server.frames import FRAME_BYTES, KEY_FILE, FrameKeyDamaged, FrameKeyMissing
from kvstore.server.segments import ALIGN, STAGING_BYTES, SegmentSet

DIRECT_MIN = 64 * 1024


def record(seed: int, payload_bytes: int) -> tuple[bytes, bytes]:
    """Header and payload of a record of `payload_bytes` (two layers)."""
    ns = Namespace("segments", KVLayout(num_layers=2, kv_heads=1, head_dim=payload_bytes // 128, dtype="float16"),
                   block_tokens=16)
    block = ns.blocks(range(seed * 16, seed * 16 + 16))[0]
    return build_record(block, os.urandom(ns.block_bytes), 2, "chat")


def whole(record: tuple[bytes, bytes]) -> tuple[bytes, list[bytes]]:
    """A record as `append` takes it: its header, and its payload in pieces."""
    return record[0], [record[1]]


NS_BARE = Namespace("bare", KVLayout(num_layers=2, kv_heads=1, head_dim=8, dtype="float16"), block_tokens=16)
SIZES = [4096, 3 * DIRECT_MIN, 256, 2 * STAGING_BYTES + 3 * 4096, 8192, DIRECT_MIN]  # small and direct, mixed


@pytest.mark.parametrize("direct_min", [0, DIRECT_MIN])
def test_appends_are_read_back_and_scanned_and_recovered_whole(tmp_path, direct_min):
    segments = SegmentSet(tmp_path, 1 << 30, fsync=False, direct_min_bytes=direct_min)
    written = []
    for seed, size in enumerate(SIZES):
        header, payload = record(seed, size)
        segment, offset = segments.append(100, header, [payload])
        written.append((offset, header, payload))
        if direct_min and len(header) + len(payload) >= direct_min:
            assert (offset - FRAME_BYTES) % ALIGN == 0 and segment.size % ALIGN == 0, \
                "a direct record's frame is aligned, and the record padded"
        assert SegmentSet.read(segment, offset, len(header) + len(payload)) == header + payload
    offsets = [offset for offset, _, _ in written]
    if not direct_min:
        assert offsets == [sum(FRAME_BYTES + len(h) + len(p) for _, h, p in written[:i]) + FRAME_BYTES
                           for i in range(len(written))], "buffered records follow one another, each behind its frame"
    assert [offset for offset, _ in segments.scan(segment)] == offsets
    segments.close()
    os.rename(segment.path, segment.path.with_suffix(".open"))  # as a crash leaves it

    reopened = SegmentSet(tmp_path, 1 << 30, fsync=False)
    unfinished = reopened.open_existing()
    recovered = reopened.recover(unfinished[0])
    assert [(offset, header.key) for offset, header in recovered] == \
        [(offset, decode_header(h).key) for offset, h, _ in written]
    for offset, header, payload in written:
        assert SegmentSet.read(unfinished[0], offset + len(header), len(payload)) == payload
    reopened.close()


def test_a_direct_record_torn_by_a_crash_is_cut_off_and_the_ones_before_it_are_kept(tmp_path):
    segments = SegmentSet(tmp_path, 1 << 30, fsync=False, direct_min_bytes=DIRECT_MIN)
    kept = [segments.append(100, *whole(record(seed, 2 * DIRECT_MIN))) for seed in range(3)]
    torn_segment, torn_offset = segments.append(100, *whole(record(9, 2 * DIRECT_MIN)))
    size = torn_segment.size
    segments.close()
    path = torn_segment.path
    os.rename(torn_segment.path, path.with_suffix(".open"))
    os.truncate(path.with_suffix(".open"), torn_offset + DIRECT_MIN)  # the crash tore the last record
    reopened = SegmentSet(tmp_path, 1 << 30, fsync=False)
    segment, = reopened.open_existing()
    assert [offset for offset, _ in reopened.recover(segment)] == [offset for _, offset in kept]
    assert segment.size < size
    reopened.close()



def test_no_scan_takes_a_record_from_a_payload_even_behind_a_copy_of_a_real_frame(tmp_path):
    """A payload holding whole records, one of them behind a byte-for-byte copy of a frame the daemon wrote:
    the tag binds a frame to its place, so the copy is nothing anywhere else."""
    segments = SegmentSet(tmp_path, 1 << 30, fsync=False)
    genuine = record(1, 4096)
    segment, offset = segments.append(100, *whole(genuine))
    framed_copy = SegmentSet.read(segment, offset - FRAME_BYTES, FRAME_BYTES + len(genuine[0]) + len(genuine[1]))
    forged = record(2, 4096)
    hostile = framed_copy + forged[0] + forged[1]
    carrier = record(3, 16384)  # whose payload begins with the hostile bytes (its layer checksums aside)
    _, carrier_offset = segments.append(100, carrier[0], [hostile + carrier[1][len(hostile) :]])
    after = record(4, 4096)
    _, after_offset = segments.append(100, *whole(after))
    assert [offset for offset, _ in segments.scan(segment)] == [offset, carrier_offset, after_offset]
    segments.close()
    os.rename(segment.path, segment.path.with_suffix(".open"))
    os.truncate(segment.path.with_suffix(".open"), carrier_offset + len(carrier[0]) + len(hostile))  # torn there
    reopened = SegmentSet(tmp_path, 1 << 30, fsync=False)
    unfinished, = reopened.open_existing()
    assert [offset for offset, _ in reopened.recover(unfinished)] == [offset], "the torn carrier is cut off whole"
    assert unfinished.size == offset + len(genuine[0]) + len(genuine[1])
    reopened.close()


def test_a_place_whose_record_never_came_is_skipped_whole_and_the_records_after_it_are_kept(tmp_path):
    segments = SegmentSet(tmp_path, 1 << 30, fsync=False, direct_min_bytes=DIRECT_MIN)
    before = segments.append(100, *whole(record(1, 2 * DIRECT_MIN)))
    lure = record(2, 4096)  # a whole record, and bare headers declaring much of the file as their payload
    bare = b"".join(encode_header(block, "chat", 2, (k + 1) * DIRECT_MIN, [0, 0])
                    for k, block in enumerate(NS_BARE.blocks(range(16 * 16))))
    hostile = lure[0] + lure[1] + bare
    placement = segments.place(100, len(lure[0]), 2 * DIRECT_MIN)
    assert placement is not None
    page = bytearray(2 * DIRECT_MIN)
    page[: len(hostile)] = hostile
    view = memoryview(mmap.mmap(-1, len(page)))
    view[:] = page
    segments.write_payload(placement, 0, view, last=True)  # the payload is in, its header never comes
    after = [segments.append(100, *whole(record(seed, size))) for seed, size in ((4, 3 * DIRECT_MIN), (5, 300))]
    segment = placement.segment
    assert [offset for offset, _ in segments.scan(segment)] == [before[1]] + [offset for _, offset in after]
    segments.finish(placement)
    segments.close()
    os.rename(segment.path, segment.path.with_suffix(".open"))  # as a crash leaves it: the place still reserved
    reopened = SegmentSet(tmp_path, 1 << 30, fsync=False)
    unfinished, = reopened.open_existing()
    assert [offset for offset, _ in reopened.recover(unfinished)] == [before[1]] + [offset for _, offset in after]
    reopened.close()


def test_segments_without_their_frame_key_cannot_be_opened_and_an_empty_directory_makes_one(tmp_path):
    segments = SegmentSet(tmp_path, 1 << 30, fsync=False)
    key_file = tmp_path / KEY_FILE
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(key_file.read_bytes()) == 32
    segments.append(100, *whole(record(1, 4096)))
    segments.close()
    assert SegmentSet(tmp_path, 1 << 30, fsync=False).frames._key == key_file.read_bytes(), "kept across opens"
    key_file.unlink()
    with pytest.raises(FrameKeyMissing):
        SegmentSet(tmp_path, 1 << 30, fsync=False)
    key_file.write_bytes(b"short")
    with pytest.raises(FrameKeyDamaged):
        SegmentSet(tmp_path, 1 << 30, fsync=False)


@pytest.mark.parametrize("aligned", [True, False])
def test_a_place_is_reserved_with_its_first_payload_bytes_and_its_record_frame_replaces_the_reservation(tmp_path,
                                                                                                       aligned):
    """The first payload bytes go to disk behind the place's frame, which spans it whole (a scan after a crash
    jumps over it without reading inside); the record's own frame and header replace it last."""
    segments = SegmentSet(tmp_path, 1 << 30, fsync=False, direct_min_bytes=DIRECT_MIN)
    header, payload = record(1, 2 * DIRECT_MIN)
    placement = segments.place(100, len(header), len(payload))
    segment = placement.segment
    assert not any(os.pread(segment.fd, FRAME_BYTES, placement.frame_offset)), "nothing before the first bytes"
    buffer = mmap.mmap(-1, len(payload) + 1)  # page-aligned, or one byte off: through the staging buffer
    view = memoryview(buffer)[(0 if aligned else 1) :][: len(payload)]
    view[:] = payload
    segments.write_payload(placement, 0, view[:DIRECT_MIN], last=False)
    frame = os.pread(segment.fd, FRAME_BYTES, placement.frame_offset)
    assert segments.frames.check_reserved(segment.id, placement.frame_offset, frame) == \
        placement.end - placement.frame_offset
    assert segments.frames.check_reserved(segment.id, placement.frame_offset + ALIGN, frame) is None, \
        "a reservation is bound to its place"
    assert os.pread(segment.fd, DIRECT_MIN, placement.payload_offset) == payload[:DIRECT_MIN]
    assert list(segments.scan(segment)) == [], "a reserved place holds no record"
    segments.write_payload(placement, DIRECT_MIN, view[DIRECT_MIN:], last=True)
    segments.write_header(placement, header)
    frame = os.pread(segment.fd, FRAME_BYTES, placement.frame_offset)
    assert segments.frames.check_reserved(segment.id, placement.frame_offset, frame) is None
    assert segments.frames.check_record(segment.id, placement.frame_offset, frame, header, len(header) + len(payload))
    assert [(offset, h.key) for offset, h in segments.scan(segment)] == [(placement.offset, decode_header(header).key)]
    assert os.pread(segment.fd, len(payload), placement.payload_offset) == payload
    segments.finish(placement)
    segments.close()
