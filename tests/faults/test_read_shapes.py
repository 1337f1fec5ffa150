"""A Get's shape and a client's memory never delete a block.

A layer range past the record: a Get of 4-layer blocks with layer_begin=5 (layer_end 0: "to the last layer")
read a negative number of bytes; the daemon took that for a truncated record and dropped every key of the
request from the index, with nothing but a read-only token. A region the client writes too: the daemon
verified SSD bytes after writing them into the client's shared region, which the client can write as well; a
client scribbling over its region during Gets made blocks fail their checksums, and the daemon dropped them.
Now the client alone checks what lands in its region, and a block it reports (Verify) is dropped only if the
daemon's own copy, read into its own memory, is corrupt too.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading

import grpc
import pytest

from kvstore import wire
from kvstore.block import KVLayout, Namespace
from kvstore.proto import method, pb

from .conftest import NS, client_for, items, raw_get, read_frame
from .test_shared_memory import lend, memfd, unix_connection

pytestmark = pytest.mark.crash

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
BAD_RANGES = [(5, 0), (4, 0), (99, 0), (3, 9), (2, 2)]  # (layer_begin, layer_end) of 4-layer blocks


@pytest.fixture
def ssd_blocks(daemons):
    """20 blocks on a daemon without a DRAM tier, so every Get reads and verifies SSD bytes."""
    daemon, = daemons(1, "--hot-tier-bytes", "0")
    blocks = items(seed=2101, n=20)
    with client_for(daemon) as client:
        assert client.put(blocks, NS.num_layers).stored == 20
    return daemon, blocks


def grpc_get(address: str, request: pb.GetRequest) -> list[pb.GetPartHead]:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(method("Get"), pb.GetRequest.SerializeToString, None)
        return [pb.GetPartHead.FromString(m) for m in call(request, timeout=30)]


def still_stored(daemon, blocks) -> None:
    with client_for(daemon) as client:
        assert client.lookup([b for b, _ in blocks]) == len(blocks), "a block was dropped from the index"
    served = raw_get(daemon.address, [b.key for b, _ in blocks])
    assert all(s.status == pb.OK and s.payload == payload for s, (_, payload) in zip(served, blocks))


@pytest.mark.parametrize("begin, end", BAD_RANGES)
def test_a_bad_layer_range_is_bad_range_on_grpc_and_drops_nothing(ssd_blocks, begin, end):
    daemon, blocks = ssd_blocks
    request = pb.GetRequest(keys=[b.key for b, _ in blocks], layer_begin=begin, layer_end=end, stop_at_miss=False)
    try:
        parts = grpc_get(daemon.address, request)
    except grpc.RpcError as exc:  # a range that is empty whatever the block: refused as a whole
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
    else:
        assert [p.status for p in parts] == [pb.BAD_RANGE] * len(blocks), [p.cause for p in parts]
    still_stored(daemon, blocks)
    assert "dropping corrupt block" not in daemon.log()


@pytest.mark.parametrize("begin, end", BAD_RANGES[:3])
def test_a_bad_layer_range_is_bad_range_on_the_data_channel_and_drops_nothing(ssd_blocks, begin, end):
    daemon, blocks = ssd_blocks
    request = pb.GetRequest(keys=[b.key for b, _ in blocks], layer_begin=begin, layer_end=end, stop_at_miss=False)
    with socket.create_connection(("127.0.0.1", daemon.data_port), timeout=10) as sock:
        sock.sendall(wire.frame(wire.GET, request.SerializeToString()))
        statuses = []
        while True:
            kind, head = read_frame(sock)  # an ERROR frame or parts, never a closed connection
            if kind in (wire.DONE, wire.ERROR):
                break
            statuses.append(pb.GetPartHead.FromString(head).status)
    assert kind == wire.DONE and statuses == [pb.BAD_RANGE] * len(blocks)
    still_stored(daemon, blocks)


@pytest.mark.parametrize("begin, end", BAD_RANGES[:3])
def test_a_bad_layer_range_into_shared_memory_drops_nothing(ssd_blocks, begin, end):
    daemon, blocks = ssd_blocks
    size = len(blocks) * NS.block_bytes
    with unix_connection(daemon) as sock:
        fd = memfd(size, SEALS)
        try:
            kind, head = lend(sock, fd, size)
            assert kind == wire.REGISTERED
            request = pb.GetRequest(keys=[b.key for b, _ in blocks], layer_begin=begin, layer_end=end,
                                    stop_at_miss=False, region_id=pb.RegionRegistered.FromString(head).region_id,
                                    region_offsets=[i * NS.block_bytes for i in range(len(blocks))])
            sock.sendall(wire.frame(wire.GET, request.SerializeToString()))
            statuses = []
            while (frame := read_frame(sock))[0] not in (wire.DONE, wire.ERROR):
                statuses.append(pb.GetPartHead.FromString(frame[1]).status)
            assert statuses == [pb.BAD_RANGE] * len(blocks)
        finally:
            os.close(fd)
    still_stored(daemon, blocks)


BIG = Namespace("scribbled", KVLayout(num_layers=4, kv_heads=8, head_dim=128, dtype="float16"), block_tokens=256)


def test_a_client_scribbling_over_its_region_never_gets_a_block_dropped(daemons):
    """4 MiB blocks, so the daemon's check of a block in the region overlaps the client's writes."""
    daemon, = daemons(1, "--hot-tier-bytes", "0")
    blocks = [(b, os.urandom(BIG.block_bytes)) for b in BIG.blocks(range(10 * BIG.block_tokens))]
    with client_for(daemon) as client:
        assert client.put(blocks, BIG.num_layers).stored == 10
    size = len(blocks) * BIG.block_bytes
    scribbling = threading.Event()
    with unix_connection(daemon) as sock:
        fd = memfd(size, SEALS)
        try:
            kind, head = lend(sock, fd, size)
            assert kind == wire.REGISTERED
            region_id = pb.RegionRegistered.FromString(head).region_id
            with mmap.mmap(fd, size) as mapping:
                def scribble() -> None:
                    junk = bytes(range(256)) * (BIG.layer_bytes // 256)
                    while not scribbling.is_set():
                        for i in range(len(blocks) * BIG.num_layers):
                            mapping[i * BIG.layer_bytes : (i + 1) * BIG.layer_bytes] = junk

                writer = threading.Thread(target=scribble, daemon=True)
                writer.start()
                causes = []
                try:
                    for _ in range(10):
                        request = pb.GetRequest(keys=[b.key for b, _ in blocks], stop_at_miss=False,
                                                region_id=region_id,
                                                region_offsets=[i * BIG.block_bytes for i in range(len(blocks))])
                        sock.sendall(wire.frame(wire.GET, request.SerializeToString()))
                        while (frame := read_frame(sock))[0] not in (wire.DONE, wire.ERROR):
                            part = pb.GetPartHead.FromString(frame[1])
                            if part.status != pb.OK:
                                causes.append(part.cause)
                finally:
                    scribbling.set()
                    writer.join(10)
        finally:
            os.close(fd)
    assert causes == [], "the bytes in a region are the client's to check"
    # The client would find its blocks corrupt, and report them: the daemon's copies are good, and stay.
    with grpc.insecure_channel(daemon.address) as channel:
        verify = channel.unary_unary(method("Verify"), pb.KeysRequest.SerializeToString, pb.CountResponse.FromString)
        assert verify(pb.KeysRequest(keys=[b.key for b, _ in blocks]), timeout=30).count == 0
    assert "dropping corrupt block" not in daemon.log()
    still_stored(daemon, blocks)
