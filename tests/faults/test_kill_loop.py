"""kill -9 loops under concurrent puts, with a bounded-loss oracle checked after every restart.

The oracle (docs/design.md section 10, invariant 2):
* durability "fsync": every put acknowledged before the kill is served afterwards, byte for byte;
* durability "os": nothing unverifiable is served: each block served equals what was put (a process
  crash keeps the page cache, but the contract promises no more than this);
* in both, fsck finds the index and the segments in agreement, at the crash and after recovery.

tests/kvstore/server/test_crash.py kills one writer at random times and each put point once; these loops
add both durabilities at every named fault point, two transports writing at once, readers during the
kill, and injected I/O errors that the daemon must survive without a restart.
"""

from __future__ import annotations

import itertools
import os
import random
import threading

import grpc
import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.proto import pb
from kvstore.server.fsck import check

from .conftest import NS, client_for, items, misses_counted, raw_get

pytestmark = pytest.mark.crash

PUT_POINTS = ["segment.before_write", "segment.after_write", "index.before_commit", "index.after_commit"]
# A record written as it arrives (direct appends, the data channel) passes one more: payload written, header not.
DIRECT_PUT_POINTS = [*PUT_POINTS, "segment.payload_written"]
SMALL_SEGMENTS = ("--segment-bytes", "256KiB")  # seals (and syncs) segments every few puts


class Ledger:
    """Every put tried and every put acknowledged over a whole loop, and any wrong block a reader saw."""

    def __init__(self) -> None:
        self.attempted: dict[bytes, bytes] = {}  # key -> payload
        self.acked: dict[bytes, bytes] = {}
        self.wrong: list[str] = []
        self.reads = 0  # Gets the reader saw answered in full (each one checked against `acked`)
        self.errors: list[BaseException] = []  # what a load thread raised other than a dead daemon's RpcError
        self.lock = threading.Lock()


class Load:
    """Writers on both transports and a reader, running against one daemon until it dies or is stopped."""

    def __init__(self, daemon, ledger: Ledger, seeds: itertools.count) -> None:
        self.daemon = daemon
        self.ledger = ledger
        self.seeds = seeds
        self.stop = threading.Event()
        self._threads = [threading.Thread(target=self._write, args=(t,)) for t in ("auto", "grpc")]
        self._threads.append(threading.Thread(target=self._read))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join()
        assert not self.ledger.errors, f"a load thread failed: {self.ledger.errors[0]!r}"

    def wait_for(self, puts: int, reads: int = 0) -> None:
        """Until `puts` more puts are acknowledged and `reads` more Gets answered in full, or the daemon is
        gone."""
        ledger = self.ledger
        target_puts, target_reads = len(ledger.acked) + puts, ledger.reads + reads
        while (len(ledger.acked) < target_puts or ledger.reads < target_reads) and self.daemon.proc.poll() is None:
            self.stop.wait(0.01)

    def _write(self, transport: str) -> None:
        try:
            self._writes(transport)
        except BaseException as exc:
            self.ledger.errors.append(exc)
            raise

    def _writes(self, transport: str) -> None:
        ledger = self.ledger
        with client_for(self.daemon, transport) as client:
            while not self.stop.is_set():
                (block, payload), = items(next(self.seeds))
                with ledger.lock:
                    ledger.attempted[block.key] = payload
                summary = client.put([(block, payload)], NS.num_layers)
                if summary.stored or summary.existed:
                    with ledger.lock:
                        ledger.acked[block.key] = payload
                elif self.daemon.proc.poll() is not None:
                    self.stop.wait(0.02)  # dead: wait for the test to notice

    def _read(self) -> None:
        try:
            self._reads()
        except BaseException as exc:  # a wrong answer (raw_get's AssertionError) fails the test, not the thread
            self.ledger.errors.append(exc)
            raise

    def _reads(self) -> None:
        ledger = self.ledger
        rng = random.Random(3)
        while not self.stop.is_set():
            with ledger.lock:
                keys = rng.sample(list(ledger.acked), min(8, len(ledger.acked)))
            if not keys:
                self.stop.wait(0.01)
                continue
            try:
                served = raw_get(self.daemon.address, keys, timeout_s=30)
            except grpc.RpcError:  # the daemon died under the read; what it served before was checked
                self.stop.wait(0.02)
                continue
            ledger.wrong += [k.hex() for k, got in zip(keys, served)
                             if got.status == pb.OK and got.payload != ledger.acked[k]]
            ledger.reads += 1


