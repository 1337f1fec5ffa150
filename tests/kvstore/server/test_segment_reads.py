"""Segment reads: from the page cache where it holds the bytes, else O_DIRECT straight to the destination
(or through an aligned bounce buffer), the same bytes either way, verified piece by piece, and a cold read
takes no page-cache pages."""

from __future__ import annotations

import mmap
import os
import random

import pytest

from kvstore.record import CorruptRecord
from kvstore.server.frames import FRAME_BYTES
from kvstore.server.segments import ALIGN, DIRECT_READ_MIN_BYTES, VERIFY_PIECE_BYTES, SegmentSet, _resident_bytes

SIZE = 3 * 2**20 + 777  # not a multiple of a page, so the file ends mid-page


@pytest.fixture
def segment(tmp_path):
    """A segment holding a frame and SIZE random bytes, written buffered, then flushed and dropped from the page
    cache; with the file's bytes."""
    segments = SegmentSet(tmp_path, 1 << 30, fsync=False, direct_min_bytes=DIRECT_READ_MIN_BYTES)
    data = random.Random(7).randbytes(SIZE)
    written, _ = segments.append(100, data[: SIZE // 2], [data[SIZE // 2 :]])
    assert written.direct_reads
    data = os.pread(written.fd, FRAME_BYTES, 0) + data
    os.fsync(written.fd)
    os.posix_fadvise(written.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    yield written, data
    segments.close()


def cached(segment, offset: int, length: int) -> bool:
    """Whether the page cache holds the first page of the bytes (mincore, which reads nothing)."""
    return _resident_bytes(segment, offset, length) > 0


def test_a_cold_read_returns_the_bytes_and_leaves_the_page_cache_empty(segment):
    seg, data = segment
    offset, length = 12_345, 2 * 2**20 + 99  # unaligned both ends: through the bounce buffer
    assert not cached(seg, offset, ALIGN)
    view = memoryview(bytearray(length))
    SegmentSet.read_into(seg, offset, view)
    assert view == data[offset : offset + length]
    assert not cached(seg, offset + ALIGN, ALIGN), "an O_DIRECT read takes no page-cache pages"


def test_a_read_whose_memory_lines_up_with_the_file_goes_straight_into_it(segment):
    seg, data = segment
    offset, length = 5 * ALIGN + 100, 1 << 20
    mapping = mmap.mmap(-1, length + 2 * ALIGN)
    view = memoryview(mapping)[100 : 100 + length]  # the same place within a page as the file offset
    SegmentSet.read_into(seg, offset, view)
    assert view == data[offset : offset + length]
    assert not cached(seg, offset + ALIGN, ALIGN)
    view.release()


def test_a_read_of_cached_bytes_comes_from_the_page_cache_and_a_partly_cached_one_is_whole(segment):
    seg, data = segment
    os.pread(seg.fd, 256 * 1024, 0)  # the first stretch cached; what readahead adds varies
    assert cached(seg, 0, SIZE)
    view = memoryview(bytearray(len(data)))
    SegmentSet.read_into(seg, 0, view)
    assert view == data


@pytest.mark.parametrize("seed", range(8))
def test_reads_of_any_range_verify_every_byte_once_in_order(segment, seed):
    seg, data = segment
    rng = random.Random(seed)
    offset = rng.randrange(SIZE - DIRECT_READ_MIN_BYTES)
    length = rng.randrange(1, SIZE - offset + 1)
    if seed % 2:  # half of them with some of the bytes in the page cache
        os.pread(seg.fd, rng.randrange(1, SIZE), rng.randrange(SIZE))
    piece_bytes = rng.choice([VERIFY_PIECE_BYTES, 3 * 131_072, 5 * 77_777])  # whole layers of any size
    seen: list[tuple[int, bytes]] = []
    view = memoryview(bytearray(length))
    SegmentSet.read_into(seg, offset, view, lambda start, piece: seen.append((start, bytes(piece))), piece_bytes)
    assert view == data[offset : offset + length]
    assert b"".join(piece for _, piece in seen) == data[offset : offset + length]
    assert [start for start, _ in seen] == [i * piece_bytes for i in range(len(seen))], \
        "each piece verified is whole: a checksum covers whole layers"


@pytest.mark.parametrize("warm", [False, True])
def test_a_read_past_the_end_of_the_file_is_a_truncated_record(segment, warm):
    seg, _ = segment
    if warm:
        os.pread(seg.fd, SIZE, 0)
    with pytest.raises(CorruptRecord) as raised:
        SegmentSet.read_into(seg, SIZE - 1000, memoryview(bytearray(DIRECT_READ_MIN_BYTES)))
    assert raised.value.cause == "truncated"


def test_a_segment_deleted_under_a_reader_is_still_read_whole(tmp_path):
    segments = SegmentSet(tmp_path, 1 << 30, fsync=False, direct_min_bytes=DIRECT_READ_MIN_BYTES)
    data = os.urandom(2**20)
    seg, offset = segments.append(100, data, [])
    held = segments.acquire(seg.id)
    segments.delete(seg)  # unlinked; its descriptor stays open for the reader
    os.posix_fadvise(seg.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    view = memoryview(bytearray(len(data)))
    SegmentSet.read_into(held, offset, view)
    assert view == data
    segments.release(held)
    assert held.read_direct_fd is None
