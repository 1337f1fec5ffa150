"""Bytes corrupted at named places of a stopped daemon's data directory (the py-lmdb habit).

Segment files: one block per named field of its record (docs/design.md section 4) has a byte flipped; after a
restart each of those is a counted miss, every other block is served byte for byte, nothing crashes, and
the daemon drops what it found corrupt so that fsck agrees afterwards. Torn tails: a record cut short at
the end of a crashed (`.open`) or of a sealed segment. The index file: whatever LMDB makes of a damaged
page, the daemon serves correct bytes or misses, or refuses to start with a clear message, never wrong
bytes and never a traceback.
"""

from __future__ import annotations

import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import lmdb
import pytest

from kvstore.proto import pb
from kvstore.record import FIXED_HEADER_BYTES, RecordHeader, build_record, decode_header
from kvstore.server.fsck import check
from kvstore.server.process import DaemonProcess
from kvstore.server.segments import SegmentSet
from tests.clean_stop import stop_clean

from .conftest import NS, client_for, items, misses_counted, raw_get

pytestmark = pytest.mark.crash


@dataclass(frozen=True, slots=True)
class Located:
    path: Path  # the segment file
    offset: int  # where the record starts in it
    header: RecordHeader


def locate_records(data_dir: Path) -> dict[bytes, Located]:
    """Every whole record of every segment, found from the records themselves (not from the index)."""
    found = {}
    segments = SegmentSet(data_dir / "segments", 1 << 40, fsync=False)
    segments.open_existing()
    try:
        for segment in segments.segments.values():
            for offset, header in segments.scan(segment):
                found[header.key] = Located(segment.path, offset, header)
    finally:
        for segment in segments.segments.values():
            os.close(segment.fd)
    return found


def named_offsets(header: RecordHeader) -> dict[str, int]:
    """Offsets from the start of a record of each part of it, for any format version."""
    sums_at = header.header_len - 8 - 8 * header.n_layers
    tokens_at = sums_at - 4 * len(header.tokens)
    places = {
        "magic": 0, "version": 4, "flags": 6, "header_len": 8, "namespace": 12, "parent": 28, "key": 44,
        "traffic class": 60, "n_tokens": 76, "n_layers": 80, "layer_bytes": 84,
        "first token id": tokens_at, "last token id": sums_at - 4,
        "first layer checksum": sums_at, "last layer checksum": sums_at + 8 * (header.n_layers - 1),
        "header checksum": header.header_len - 8,
        "first payload byte": header.header_len, "last payload byte": header.record_len - 1,
    }
    if tokens_at > FIXED_HEADER_BYTES:  # fields a later format added to the fixed part (the tenant)
        places["fixed-part extension"] = FIXED_HEADER_BYTES
    for layer in range(header.n_layers):
        places[f"layer {layer} payload"] = header.layer_offset(layer) + header.layer_bytes // 2
    return places