def check_after_crash(daemon, ledger: Ledger, durability: str) -> None:
    """fsck the crashed directory, restart, and hold the daemon to the oracle."""
    report = check(daemon.data_dir)
    assert report.ok, f"index and segments disagree right after kill -9: {report.problems[:3]}"
    daemon.start()
    keys = list(ledger.attempted)
    served = dict(zip(keys, raw_get(daemon.address, keys)))
    wrong = [k.hex() for k, got in served.items() if got.status == pb.OK and got.payload != ledger.attempted[k]]
    assert not wrong and not ledger.wrong, f"served bytes that were never put: {(wrong + ledger.wrong)[:3]}"
    if durability == "fsync":
        lost = [k.hex() for k in ledger.acked if served[k].status != pb.OK]
        assert not lost, f"{len(lost)} acknowledged puts lost with durability fsync: {lost[:3]}"
    # Misses are counted as such, never dressed up as hits.
    assert misses_counted(daemon.address) >= sum(1 for got in served.values() if got.status != pb.OK)


def check_after_clean_stop(daemon, ledger: Ledger, durability: str) -> None:
    assert daemon.stop() == 0, daemon.log()[-2000:]
    report = check(daemon.data_dir)
    assert report.ok and report.open_segments == 0, report.problems[:3]
    if durability == "fsync":
        assert report.entries >= len(ledger.acked)


# "direct": every record is appended with O_DIRECT (4 KiB-aligned and padded), as large blocks are; those
# put over the data channel are written as they arrive, header last (kvstore/server/arriving.py).
@pytest.mark.parametrize("durability, appends", [("fsync", "buffered"), ("os", "buffered"), ("fsync", "direct"),
                                                 ("os", "direct")])
def test_random_kill_loop_under_concurrent_puts_and_gets(daemons, durability, appends):
    direct_io = ("--direct-io-min-bytes", "4KiB" if appends == "direct" else "0")
    daemon, = daemons(1, "--durability", durability, *SMALL_SEGMENTS, *direct_io)
    rng = random.Random(durability)
    ledger, seeds = Ledger(), itertools.count(1)
    for _ in range(3):
        acked_before = len(ledger.acked)
        reads_before = ledger.reads
        with Load(daemon, ledger, seeds) as load:
            # then kill -9 at whatever point the puts have reached, with the reader's Gets in flight
            load.wait_for(puts=rng.randint(5, 40), reads=1)
            daemon.kill()
        assert len(ledger.acked) > acked_before, "the writers must make progress between kills"
        assert ledger.reads > reads_before, "the reader must have checked what it was served between kills"
        check_after_crash(daemon, ledger, durability)
    check_after_clean_stop(daemon, ledger, durability)


@pytest.mark.parametrize("durability, appends", [("fsync", "buffered"), ("os", "buffered"), ("fsync", "direct"),
                                                 ("os", "direct")])
def test_kill_loop_through_every_put_point_under_concurrent_puts(daemons, durability, appends):
    """One cycle per fault point; the kill lands on a random later hit, amid two writers' puts."""
    direct_io = ("--direct-io-min-bytes", "4KiB" if appends == "direct" else "0")
    daemon, = daemons(1, "--durability", durability, *SMALL_SEGMENTS, *direct_io)
    rng = random.Random(f"points-{durability}-{appends}")
    ledger, seeds = Ledger(), itertools.count(10_000)
    for point in DIRECT_PUT_POINTS if appends == "direct" else PUT_POINTS:
        daemon.stop()
        daemon.start(extra_env={"KVSTORE_FAULTS": f"{point}=kill@{rng.randint(2, 20)}"})
        with Load(daemon, ledger, seeds):
            daemon.proc.wait(timeout=60)  # the fault point fires: SIGKILL from inside the daemon
        assert daemon.proc.returncode == -9, f"{point}: the daemon must die by its fault point"
        check_after_crash(daemon, ledger, durability)
    check_after_clean_stop(daemon, ledger, durability)


