"""Records written to their segment while they arrive on the data channel (kvstore/server/arriving.py): the
payload on a page boundary, the header written last; a record cut off, or with a corrupt layer, or killed
between its payload and its header, leaves no record, and its place holds only zeros."""

from __future__ import annotations

import mmap
import os
import socket

import pytest

from kvstore import wire
from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.proto import pb
from kvstore.record import build_record
from kvstore.server.arriving import WRITE_STEP, WRITES_IN_FLIGHT, ArrivingRecord
from kvstore.server.frames import FRAME_BYTES
from kvstore.server.fsck import check
from kvstore.server.segments import ALIGN, SegmentSet
from tests.faults.conftest import read_frame
from tests.waiting import wait_for

from .conftest import read_all, records

pytestmark = pytest.mark.integration

# 2 MiB records of four 512 KiB layers: several receive steps and writes each
NS = Namespace("arriving", KVLayout(num_layers=4, kv_heads=8, head_dim=128, dtype="float16"), block_tokens=128)
DIRECT = ("--direct-io-min-bytes", "64KiB", "--max-block-bytes", "4MiB")


def record(seed: int) -> tuple[bytes, bytes, bytes]:
    """(key, header, payload) of a fresh record."""
    block = NS.blocks(range(seed * NS.block_tokens, (seed + 1) * NS.block_tokens))[0]
    header, payload = build_record(block, os.urandom(NS.block_bytes), NS.num_layers, "chat")
    return block.key, header, payload


def put_frame(header: bytes, payload_bytes: int) -> bytes:
    return wire.frame(wire.PUT, pb.PutHead(record_bytes=len(header) + payload_bytes).SerializeToString()) + header