def flip(path: Path, offset: int, length: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(length)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def assert_no_traceback(daemon: DaemonProcess) -> None:
    assert "Traceback" not in daemon.log(), daemon.log()[-3000:]


def test_a_flipped_byte_in_any_field_of_a_record_is_a_counted_miss(daemons):
    daemon, = daemons(1)
    probe = decode_header(build_record(*items(0)[0], NS.num_layers, "chat")[0])  # every block has this layout
    names = list(named_offsets(probe)) + ["whole header zeroed", "512 payload bytes zeroed"]
    victims = {name: items(100 + i)[0] for i, name in enumerate(names)}
    bystanders = [items(1000 + i)[0] for i in range(6)]
    everything = list(victims.values()) + bystanders
    with client_for(daemon) as client:
        for item in everything:  # one put each: victims and bystanders share the segment files
            assert client.put([item], NS.num_layers).stored == 1
    assert daemon.stop() == 0

    records = locate_records(daemon.data_dir)
    for name, (block, _) in victims.items():
        where = records[block.key]
        if "zeroed" in name:  # a lost sector
            start, length = (0, where.header.header_len) if "header" in name else (where.header.header_len, 512)
            with open(where.path, "r+b") as f:
                f.seek(where.offset + start)
                f.write(bytes(length))
        else:
            flip(where.path, where.offset + named_offsets(where.header)[name])

    daemon.start()
    keys = [block.key for block, _ in everything]
    served = dict(zip(keys, raw_get(daemon.address, keys)))
    wrong = [name for name, (block, payload) in victims.items()
             if served[block.key].status == pb.OK and served[block.key].payload != payload]
    assert not wrong, f"served wrong bytes after corrupting: {wrong}"
    not_missed = [name for name, (block, _) in victims.items() if served[block.key].status == pb.OK]
    assert not not_missed, f"a corrupted record was served as if whole: {not_missed}"
    assert [served[block.key].payload for block, _ in bystanders] == [payload for _, payload in bystanders]
    assert misses_counted(daemon.address) >= len(victims)
    again = raw_get(daemon.address, keys)  # and once more: a miss stays a miss, the rest stays served
    assert all(got.status != pb.OK for got in again[: len(victims)])
    assert [got.payload for got in again[len(victims):]] == [payload for _, payload in bystanders]
    assert daemon.proc.poll() is None
    assert daemon.stop() == 0
    assert_no_traceback(daemon)
    report = check(daemon.data_dir)
    assert report.ok, f"the daemon must drop what it found corrupt: {report.problems[:3]}"


@pytest.mark.parametrize("tear", ["inside the payload", "inside the header", "garbage after the last record"])
@pytest.mark.parametrize("state", ["open", "sealed"])  # a crashed segment, or a sealed one damaged later
def test_a_torn_tail_is_a_counted_miss_and_the_records_before_it_are_served(daemons, tear, state):
    daemon, = daemons(1)
    kept = [items(200 + i)[0] for i in range(4)]
    torn = items(300)[0]
    with client_for(daemon) as client:
        for item in kept + [torn]:
            assert client.put([item], NS.num_layers).stored == 1
    assert daemon.stop() == 0
    where = locate_records(daemon.data_dir)[torn[0].key]
    assert where.offset + where.header.record_len == where.path.stat().st_size, "the torn record must be last"
    if tear == "garbage after the last record":
        with open(where.path, "ab") as f:
            f.write(os.urandom(3000))
    else:
        cut = where.header.header_len + 100 if tear == "inside the payload" else 50
        os.truncate(where.path, where.offset + cut)
    if state == "open":
        where.path.rename(where.path.with_suffix(".open"))

    daemon.start()
    served = raw_get(daemon.address, [block.key for block, _ in kept + [torn]])
    assert [got.payload for got in served[:-1]] == [payload for _, payload in kept]
    if tear == "garbage after the last record":
        assert served[-1].payload == torn[1], "garbage after a whole record must not cost the record"
    else:
        assert served[-1].status != pb.OK
        assert misses_counted(daemon.address) >= 1
    assert daemon.stop() == 0
    assert_no_traceback(daemon)
    report = check(daemon.data_dir)
    assert report.ok and report.open_segments == 0, report.problems[:3]


# -- the LMDB index -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A stopped daemon's data directory holding known blocks (one-block prompts), and those blocks.

    Its index is compacted (LMDB's own copy), so no stale copy of a page lies in the file: each key
    appears in it once, where the live tree holds it."""
    base = tmp_path_factory.mktemp("pristine")
    daemon = DaemonProcess(base / "data", base)
    daemon.start()
    stored = [items(400 + i)[0] for i in range(24)]
    try:
        with client_for(daemon) as client:
            assert client.put(stored, NS.num_layers).stored == len(stored)
    finally:
        problems = stop_clean(daemon)
    assert not problems, "\n".join(problems)
    index = base / "data" / "index"
    env = lmdb.open(str(index), readonly=True, lock=False, max_dbs=4)
    env.copy(str(base), compact=True)  # writes base/data.mdb
    env.close()
    os.replace(base / "data.mdb", index / "data.mdb")
    return base / "data", stored


def _index_offsets(data_dir: Path, key: bytes) -> dict[str, int]:
    """Named places in the index's data.mdb: meta pages, and the leaf node holding `key`."""
    env = lmdb.open(str(data_dir / "index"), readonly=True, lock=False, max_dbs=4)
    page = env.stat()["psize"]
    env.close()
    data = (data_dir / "index" / "data.mdb").read_bytes()
    at = data.find(key)
    assert at > 0 and data.find(key, at + 1) < 0, "the key must appear once in the index file"
    leaf = at - at % page
    # A leaf node is: data size (u32), flags (u16), key size (u16), the key, then the value (the Entry).
    return {
        "meta page 0 magic": 16, "meta page 0 version": 20,
        "meta page 1 magic": page + 16, "meta page 1 version": page + 20,
        "leaf page flags": leaf + 10, "leaf page bounds": leaf + 12,
        "node data size": at - 8, "node key size": at - 2,
        "entry key": at + 5,
        "entry segment id": at + 16, "entry offset": at + 16 + 4, "entry header_len": at + 16 + 12,
        "entry payload_len": at + 16 + 16, "entry expiry": at + 16 + 20 + 5,
    }


INDEX_PLACES = [
    "meta page 0 magic", "meta page 0 version", "meta page 1 magic", "meta page 1 version",
    "leaf page flags", "leaf page bounds", "node data size", "node key size", "entry key", "entry segment id",
    "entry offset", "entry header_len", "entry payload_len", "entry expiry", "both meta pages", "file cut to two pages",
]


@pytest.mark.parametrize("place", INDEX_PLACES)
def test_a_damaged_index_never_serves_wrong_bytes_nor_crashes(pristine, tmp_path, place):
    source, stored = pristine
    data_dir = tmp_path / "data"
    shutil.copytree(source, data_dir)
    mdb = data_dir / "index" / "data.mdb"
    offsets = _index_offsets(data_dir, stored[5][0].key)
    if place == "both meta pages":
        flip(mdb, offsets["meta page 0 magic"], 4)
        flip(mdb, offsets["meta page 1 magic"], 4)
    elif place == "file cut to two pages":
        os.truncate(mdb, 2 * (offsets["meta page 1 magic"] - 16))  # the meta pages, and no tree
    else:
        flip(mdb, offsets[place])

    daemon = DaemonProcess(data_dir, tmp_path)
    try:
        daemon.start()
    except RuntimeError:
        code = daemon.proc.returncode
        log = daemon.log()
        assert code > 0, f"the daemon died of signal {signal.Signals(-code).name} at start-up:\n{log[-2000:]}"
        assert "Traceback" not in log, f"refused to start with a traceback instead of a message:\n{log[-3000:]}"
        assert "index" in log.lower(), log[-2000:]
        return
    try:
        served = raw_get(daemon.address, [block.key for block, _ in stored])
        wrong = [i for i, (got, (_, payload)) in enumerate(zip(served, stored))
                 if got.status == pb.OK and got.payload != payload]
        assert not wrong, f"blocks {wrong} served with wrong bytes"
        assert daemon.proc.poll() is None
    finally:
        code = daemon.stop() if daemon.proc.poll() is None else daemon.proc.returncode
    assert code == 0, f"exit code {code} after serving from a damaged index:\n{daemon.log()[-3000:]}"
    assert_no_traceback(daemon)