def test_a_kill_inside_a_read_loses_nothing(daemons):
    daemon, = daemons(1, "--durability", "fsync", "--hot-tier-bytes", "0")
    stored = items(1, 6)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == len(stored)
    daemon.stop()
    daemon.start(extra_env={"KVSTORE_FAULTS": "segment.read=kill@3"})
    with pytest.raises(grpc.RpcError):  # the daemon dies under the Get
        raw_get(daemon.address, [b.key for b, _ in stored], timeout_s=10)
    daemon.proc.wait(timeout=10)
    assert check(daemon.data_dir).ok
    daemon.start()
    served = raw_get(daemon.address, [b.key for b, _ in stored])
    assert [got.payload for got in served] == [payload for _, payload in stored]


@pytest.mark.parametrize("point", PUT_POINTS)
def test_io_errors_at_a_put_point_fail_puts_and_leave_the_store_whole(daemons, point):
    """`raise` at a point on every hit: those puts fail, reads go on, SIGTERM still stops the daemon, and a
    restart without the fault heals."""
    daemon, = daemons(1, "--hot-tier-bytes", "0")
    first, later = items(1, 2), items(2, 3)
    with client_for(daemon) as client:
        assert client.put(first, NS.num_layers).stored == 2
    daemon.stop()
    daemon.start(extra_env={"KVSTORE_FAULTS": f"{point}=raise"})
    with client_for(daemon) as client:
        summary = client.put(later, NS.num_layers)
        assert summary.failed == len(later) and summary.stored == 0
    assert daemon.proc.poll() is None, "an I/O error must fail the put, not the daemon"
    served = raw_get(daemon.address, [b.key for b, _ in first + later])
    assert [got.payload for got in served[:2]] == [payload for _, payload in first]
    for got, (_, payload) in zip(served[2:], later):
        # Committed before the error (index.after_commit): whole, though the put was reported failed.
        assert got.status != pb.OK or (point == "index.after_commit" and got.payload == payload)
    # It may report that it could not persist everything at shutdown (exit 1, saying to run fsck), but it
    # must stop, and leave index and segments in agreement.
    assert daemon.stop() in (0, 1), daemon.log()[-2000:]
    assert check(daemon.data_dir).ok
    daemon.start()
    with client_for(daemon) as client:
        assert client.put(later, NS.num_layers).failed == 0
    served = raw_get(daemon.address, [b.key for b, _ in first + later])
    assert [got.payload for got in served] == [payload for _, payload in first + later]


def test_io_errors_on_reads_are_counted_misses(daemons):
    daemon, = daemons(1, "--hot-tier-bytes", "0")
    stored = items(1, 3)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == 3
    daemon.stop()
    daemon.start(extra_env={"KVSTORE_FAULTS": "segment.read=raise"})
    served = raw_get(daemon.address, [b.key for b, _ in stored])
    assert [got.status for got in served] == [pb.UNAVAILABLE] * 3
    assert misses_counted(daemon.address) == 3
    daemon.stop()
    daemon.start()
    assert [got.payload for got in raw_get(daemon.address, [b.key for b, _ in stored])] == [p for _, p in stored]


BIG = Namespace("kill-loop-16MiB", KVLayout(num_layers=4, kv_heads=8, head_dim=128, dtype="float16"), block_tokens=1024)


@pytest.mark.parametrize("durability", ["fsync", "os"])
def test_a_put_answered_exists_while_another_writes_the_key_survives_a_kill(daemons, durability):
    """Two connections put the same 16 MiB record; the daemon is killed as soon as one is answered EXISTS
    (that answer once came at once, before the other put's record was written, so a kill lost a key whose
    put had been answered).

    A round where the second put reaches the daemon after the first is stored is answered EXISTS too, and tests
    less; a round where neither put is answered EXISTS tests nothing. Rounds go on until three were answered
    EXISTS, and at most twelve are tried: the race must have been run, not assumed."""
    daemon, = daemons(1, "--durability", durability)
    raced = 0
    for round_ in range(12):
        if raced == 3:
            break
        block = BIG.blocks(range(round_ * BIG.block_tokens, (round_ + 1) * BIG.block_tokens))[0]
        payload = os.urandom(BIG.block_bytes)
        exists = threading.Event()

        def put(transport: str) -> None:
            with client_for(daemon, transport) as client:
                if client.put([(block, payload)], BIG.num_layers).existed:
                    exists.set()
                    daemon.kill()  # at once: the answer EXISTS promises the block is stored

        writers = [threading.Thread(target=put, args=(t,)) for t in ("auto", "grpc")]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join(60)
        if not exists.is_set():  # both stored it (one after the other): nothing to test this round
            assert daemon.stop() == 0, daemon.log()[-2000:]
        else:
            raced += 1
            daemon.proc.wait(timeout=10)
        daemon.start()
        (served,) = raw_get(daemon.address, [block.key])
        assert served.status == pb.OK and served.payload == payload, f"round {round_}: the block was lost"
    assert raced == 3, f"only {raced} of {round_ + 1} rounds were answered EXISTS: the kill after one went untried"


