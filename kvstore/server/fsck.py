"""Offline check of a stopped daemon's data directory: do the index and the segments agree?

Every index entry must point at a whole record in an existing segment whose header names the same
key and whose payload matches its checksums. Run as `kvstore fsck DATA_DIR`; the crash tests run it
after every kill -9 and restart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from kvstore.record import CorruptRecord, decode_header
from kvstore.server.index import Entry


@dataclass
class FsckReport:
    entries: int = 0
    verified: int = 0
    problems: list[str] = field(default_factory=list)
    segments: int = 0
    open_segments: int = 0
    segment_bytes: int = 0
    live_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def check(data_dir: Path, verify_payloads: bool = True) -> FsckReport:
    data_dir = Path(data_dir)
    report = FsckReport()
    segments: dict[int, Path] = {}
    for path in (data_dir / "segments").glob("*"):
        if path.suffix in (".open", ".sealed"):
            segments[int(path.stem.split("-")[0])] = path
            report.segments += 1
            report.open_segments += path.suffix == ".open"
            report.segment_bytes += path.stat().st_size
    env = lmdb.open(str(data_dir / "index"), readonly=True, lock=False, max_dbs=4)
    fds: dict[int, int] = {}
    try:
        blocks = env.open_db(b"blocks", create=False)
        with env.begin(db=blocks) as txn:
            for key, raw in txn.cursor():
                report.entries += 1
                entry = Entry.unpack(raw)
                problem = _check_entry(bytes(key), entry, segments, fds, verify_payloads)
                if problem:
                    report.problems.append(f"{bytes(key).hex()}: {problem}")
                else:
                    report.verified += 1
                    report.live_bytes += entry.record_len
    finally:
        env.close()
        for fd in fds.values():
            os.close(fd)
    return report


def _check_entry(key: bytes, entry: Entry, segments: dict[int, Path], fds: dict[int, int], verify: bool) -> str:
    if entry.segment not in segments:
        return f"segment {entry.segment} does not exist"
    if entry.segment not in fds:
        fds[entry.segment] = os.open(segments[entry.segment], os.O_RDONLY)
    fd = fds[entry.segment]
    if entry.offset + entry.record_len > os.fstat(fd).st_size:
        return f"record at {entry.offset}+{entry.record_len} runs past the end of segment {entry.segment}"
    try:
        header = decode_header(os.pread(fd, entry.header_len, entry.offset))
        if header.key != key:
            return "the record there belongs to another key"
        header.check_identity()
        if header.payload_len != entry.payload_len:
            return "payload length differs between index and header"
        if verify:
            header.check_layers(os.pread(fd, entry.payload_len, entry.offset + entry.header_len), 0)
    except CorruptRecord as exc:
        return str(exc)
    return ""
