"""Regression: Gets that stopped at a miss leaked a reader of a segment, so deleted segments stayed open.

A block-major Get reads the next blocks ahead; when it stops at a miss (the client always asks with
stop_at_miss), the read-ahead is cancelled. A cancellation that landed while a block's header was being
read left its segment acquired and never released. Once compaction deleted that segment, its file
descriptor was never closed and its disk space never returned: bench/soak.py saw the daemon's open
descriptors climb by one per deleted segment, every one "(deleted)".
"""

import os
import time

import grpc
import pytest

from kvstore.proto import method, pb

from .conftest import NS, client_for, items

pytestmark = pytest.mark.crash


def deleted_files_held(pid: int) -> list[str]:
    links = (os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    return [link for link in links if link.endswith("(deleted)")]


def test_gets_stopped_at_a_miss_leave_no_deleted_segment_open(daemons):
    # Small segments, sealed every few blocks; no DRAM tier, so every read goes to a segment file.
    daemon, = daemons(1, "--hot-tier-bytes", "0", "--segment-bytes", "64KiB", "--sweep-interval-s", "0.2")
    stored = [items(800 + i)[0] for i in range(24)]
    keys = [block.key for block, _ in stored]
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == len(stored)
    with grpc.insecure_channel(daemon.address) as channel:
        get = channel.unary_stream(method("Get"), pb.GetRequest.SerializeToString, None)
        for start in range(len(keys) - 2):  # a miss first: the blocks read ahead behind it are abandoned
            list(get(pb.GetRequest(keys=[os.urandom(16)] + keys[start : start + 3], stop_at_miss=True), timeout=10))
    with client_for(daemon) as client:
        assert client.delete([block for block, _ in stored]) == len(stored)
    segments = daemon.data_dir / "segments"
    deadline = time.monotonic() + 60  # compaction deletes the emptied, sealed segments on its next passes
    while any(path.suffix == ".sealed" for path in segments.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(path.suffix == ".sealed" for path in segments.iterdir()), "compaction must delete them"
    assert deleted_files_held(daemon.proc.pid) == []