# Compaction copies a segment's live records forward (the copy written, then the index moved to it), then
# deletes the segment; expiry removes a segment's expired blocks, then deletes it. A kill between any two steps
# must leave every committed block served, whole.
COMPACTION_POINTS = ["compaction.copied", "compaction.moved", "compaction.before_delete"]


def kept_whole_after_a_kill(daemon, kept: dict[bytes, bytes], others: dict[bytes, bytes]) -> None:
    """The daemon died at its fault point: fsck agrees, and after a restart every kept block is served byte for
    byte and no other block is served with bytes other than its own."""
    daemon.proc.wait(timeout=120)  # the fault point fires: SIGKILL from inside the daemon
    assert daemon.proc.returncode == -9, "the daemon must die by its fault point"
    report = check(daemon.data_dir)
    assert report.ok, f"index and segments disagree right after kill -9: {report.problems[:3]}"
    daemon.start()
    keys = list(kept)
    served = raw_get(daemon.address, keys)
    lost = [k.hex() for k, got in zip(keys, served) if got.status != pb.OK or got.payload != kept[k]]
    assert not lost, f"{len(lost)} committed blocks lost or changed by a kill inside compaction: {lost[:3]}"
    others_served = raw_get(daemon.address, list(others))
    assert not [k for k, got in zip(others, others_served) if got.status == pb.OK and got.payload != others[k]]


@pytest.mark.parametrize("durability", ["fsync", "os"])
@pytest.mark.parametrize("point", COMPACTION_POINTS)
def test_a_kill_inside_compaction_keeps_every_committed_block(daemons, durability, point):
    """Half of each sealed segment deleted; the daemon restarted with the fault point armed and a sweep that
    compacts at once."""
    daemon, = daemons(1, "--durability", durability, *SMALL_SEGMENTS, "--hot-tier-bytes", "0",
                      "--sweep-interval-s", "1h", "--compaction-min-garbage", "0.3")
    stored = [item for seed in range(20_000, 20_006) for item in items(seed, 10)]  # 16 KiB each: 4 segments
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == len(stored)
        assert client.delete([block for block, _ in stored[1::2]]) == len(stored[1::2])
    assert daemon.stop() == 0
    nth = random.Random(f"{durability}-{point}").randint(1, 3) if point != "compaction.before_delete" else 1
    daemon.args += ["--sweep-interval-s", "0.05"]  # the later flag wins: compaction starts at the first pass
    daemon.start(extra_env={"KVSTORE_FAULTS": f"{point}=kill@{nth}"})
    kept_whole_after_a_kill(daemon, {b.key: p for b, p in stored[::2]}, {b.key: p for b, p in stored[1::2]})


@pytest.mark.parametrize("durability", ["fsync", "os"])
def test_a_kill_between_expiry_and_the_segment_delete_keeps_every_other_block(daemons, durability):
    """Blocks of a class with a one-second TTL fill segments of their own; the daemon dies once their segment
    is emptied and before it is deleted. The long-lived blocks are all there after the restart."""
    daemon, = daemons(1, "--durability", durability, *SMALL_SEGMENTS, "--hot-tier-bytes", "0",
                      "--classes", "chat=1s,agent=7d", "--expiry-bucket-s", "1s", "--sweep-interval-s", "0.05",
                      env={"KVSTORE_FAULTS": "compaction.before_delete=kill"})
    lasting, expiring = items(21_000, 10), items(21_001, 10)
    with client_for(daemon) as client:
        assert client.put(lasting, NS.num_layers, traffic_class="agent").stored == len(lasting)
        assert client.put(expiring, NS.num_layers, traffic_class="chat").stored == len(expiring)
    kept_whole_after_a_kill(daemon, {b.key: p for b, p in lasting}, {b.key: p for b, p in expiring})