def send_raw(daemon, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", daemon.data_port), timeout=30)
    sock.sendall(data)
    return sock


def put_whole(daemon, seeds: range) -> dict[bytes, bytes]:
    """Put records through the client (the data channel); their keys and payloads."""
    with KVClient(ClientConfig((daemon.address,), shared_memory="off")) as client:
        stored = {}
        for seed in seeds:
            block = NS.blocks(range(seed * NS.block_tokens, (seed + 1) * NS.block_tokens))[0]
            payload = os.urandom(NS.block_bytes)
            assert client.put([(block, payload)], NS.num_layers).stored == 1
            stored[block.key] = payload
        return stored


def segment_contents(data_dir) -> tuple[dict[bytes, tuple[int, int]], list[bytes]]:
    """Each record the segments hold (key -> (offset, header_len); a key found twice fails), and the bytes
    of every segment file outside the pages its records occupy."""
    segments = SegmentSet(data_dir / "segments", 1 << 40, fsync=False)
    segments.open_existing()
    found: dict[bytes, tuple[int, int]] = {}
    outside: list[bytes] = []
    try:
        for segment in segments.segments.values():
            data = SegmentSet.read(segment, 0, segment.size)
            at = 0
            for offset, header in segments.scan(segment):
                assert header.key not in found, "a key's record is held twice"
                found[header.key] = (offset, header.header_len)
                outside.append(data[at : offset - FRAME_BYTES])  # the frame is the record's
                at = offset + header.record_len
            outside.append(data[at:])
    finally:
        for segment in segments.segments.values():
            os.close(segment.fd)
    return found, outside


def test_a_large_put_has_its_payload_on_a_page_boundary_and_reads_back_after_a_restart(daemons):
    daemon, = daemons(1, *DIRECT)
    stored = put_whole(daemon, range(1, 4))
    assert daemon.stop() == 0
    found, outside = segment_contents(daemon.data_dir)
    assert set(found) == set(stored)
    for offset, header_len in found.values():
        assert (offset + header_len) % ALIGN == 0 and offset % ALIGN != 0, "written as it arrived: header last"
    assert all(not any(gap) for gap in outside), "between records there are only zeros"
    assert check(daemon.data_dir).ok
    daemon.start()
    with KVClient([daemon.address]) as client:
        blocks = [NS.blocks(range(s * NS.block_tokens, (s + 1) * NS.block_tokens))[0] for s in range(1, 4)]
        assert [bytes(g.payload) for g in client.get(blocks)] == [stored[b.key] for b in blocks]


@pytest.mark.parametrize("how", ["cut off", "corrupt layer 0", "corrupt layer 2"])
def test_a_record_that_fails_as_it_arrives_leaves_only_zeros_and_the_daemon_serves_on(daemons, how):
    daemon, = daemons(1, *DIRECT)
    key, header, payload = record(50)
    if how == "cut off":  # three of four layers, then the client goes away
        send_raw(daemon, put_frame(header, len(payload)) + payload[: 3 * NS.layer_bytes]).close()
    else:
        flipped = bytearray(payload)
        layer = int(how[-1])  # layer 2: layers 0 and 1 are verified and written first; layer 0: nothing is
        flipped[layer * NS.layer_bytes + 5] ^= 1
        with send_raw(daemon, put_frame(header, len(payload)) + bytes(flipped)) as sock:
            kind, _ = read_frame(sock)
            assert kind == wire.ERROR, "a layer that fails its checksum fails the put as soon as it is in"
    stored = put_whole(daemon, range(60, 63))
    assert daemon.stop() == 0  # the record given up is erased before the daemon ends
    found, outside = segment_contents(daemon.data_dir)
    assert key not in found and set(found) == set(stored)
    assert all(not any(gap) for gap in outside), "the place of the record given up holds only zeros"
    assert check(daemon.data_dir).ok


@pytest.mark.parametrize("durability", ["fsync", "os"])
def test_a_kill_between_the_payload_and_the_header_leaves_no_record(daemons, durability):
    daemon, = daemons(1, *DIRECT, "--durability", durability)
    kept = put_whole(daemon, range(70, 72))
    daemon.stop()
    daemon.start(extra_env={"KVSTORE_FAULTS": "segment.payload_written=kill"})
    key, header, payload = record(80)
    with send_raw(daemon, put_frame(header, len(payload)) + payload):
        daemon.proc.wait(timeout=30)
    assert daemon.proc.returncode == -9
    assert check(daemon.data_dir).ok
    found, _ = segment_contents(daemon.data_dir)
    assert key not in found and set(kept) <= set(found)
    daemon.start()
    with KVClient([daemon.address]) as client:
        blocks = [NS.blocks(range(s * NS.block_tokens, (s + 1) * NS.block_tokens))[0] for s in (70, 71, 80)]
        assert client.lookup(blocks[2:]) == 0
        assert [bytes(g.payload) for g in client.get(blocks[:2])] == [kept[b.key] for b in blocks[:2]]



# Layers of 200,000 bytes, not a whole number of pages: a record of 12 of them is received in steps of 1 MiB and
# written as its whole verified pages reach 1 MiB, so in two writes: its first 1,998,848 bytes once two steps
# are in, and the rest once the record is whole.
UNEVEN = Namespace("arriving-uneven", KVLayout(num_layers=12, kv_heads=5, head_dim=100, dtype="float16"),
                   block_tokens=100)
SMALL = Namespace("arriving-small", KVLayout(num_layers=2, kv_heads=1, head_dim=8, dtype="float16"), block_tokens=16)


def segment_bytes(data_dir) -> int:
    return sum(path.stat().st_size for path in (data_dir / "segments").iterdir())


def test_a_kill_between_two_payload_writes_leaves_no_record_and_harms_no_other(daemons):
    daemon, = daemons(1, *DIRECT)
    kept = put_whole(daemon, range(75, 77))
    daemon.stop()
    # The writes: the cut record's first, a small record's (appended after the cut one's place, so that its
    # place lies inside the file), then the cut record's second, where the daemon dies
    daemon.start(extra_env={"KVSTORE_FAULTS": "segment.before_write=kill@3"})
    cut = UNEVEN.blocks(range(UNEVEN.block_tokens))[0]
    header, payload = build_record(cut, os.urandom(UNEVEN.block_bytes), UNEVEN.num_layers, "chat")
    before = segment_bytes(daemon.data_dir)
    with send_raw(daemon, put_frame(header, len(payload)) + payload[: 2 * 2**20]) as sock:
        wait_for(lambda: segment_bytes(daemon.data_dir) > before, "the first write of the cut record")
        (small,) = SMALL.blocks(range(SMALL.block_tokens))
        with KVClient(ClientConfig((daemon.address,), shared_memory="off")) as client:
            assert client.put([(small, b"s" * SMALL.block_bytes)], SMALL.num_layers).stored == 1
        sock.sendall(payload[2 * 2**20 :])
        daemon.proc.wait(timeout=30)
    assert daemon.proc.returncode == -9
    found, _ = segment_contents(daemon.data_dir)
    assert cut.key not in found, "a header was written before the whole payload"
    assert set(kept) | {small.key} <= set(found) and check(daemon.data_dir).ok
    daemon.start()
    with KVClient([daemon.address]) as client:
        blocks = [NS.blocks(range(s * NS.block_tokens, (s + 1) * NS.block_tokens))[0] for s in (75, 76)]
        assert client.lookup([cut]) == 0
        assert [bytes(g.payload) for g in client.get(blocks)] == [kept[b.key] for b in blocks]
        assert [bytes(g.payload) for g in client.get([small])] == [b"s" * SMALL.block_bytes]


def test_a_failed_write_appends_the_record_whole_instead(daemons):
    """An I/O error on the first write to its place: the record is appended the ordinary way, once in."""
    daemon, = daemons(1, *DIRECT, env={"KVSTORE_FAULTS": "segment.payload_written=raise@1"})
    stored = put_whole(daemon, range(90, 92))
    with KVClient([daemon.address]) as client:
        blocks = [NS.blocks(range(s * NS.block_tokens, (s + 1) * NS.block_tokens))[0] for s in (90, 91)]
        assert [bytes(g.payload) for g in client.get(blocks)] == [stored[b.key] for b in blocks]
    assert daemon.stop() == 0
    found, outside = segment_contents(daemon.data_dir)
    assert set(found) == set(stored)
    assert all(not any(gap) for gap in outside)


def test_a_put_is_answered_only_once_its_header_write_has_ended(daemons):
    """The header's write fails: a put answered before it ended would name a place that holds no record. With no
    DRAM tier, the read goes to the segment."""
    daemon, = daemons(1, *DIRECT, "--hot-tier-bytes", "0", env={"KVSTORE_FAULTS": "segment.payload_written=raise@1"})
    stored = put_whole(daemon, range(95, 96))
    with KVClient([daemon.address]) as client:
        block = NS.blocks(range(95 * NS.block_tokens, 96 * NS.block_tokens))[0]
        assert [bytes(g.payload) for g in client.get([block])] == [stored[block.key]]


def test_two_puts_of_one_key_at_once_leave_one_record_and_zeros(daemons):
    """Both placed as their headers arrive, before either is stored: the one answered EXISTS is erased."""
    daemon, = daemons(1, *DIRECT)
    key, header, payload = record(40)
    frame = put_frame(header, len(payload))
    end = wire.frame(wire.PUT_END)
    first, second = send_raw(daemon, frame), send_raw(daemon, frame)  # both headers in before any payload
    with first, second:
        for sock in (first, second):
            sock.sendall(payload + end)
        results = []
        for sock in (first, second):
            kind, head = read_frame(sock)
            assert kind == wire.PUT_RESULT
            results += list(pb.PutResponse.FromString(head).results)
    assert sorted(results) == sorted([pb.STORED, pb.EXISTS])
    assert daemon.stop() == 0
    found, outside = segment_contents(daemon.data_dir)
    assert list(found) == [key]
    assert all(not any(gap) for gap in outside), "the second copy's place holds only zeros"



# -- in-process: what ArrivingRecord hands to writes, step by step ----------------------------------------
# arrived() is synchronous and a write is a task that does not start before the event loop runs: between two
# calls with no await, no write has ended, so how many are in flight is the test's to say, not the clock's.
IN_PROCESS = {"direct_io_min_bytes": 64 * 1024, "hot_tier_bytes": 0, "segment_bytes": 256 * 2**20}
SMALL_LAYERS = Namespace("arriving-small", KVLayout(num_layers=56, kv_heads=8, head_dim=128, dtype="float16"),
                         block_tokens=16)  # 56 layers of 64 KiB: 3.5 MiB
ODD_LAYERS = Namespace("arriving-odd", KVLayout(num_layers=4, kv_heads=16, head_dim=129, dtype="float16"),
                       block_tokens=127)  # layers of 1 MiB - 64 bytes: no layer ends on a page


async def placed_record(store, namespace: Namespace):
    (block, header_bytes, header, payload), = records(1, namespace=namespace)
    placed = await store.place(header)
    assert placed is not None
    buffer = mmap.mmap(-1, len(payload))  # as the data channel receives it: page-aligned
    buffer[:] = payload
    return block, header_bytes, header, payload, placed, ArrivingRecord(store, placed, header, memoryview(buffer))


async def test_writes_gather_a_write_step_two_at_most_and_finish_writes_the_rest(open_store):
    store = await open_store(**IN_PROCESS)
    block, header_bytes, header, payload, placed, arriving = await placed_record(store, SMALL_LAYERS)
    layer = header.layer_bytes
    assert layer == 64 * 1024 and WRITE_STEP == 2**20 and WRITES_IN_FLIGHT == 2
    written = []
    for layers in range(1, header.n_layers + 1):
        arriving.arrived(layers * layer)
        written.append(arriving.written)
    assert written[14] == 0  # 15 layers: under a write step, nothing written yet
    assert written[15:31] == [2**20] * 16  # one step gathered: one write, then nothing until the next step
    assert written[31:] == [2 * 2**20] * 25  # two writes in flight: the third step waits, the last 1.5 MiB too
    assert await arriving.finish(header_bytes) is placed  # waits for a write to end, then writes the rest
    await store.put(header, header_bytes, [payload], placed=placed)
    assert await read_all(store, block.key) == payload


async def test_only_verified_bytes_are_written_and_on_a_page_until_the_last(open_store):
    store = await open_store(**IN_PROCESS)
    block, header_bytes, header, payload, placed, arriving = await placed_record(store, ODD_LAYERS)
    arriving.arrived(2 * header.layer_bytes + 100)  # two layers verified, a part of the third in
    assert arriving.verified == 2 * header.layer_bytes
    assert arriving.written == arriving.verified - arriving.verified % ALIGN
    arriving.arrived(len(payload))
    assert await arriving.finish(header_bytes) is placed
    await store.put(header, header_bytes, [payload], placed=placed)
    assert await read_all(store, block.key) == payload


async def test_a_record_given_up_twice_lets_its_place_go_once(open_store):
    """A receive cancelled after its record was given up gives it up again: the place is let go once."""
    store = await open_store(**IN_PROCESS)
    *_, placed, arriving = await placed_record(store, SMALL_LAYERS)
    segment = placed.placement.segment
    writers = segment.writers
    arriving.give_up()
    arriving.give_up()
    await store.close()  # waits for the give-ups, then for the I/O threads that let the place go
    assert segment.writers == writers - 1
