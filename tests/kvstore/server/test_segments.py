"""Segment appends, buffered and O_DIRECT: where records go, and that scans and recovery find them all."""

from __future__ import annotations

import os

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.record import build_record, decode_header
from kvstore.server.segments import ALIGN, STAGING_BYTES, SegmentSet

DIRECT_MIN = 64 * 1024


def record(seed: int, payload_bytes: int) -> tuple[bytes, bytes]:
    """Header and payload of a record of `payload_bytes` (two layers)."""
    ns = Namespace("segments", KVLayout(num_layers=2, kv_heads=1, head_dim=payload_bytes // 128, dtype="float16"),
                   block_tokens=16)
    block = ns.blocks(range(seed * 16, seed * 16 + 16))[0]
    return build_record(block, os.urandom(ns.block_bytes), 2, "chat")


SIZES = [4096, 3 * DIRECT_MIN, 256, 2 * STAGING_BYTES + 3 * 4096, 8192, DIRECT_MIN]  # small and direct, mixed


@pytest.mark.parametrize("direct_min", [0, DIRECT_MIN])
def test_appends_are_read_back_and_scanned_and_recovered_whole(tmp_path, direct_min):
    segments = SegmentSet(tmp_path, 1 << 30, fsync=False, direct_min_bytes=direct_min)
    written = []
    for seed, size in enumerate(SIZES):
        header, payload = record(seed, size)
        segment, offset = segments.append(100, [header, payload])
        written.append((offset, header, payload))
        if direct_min and len(header) + len(payload) >= direct_min:
            assert offset % ALIGN == 0 and segment.size % ALIGN == 0, "a direct record is aligned and padded"
        assert SegmentSet.read(segment, offset, len(header) + len(payload)) == header + payload
    offsets = [offset for offset, _, _ in written]
    if not direct_min:
        assert offsets == [sum(len(h) + len(p) for _, h, p in written[:i]) for i in range(len(written))], \
            "buffered records follow one another with no gap"
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
    kept = [segments.append(100, list(record(seed, 2 * DIRECT_MIN))) for seed in range(3)]
    torn_segment, torn_offset = segments.append(100, list(record(9, 2 * DIRECT_MIN)))
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

