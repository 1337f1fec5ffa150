"""A full disk must not wedge puts (docs/design.md section 10, invariants 3 and 6).

Eviction needs an LMDB commit, and a commit needs room on the file system: the daemon keeps a reserve
for it. On a small tmpfs (root, as in CI) puts fill the disk, then must recover once eviction has made
room; a daemon stopped on a disk that is still full must exit 0, start again, serve what it holds and
take puts again.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time

import grpc
import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.proto import method, pb
from kvstore.record import build_record
from kvstore.server.process import DaemonProcess
from kvstore.server.reserve import SpaceReserve
from kvstore.stats import Stats
from tests.clean_stop import stop_clean

pytestmark = pytest.mark.crash

# 16 KiB records: small enough that the index, not a segment append, meets the full disk first.
NS = Namespace("fault7-disk-full", KVLayout(num_layers=4, kv_heads=2, head_dim=32, dtype="float16"),
               block_tokens=16)
FS_BYTES = 8 * 2**20
ARGS = ["--segment-bytes", "1MiB", "--capacity-bytes", "1GiB", "--lmdb-map-bytes", "1MiB",
        "--sweep-interval-s", "0.2", "--access-flush-interval-s", "0.2"]
RECOVERY_DEADLINE_S = 60.0  # a liveness bound on the test, not a speed claim: recovery takes a pass or two


@pytest.fixture
def small_fs(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {result.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


class Putter:
    """Puts records over plain gRPC, so each refusal's status code is seen (the client would retry)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.call = self.channel.stream_unary(method("Put"), None, pb.PutResponse.FromString)

    def put(self, block, payload: bytes) -> grpc.StatusCode:
        header, body = build_record(block, payload, NS.num_layers, "chat")
        head = pb.PutHead(record_bytes=len(header) + len(body)).SerializeToString()
        try:
            self.call(iter([head, header, body]), timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    def put_until_stored(self, block, payload: bytes) -> int:
        """Retry a refused put until it is stored; how many refusals it met."""
        refusals = 0
        deadline = time.monotonic() + RECOVERY_DEADLINE_S
        while (code := self.put(block, payload)) != grpc.StatusCode.OK:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"a full disk must refuse precisely, got {code}"
            refusals += 1
            assert time.monotonic() < deadline, "puts never recovered on the full disk: the daemon is wedged"
            time.sleep(0.05)
        return refusals

    def close(self) -> None:
        self.channel.close()


def blocks_from(first: int, n: int):
    blocks = NS.blocks(range(first * NS.block_tokens, (first + n) * NS.block_tokens))
    return [(block, os.urandom(NS.block_bytes)) for block in blocks]


def assert_readable(daemon: DaemonProcess, items) -> None:
    with KVClient(ClientConfig((daemon.address,), timeout_s=10, transport="grpc")) as client:
        for block, payload in items:
            got = client.get([block])
            assert got and got[0].payload == payload, \
                f"a block stored after the disk filled is not readable; the daemon's log:\n{daemon.log()[-6000:]}"


@pytest.fixture
def ballast(small_fs):
    """A file opened before the disk fills (a full tmpfs may refuse even to open one)."""
    fd = os.open(small_fs / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    yield fd
    os.close(fd)


def fill_to_the_last_byte(ballast: int) -> None:
    """What another writer on the same file system does: take every free byte."""
    for size in (65536, 4096, 512, 1):
        try:
            while True:
                os.write(ballast, b"\0" * size)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def assert_refused_when_full(putter: Putter, ballast: int, tries: int = 5) -> list:
    """A put onto a disk full to the last byte is refused precisely. The daemon's sweep may free room
    between the fill and the put (then the put is rightly stored): fill again and retry. The blocks stored
    so, newest last (each such round lets eviction take older blocks)."""
    stored = []
    for n in range(tries):
        fill_to_the_last_byte(ballast)
        item = blocks_from(1000 + n, 1)[0]
        code = putter.put(*item)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED), f"got {code}"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return stored
        stored.append(item)
    raise AssertionError(f"{tries} puts onto a disk filled to the last byte were all stored")


def assert_stopped_cleanly(daemon: DaemonProcess) -> None:
    problems = stop_clean(daemon)
    assert not problems, "SIGTERM on a full disk must exit 0, without a traceback:\n" + "\n".join(problems)


def assert_puts_recover(daemon: DaemonProcess, first: int) -> None:
    """Fresh puts are refused at most until eviction has made room, then stored and readable."""
    putter = Putter(daemon.address)
    later = blocks_from(first, 4)
    for block, payload in later:
        putter.put_until_stored(block, payload)
    putter.close()
    assert_readable(daemon, later)


def test_full_disk_evicts_puts_recover_and_restart_serves(tmp_path, small_fs, ballast):
    daemon = DaemonProcess(small_fs / "data", tmp_path, ARGS).start()
    try:
        putter = Putter(daemon.address)
        # Twice the file system's size in fresh blocks: the disk fills, eviction has to make room.
        written = blocks_from(0, 2 * FS_BYTES // NS.block_bytes)
        refusals = sum(putter.put_until_stored(block, payload) for block, payload in written)
        assert refusals >= 1, "the disk never filled: the test proves nothing"
        assert_readable(daemon, written[-4:])

        newest = (written + assert_refused_when_full(putter, ballast))[-2:]
        putter.close()
        assert_readable(daemon, newest)  # access times the shutdown must try to save, on a full disk
        assert_stopped_cleanly(daemon)

        fill_to_the_last_byte(ballast)  # whatever eviction freed before the stop
        daemon.start()  # on a disk full to the last byte
        assert_readable(daemon, newest)
        assert_puts_recover(daemon, 2000)
        assert_stopped_cleanly(daemon)
    finally:
        daemon.kill()


def test_restart_without_reserve_on_full_disk(tmp_path, small_fs, ballast):
    """The worst case: stopped after the reserve was spent, started again with not a byte free."""
    daemon = DaemonProcess(small_fs / "data", tmp_path, ARGS).start()
    try:
        putter = Putter(daemon.address)
        written = blocks_from(0, FS_BYTES // NS.block_bytes // 2)
        for block, payload in written:
            putter.put_until_stored(block, payload)
        putter.close()
        assert_stopped_cleanly(daemon)
        (small_fs / "data" / "RESERVE").unlink(missing_ok=True)  # as if spent before the stop
        fill_to_the_last_byte(ballast)

        daemon.start()
        assert_readable(daemon, written[-2:])
        assert_puts_recover(daemon, 2000)
        assert_stopped_cleanly(daemon)
    finally:
        daemon.kill()


def test_sigterm_on_full_disk_exits_0(tmp_path, small_fs, ballast):
    """The access times kept since the last flush cannot be saved on a full disk: SIGTERM still exits 0."""
    # 4 KiB records, no maintenance pass before the stop: the index holds a thousand entries, and
    # saving all their access times copies every leaf page, which a full disk has no room for.
    small = Namespace("fault7-sigterm", KVLayout(num_layers=1, kv_heads=2, head_dim=32, dtype="float16"),
                      block_tokens=16)
    daemon = DaemonProcess(small_fs / "data", tmp_path, ARGS + ["--sweep-interval-s", "1h",
                                                                "--access-flush-interval-s", "1h"]).start()
    try:
        blocks = small.blocks(range(1000 * small.block_tokens))
        with grpc.insecure_channel(daemon.address) as channel:
            put = channel.stream_unary(method("Put"), None, pb.PutResponse.FromString)
            for block in blocks:
                header, body = build_record(block, os.urandom(small.block_bytes), small.num_layers, "chat")
                put(iter([pb.PutHead(record_bytes=len(header) + len(body)).SerializeToString(), header, body]),
                    timeout=10)
            fill_to_the_last_byte(ballast)
            touch = channel.unary_unary(method("Touch"), None, pb.CountResponse.FromString)
            assert touch(pb.KeysRequest(keys=[b.key for b in blocks]).SerializeToString(), timeout=10).count == 1000
        assert_stopped_cleanly(daemon)
        daemon.start()
        assert_puts_recover(daemon, 3000)
        assert_stopped_cleanly(daemon)
    finally:
        daemon.kill()


def test_reserve_gives_back_exactly_its_room(small_fs, ballast):
    held = SpaceReserve(small_fs / "RESERVE")
    assert held.hold(2**20)
    fill_to_the_last_byte(ballast)
    assert not SpaceReserve(small_fs / "OTHER").hold(4096)
    assert not (small_fs / "OTHER").exists(), "a reserve that could not be made must leave nothing behind"
    assert SpaceReserve(small_fs / "RESERVE").held_bytes == 2**20, "a restart finds the reserve held"
    assert held.release() == 2**20 and not (small_fs / "RESERVE").exists()
    assert held.hold(2**20), "the room it gave back is there to take again"


def capacity(daemon: DaemonProcess) -> float:
    with grpc.insecure_channel(daemon.address) as channel:
        call = channel.unary_unary(method("Stats"), pb.StatsRequest.SerializeToString, pb.StatsResponse.FromString)
        stats = Stats.from_pb(call(pb.StatsRequest(), timeout=10))
    return stats.value("kvstore_capacity_bytes"), stats.value("kvstore_evictions_total")


def test_capacity_comes_back_when_another_writer_frees_the_disk(tmp_path, small_fs, ballast):
    """Another writer fills the file system and frees it again: the budget must come back, where it once fell
    to what the segments held at the worst moment and stayed there, so later puts evicted with room free."""
    daemon = DaemonProcess(small_fs / "data", tmp_path, ARGS).start()
    try:
        putter = Putter(daemon.address)
        for block, payload in blocks_from(0, 16):
            putter.put_until_stored(block, payload)
        assert_refused_when_full(putter, ballast)  # the other writer takes every free byte,
        os.ftruncate(ballast, os.fstat(ballast).st_size - 2 * 2**20)  # gives a little back: puts resume ...
        putter.put_until_stored(*blocks_from(50, 1)[0])
        low, _ = capacity(daemon)
        os.ftruncate(ballast, 0)  # ... and later all the rest
        deadline = time.monotonic() + RECOVERY_DEADLINE_S
        while capacity(daemon)[0] < FS_BYTES // 2:
            assert time.monotonic() < deadline, f"the budget stayed at {capacity(daemon)[0]:.0f} bytes " \
                                                f"(it fell to {low:.0f}) with the disk free again"
            time.sleep(0.2)
        _, evicted = capacity(daemon)
        more = blocks_from(100, FS_BYTES // 4 // NS.block_bytes)  # a quarter of the disk: room for all
        for block, payload in more:
            putter.put_until_stored(block, payload)
        putter.close()
        assert capacity(daemon)[1] == evicted, "puts that fit in the free room evicted blocks"
        assert_readable(daemon, more)
        assert_stopped_cleanly(daemon)
    finally:
        daemon.kill()
