"""A crash simulator for the store, in the style of FoundationDB's simulation and TigerBeetle's VOPR.

One seed is one world: a randomised workload of tenants (victims, and an attacker sharing their prompts)
on a real daemon process, interleaved with faults: kill -9 at a chosen operation, kill -9 at the nth hit of
a KVSTORE_FAULTS point, graceful stops, the index deleted, `kvstore fsck --rebuild`. Every choice comes
from the seed and every moment is counted in operations, never in wall time, so a seed replays the same
workload and fault schedule (what the daemon's own background work does in between may differ).

The oracle knows what each tenant put and what the daemon acknowledged (durability fsync), and learns
what the daemon let go on purpose from its access log (op `remove`: evicted, expired, deleted, corrupt;
written before each removal commits). After every restart, and on every Get, it reads back unverified
(raw gRPC Gets, as tests/faults do, since a verifying client would turn a wrong block into a quiet miss):
* wrong: a hit whose bytes are not what that key's tenant put (another tenant's, or an attacker's);
* lost: an acknowledged block missing, with no removal logged and not reported expired;
* over capacity: the segment files past the capacity by more than one segment.

The simulator uses only public interfaces: the daemon's command line, gRPC, the data channel,
`kvstore fsck`, KVSTORE_FAULTS, and deleting a stopped daemon's `index/`. It never reads or writes
segment files: the attacks are records a client may send.

    python -m tests.simulation.crash --seed 7                 # one seed, the default number of steps
    python -m tests.simulation.crash --seed 7 --steps 2000    # one seed, longer
    python -m tests.simulation.crash --seed 1 --seconds 1800  # successive seeds for half an hour
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvstore import wire
from kvstore.block import Block, KVLayout, Namespace
from kvstore.proto import method, pb
from kvstore.record import build_record, encode_header
from kvstore.server.key_digest import KeyDigest
from kvstore.server.process import DaemonProcess
from tests.clean_stop import stop_clean
from tests.faults.conftest import raw_get, read_frame, stats
from tests.waiting import wait_for

MiB = 2**20
STOP_HANG_S = 60.0  # a graceful stop takes ~5 s at most (the RPCs' grace); far past it, the daemon hangs
KiB = 2**10

# -- the world --------------------------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=4, kv_heads=4, head_dim=128, dtype="float16")  # 32 KiB a layer, 128 KiB a block
BLOCK_TOKENS = 16
BLOCK_BYTES = Namespace("-", LAYOUT, BLOCK_TOKENS).block_bytes
MODEL = "crash-simulation"
PROMPTS = 12  # the shared pool: every tenant sends the same prompts, each under its own keys
PROMPT_BLOCKS = 4
CAPACITY = 16 * MiB  # about 120 blocks: the workload's ~150 distinct blocks and the attacker's records evict
SEGMENT_BYTES = 4 * MiB
CLASSES = {"chat": 6, "agent": 3, "brief": 1}  # traffic classes (weights); brief's 2 s TTL makes expiry happen
DAEMON_ARGS = [
    "--capacity-bytes", str(CAPACITY), "--segment-bytes", str(SEGMENT_BYTES), "--durability", "fsync",
    "--classes", "chat=1h,agent=2h,brief=2s", "--default-class", "chat", "--expiry-bucket-s", "10",
    "--sweep-interval-s", "0.5", "--access-flush-interval-s", "0.5",
    # Records of a block or more are written into their place as they arrive (arriving.py), on both channels'
    # puts of blocks; the attacker's 2 MiB records too.
    "--direct-io-min-bytes", str(64 * KiB),
    # A stalled put stays open until the kill: the attacker could as well renew it before these run out.
    "--data-frame-timeout-s", "600", "--put-record-timeout-s", "600",
    "--access-log-max-bytes", str(1 << 30),  # never rotated within a run: the oracle reads one file
]

# The attacker's record: its own key, 8 layers of 256 KiB. The daemon writes what it has verified in steps of
# 1 MiB (arriving.WRITE_STEP), so the attacker sends 5 layers, 1.25 MiB, and stalls: those are on disk.
HOSTILE_LAYERS = 8
HOSTILE_LAYER_BYTES = 256 * KiB
HOSTILE_SENT_LAYERS = 5
BARE_HEADERS = 50  # the review's finding 2: headers of the attacker's own blocks declaring ever shorter huge lengths
BARE_HEADER_STEP = 64 * KiB  # how far apart their declared ends lie, past the attacker's own payload

FAULT_POINTS = [  # every KVSTORE_FAULTS point a put, a read or compaction passes (grep 'faults.hit(')
    "segment.before_write", "segment.payload_written", "segment.after_write", "index.before_commit",
    "index.after_commit", "segment.read", "compaction.copied", "compaction.moved", "compaction.before_delete",
]
DEFAULT_STEPS = 300
ATTACKS = ("embedded", "bare")  # the review's finding 1 (records inside a payload) and 2 (bare headers)
KEYS_PER_GET = 64
RPC_TIMEOUT_S = 30.0  # a hang guard only
CAPACITY_GUARD_PASSES = 20  # the daemon's background passes without the segment files shrinking


@dataclass(frozen=True)
class Tenant:
    name: str
    namespace: Namespace
    hostile: bool = False

    def blocks(self, prompt: list[int], n: int = PROMPT_BLOCKS) -> list[Block]:
        return self.namespace.blocks(prompt[: n * BLOCK_TOKENS])


def make_tenants() -> list[Tenant]:
    """Two victims and an attacker. A salt is guessable (a customer's name): the attacker computes the
    victims' keys of a prompt it sent itself."""
    def tenant(name: str, salt: str, hostile: bool = False) -> Tenant:
        return Tenant(name, Namespace(MODEL, LAYOUT, BLOCK_TOKENS, salt=salt), hostile)
    return [tenant("victim-a", "acme"), tenant("victim-b", "globex"), tenant("attacker", "mallory", hostile=True)]


def payload_of(key: bytes) -> bytes:
    """The KV a tenant puts under `key`: a function of the key (the same prefix always has the same KV)."""
    return hashlib.shake_128(b"kv\0" + key).digest(BLOCK_BYTES)


def planted_payload(key: bytes) -> bytes:
    """What the attacker's records for another tenant's `key` hold instead."""
    return hashlib.shake_128(b"attacker\0" + key).digest(BLOCK_BYTES)


# -- the oracle -------------------------------------------------------------------------------------


@dataclass
class Oracle:
    """What each key must hold, what the daemon acknowledged, and what it said it let go."""

    owner: dict[bytes, str] = field(default_factory=dict)  # every key the simulation ever put: its tenant
    expected: dict[bytes, bytes] = field(default_factory=dict)  # keys whose bytes are not payload_of's
    acked: dict[bytes, str] = field(default_factory=dict)  # acknowledged, and not let go since: by which operation
    by_digest: dict[str, bytes] = field(default_factory=dict)  # the access log's key digest -> key
    digest: KeyDigest | None = None
    log_offset: int = 0
    let_go: Counter = field(default_factory=Counter)  # reason -> blocks
    wrong: list[str] = field(default_factory=list)  # one per key
    wrong_keys: set[bytes] = field(default_factory=set)
    lost: list[str] = field(default_factory=list)
    over_capacity: list[str] = field(default_factory=list)

    def know(self, key: bytes, tenant: str, payload: bytes | None = None) -> None:
        self.owner[key] = tenant
        if payload is not None:
            self.expected[key] = payload
        if self.digest is not None:
            self.by_digest[self.digest(key)] = key

    def bytes_of(self, key: bytes) -> bytes:
        return self.expected.get(key) or payload_of(key)

    def learn_digests(self, data_dir: Path) -> None:
        """The daemon's secret exists once it has started: from then on log lines name our keys."""
        if self.digest is None:
            self.digest = KeyDigest(data_dir / "log-digest.key")
            self.by_digest = {self.digest(key): key for key in self.owner}

    def read_log(self, path: Path) -> None:
        """Learn the removals the daemon logged since the last read (each line is written before its
        removal commits, so every removal that took effect before now is in the file)."""
        if not path.exists():
            return
        with open(path, "rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        whole = data.rfind(b"\n") + 1
        self.log_offset += whole
        for line in data[:whole].decode().splitlines():
            fields = line.split("\t")
            if len(fields) == 7 and fields[1] == "remove":
                key = self.by_digest.get(fields[2])
                if key is not None:
                    self.acked.pop(key, None)
                    self.let_go[fields[4]] += 1

    def check(self, address: str, keys: list[bytes], log_path: Path, when: str) -> None:
        """Read `keys` back unverified and judge each answer. Raises grpc.RpcError if the daemon is gone."""
        if not keys:
            return
        served = []
        for start in range(0, len(keys), KEYS_PER_GET):
            served += raw_get(address, keys[start : start + KEYS_PER_GET], timeout_s=RPC_TIMEOUT_S)
        self.read_log(log_path)  # after the Get: a removal it saw is logged by now
        for key, answer in zip(keys, served):
            if answer.status == pb.OK:
                if answer.payload != self.bytes_of(key) and key not in self.wrong_keys:
                    self.wrong_keys.add(key)
                    whose = "the attacker's" if answer.payload == planted_payload(key) else "unknown"
                    self.wrong.append(f"{when}: {self.owner[key]}'s key {key.hex()} served {len(answer.payload)} "
                                      f"bytes that are not what {self.owner[key]} put: {whose} bytes")
            elif answer.status == pb.EXPIRED:
                self.acked.pop(key, None)  # the daemon says its retention ended
            elif key in self.acked:
                acked_by = self.acked.pop(key)  # counted once
                self.lost.append(f"{when}: {self.owner[key]}'s block {key.hex()}, acknowledged at {acked_by}, is "
                                 f"{pb.PartStatus.Name(answer.status)} ({answer.cause or 'no cause'}), and the daemon "
                                 "logged no removal")

    def check_capacity(self, address: str, when: str, stalled: int) -> None:
        """The segment files within the capacity and one segment, once the daemon's background passes
        (expiry, eviction, compaction: dead bytes go only there) have caught up. It waits for that state, and
        gives up only once the files have stopped shrinking over CAPACITY_GUARD_PASSES passes (counted by the
        daemon, not timed: on a busy machine compaction lags, but makes progress). A segment with a record
        still being written into it is never compacted (docs/design.md section 5), so each stalled put open may
        hold one more."""
        bound = CAPACITY + (1 + stalled) * SEGMENT_BYTES
        smallest, since = float("inf"), 0.0

        def settled() -> bool:
            nonlocal smallest, since
            now = stats(address)
            disk, passes = now.value("kvstore_disk_bytes"), now.value("kvstore_maintenance_passes_total")
            if disk <= bound:
                return True
            if disk < smallest:
                smallest, since = disk, passes
                return False
            if passes - since < CAPACITY_GUARD_PASSES:
                return False
            self.over_capacity.append(f"{when}: {disk:.0f} bytes of segments ({now.value('kvstore_live_bytes'):.0f} "
                                      f"live) with {stalled} stalled puts open, more than the capacity {CAPACITY} "
                                      f"and {1 + stalled} segments, and not shrinking over "
                                      f"{CAPACITY_GUARD_PASSES} background passes")
            return True
        wait_for(settled, "the daemon's background passes catching up with the capacity", timeout_s=600)


# -- talking to the daemon --------------------------------------------------------------------------

Record = tuple[bytes, bytes]  # header, payload


class Refused(Exception):
    """The daemon answered a call with an error: it is up."""


def grpc_put(channel: grpc.Channel, records: list[Record]) -> list[int]:
    """Put records over gRPC; each one's PutStatus."""
    call = channel.stream_unary(method("Put"), None, pb.PutResponse.FromString)
    messages = []
    for header, payload in records:
        messages += [pb.PutHead(record_bytes=len(header) + len(payload)).SerializeToString(), header, payload]
    return list(call(iter(messages), timeout=RPC_TIMEOUT_S).results)


def grpc_delete(channel: grpc.Channel, keys: list[bytes]) -> int:
    call = channel.unary_unary(method("Delete"), pb.KeysRequest.SerializeToString, pb.CountResponse.FromString)
    return call(pb.KeysRequest(keys=keys), timeout=RPC_TIMEOUT_S).count


def data_connect(daemon: DaemonProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", daemon.data_port), timeout=RPC_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_put_start(sock: socket.socket, header: bytes, record_bytes: int) -> None:
    sock.sendall(wire.frame(wire.PUT, pb.PutHead(record_bytes=record_bytes).SerializeToString()) + header)


def data_put(daemon: DaemonProcess, records: list[Record], piece: int) -> list[int]:
    """Put records in one stream on the data channel, each payload sent in pieces of `piece` bytes (the
    daemon writes each one into its place as it arrives); each one's PutStatus."""
    with data_connect(daemon) as sock:
        for header, payload in records:
            send_put_start(sock, header, len(header) + len(payload))
            for start in range(0, len(payload), piece):
                sock.sendall(payload[start : start + piece])
        sock.sendall(wire.frame(wire.PUT_END))
        kind, head = read_frame(sock)
        if kind == wire.ERROR:
            raise Refused(f"data channel: {pb.DataError.FromString(head)}")
        return list(pb.PutResponse.FromString(head).results)


# -- the simulation ---------------------------------------------------------------------------------


@dataclass
class Epoch:
    """A stretch of the schedule: the fault point armed at its start, the operation it ends at, how it
    ends and how the daemon comes back. A fault point that fires early ends the daemon's life there; the
    epoch then goes on to its end in a new life without it, so planned kills stay at their operations."""

    ends_at: int  # the operation count at which it ends
    fault: str  # KVSTORE_FAULTS, "" for none
    end: str  # "kill" (SIGKILL) or "stop" (SIGTERM)
    recovery: str  # "restart", "delete_index" or "fsck_rebuild"


@dataclass
class Result:
    seed: int
    steps: int
    attacks: tuple[str, ...] = ATTACKS
    operations: int = 0
    crashes: int = 0
    restarts: int = 0
    rebuilds: int = 0
    hostile_puts: int = 0
    wrong: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    over_capacity: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the daemon's end: exit code, tracebacks
    errors: list[str] = field(default_factory=list)  # operations a live daemon refused (reported, not failed)
    first_wrong_s: float | None = None  # wall seconds into the seed when the first wrong, the first lost, was seen
    first_lost_s: float | None = None
    let_go: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.wrong or self.lost or self.over_capacity or self.problems)

    def note_times(self, started: float, wrong: int, lost: int) -> None:
        if wrong and self.first_wrong_s is None:
            self.first_wrong_s = time.monotonic() - started
        if lost and self.first_lost_s is None:
            self.first_lost_s = time.monotonic() - started

    def line(self) -> str:
        return (f"crashes: {self.crashes}  operations: {self.operations}  wrong: {len(self.wrong)}  "
                f"lost: {len(self.lost)}  restarts: {self.restarts}  rebuilds: {self.rebuilds}  "
                f"hostile puts: {self.hostile_puts}  over capacity: {len(self.over_capacity)}")

    def replay(self) -> str:
        attacks = "" if self.attacks == ATTACKS else f" --attacks '{','.join(self.attacks)}'"
        return f"{sys.executable} -m tests.simulation.crash --seed {self.seed} --steps {self.steps}{attacks}"


class Simulation:
    def __init__(self, seed: int, steps: int, workdir: Path, progress: bool = False,
                 attacks: tuple[str, ...] = ATTACKS, trace: bool = False, snapshots: bool = False) -> None:
        self.trace = trace  # print every operation and every event of the daemon's lives
        # copy the data directory as each life left it, before its recovery: what a failure is examined on
        self.snapshots = workdir / "snapshots" if snapshots else None
        # Two streams, so that neither depends on the other's draws: the workload draws the same operations
        # whatever the faults do, and the schedule the same epochs.
        self.rng = random.Random(f"{seed}/workload")
        self.schedule = random.Random(f"{seed}/faults")
        self.attacks = attacks
        self.result = Result(seed, steps, attacks)
        self.progress = progress
        self.tenants = make_tenants()
        self.victims = [t for t in self.tenants if not t.hostile]
        self.attacker = next(t for t in self.tenants if t.hostile)
        self.prompts = [[self.rng.randrange(50_000) for _ in range(PROMPT_BLOCKS * BLOCK_TOKENS)]
                        for _ in range(PROMPTS)]
        self.fresh_tokens = 100_000  # the attacker's own records take token ids no prompt has: fresh keys
        self.log_path = workdir / "access.log"
        self.daemon = DaemonProcess(workdir / "daemon", workdir, [*DAEMON_ARGS, "--access-log", str(self.log_path)])
        self.oracle = Oracle()
        self.stalled: list[socket.socket] = []  # the attacker's puts left open
        self.channel: grpc.Channel | None = None
        self.doing = ""  # the operation under way, for the reports
        self.life: list[str] = []  # what this daemon life went through, for the reports
        self.started = time.monotonic()

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> Result:
        started = self.started = time.monotonic()
        try:
            epoch = self._draw_epoch(0)
            self._start(epoch.fault)
            while self.result.operations < self.result.steps:
                while self.result.operations < min(epoch.ends_at, self.result.steps) and self._alive():
                    self._step()
                    self.result.note_times(started, len(self.oracle.wrong), len(self.oracle.lost))
                self._stop(epoch.end)
                self._check_scannable()
                if self.snapshots is not None:
                    shutil.copytree(self.daemon.data_dir, self.snapshots / f"op-{self.result.operations:05d}-"
                                    f"restart-{self.result.restarts:03d}", ignore=shutil.ignore_patterns("*.sock"))
                self._recover(epoch.recovery)
                before = "; ".join(self.life)
                fault = ""  # a fault point fired before the epoch's end: the rest of it without one
                if self.result.operations >= epoch.ends_at:
                    epoch = self._draw_epoch(epoch.ends_at)
                    fault = epoch.fault
                self._start(fault)  # a life's fault point is armed from its start-up on
                self._check_all(f"after restart [the life before: {before}] [this life: {'; '.join(self.life)}]")
                self.result.note_times(started, len(self.oracle.wrong), len(self.oracle.lost))
        finally:
            self._close_connections()
            self.result.problems += stop_clean(self.daemon, killed_on_purpose=True)
            self.result.seconds = time.monotonic() - started
            oracle = self.oracle
            self.result.wrong, self.result.lost = oracle.wrong, oracle.lost
            self.result.over_capacity, self.result.let_go = oracle.over_capacity, oracle.let_go
        return self.result

    def _draw_epoch(self, starts_at: int) -> Epoch:
        rng = self.schedule
        point, nth = rng.choice(FAULT_POINTS), rng.randint(1, 40)
        fault = f"{point}=kill@{nth}" if rng.random() < 0.5 else ""
        return Epoch(ends_at=starts_at + rng.randint(6, 30), fault=fault,
                     end="kill" if rng.random() < 0.8 else "stop",
                     recovery=rng.choices(["restart", "delete_index", "fsck_rebuild"], [2, 1, 1])[0])

    def _step(self) -> None:
        self.result.operations += 1
        op = self.rng.choices(
            [self._put_grpc, self._put_data, self._get, self._delete, self._hostile_embedded, self._hostile_bare],
            [25, 20, 30, 5, 8, 8])[0]
        if op.__name__.removeprefix("_hostile_") not in self.attacks and op.__name__.startswith("_hostile_"):
            op = self._put_data  # the same draws, so that the rest of the schedule stays the seed's
        self.doing = op.__name__.strip("_")
        try:
            op()
            if self.trace:
                print(f"  {self._when()}: {self.doing}", flush=True)
        except (grpc.RpcError, OSError, Refused) as exc:  # ConnectionError is an OSError
            answered = isinstance(exc, Refused) or (isinstance(exc, grpc.RpcError)
                                                    and exc.code() != grpc.StatusCode.UNAVAILABLE)
            if answered or not self._died():  # refused by a daemon that is up: not acknowledged, worth a look
                self.result.errors.append(f"{self._when()} ({self.doing}): {exc!r}")
        if self.result.operations % 10 == 0 and self._alive():
            self._judged(lambda: self.oracle.check_capacity(self.daemon.address, self._when(), len(self.stalled)))
        if self.progress and self.result.operations % 100 == 0:
            print(f"  seed {self.result.seed}: {self.result.operations}/{self.result.steps} operations, "
                  f"{self.result.line()}", flush=True)

    def _event(self, what: str) -> None:
        self.life.append(what)
        if self.trace:
            print(f"  {what}", flush=True)

    def _when(self) -> str:
        return f"operation {self.result.operations} ({time.monotonic() - self.started:.1f} s in)"

    # -- the daemon's lives -----------------------------------------------------------------------

    def _start(self, fault: str) -> None:
        env = {"KVSTORE_FAULTS": fault} if fault else {}
        self.life = []
        self._event(f"started at {self._when()}" + (f" with {fault}" if fault else ""))
        try:
            self.daemon.start(extra_env=env)
        except RuntimeError:  # a fault point armed for this life fired during start-up's recovery
            if not fault:
                raise
            self.result.crashes += 1
            self._event("killed by it during start-up, started again without it")
            self.daemon.start()
        self.result.restarts += 1
        self.oracle.learn_digests(self.daemon.data_dir)
        self.channel = grpc.insecure_channel(self.daemon.address)

    def _alive(self) -> bool:
        proc = self.daemon.proc
        return proc is not None and proc.poll() is None

    def _died(self) -> bool:
        """After a call failed: whether the daemon is dying (a fault point's kill), waited for until it is gone.
        The wait only ends a hang: a daemon up after it failed the call for another reason."""
        try:
            self.daemon.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _stop(self, how: str) -> None:
        """End this life: SIGKILL, or SIGTERM and a graceful stop; a daemon a fault point killed is a crash."""
        if how == "stop" and self._alive():
            self._close_connections()  # first: a graceful stop would wait for the stalled puts
            try:
                code = self.daemon.stop(timeout_s=STOP_HANG_S)
            except subprocess.TimeoutExpired:  # killed, after it wrote its stacks into its log
                self.result.problems.append(f"{self._when()}: a graceful stop did not end in {STOP_HANG_S:.0f} s; "
                                            f"the daemon's threads and tasks are in {self.daemon.log_path}")
                self.result.crashes += 1
                return
            if code == 0:
                self._event(f"stopped at {self._when()}")
                return
            assert code == -signal.SIGKILL, f"the daemon exited with {code} on SIGTERM"  # a fault point, stopping
        else:
            self._event(f"{'killed' if self._alive() else 'its fault point fired'} at {self._when()}")
            self.daemon.kill()  # before the stalled puts close: the daemon must not see them end
            self._close_connections()
        self.result.crashes += 1

    def _close_connections(self) -> None:
        for sock in self.stalled:
            sock.close()
        self.stalled = []
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _check_scannable(self) -> None:
        """Every record the stopped daemon's index points at is one a scan of its segment finds (`kvstore fsck`):
        else only the index knows it, and the next rebuild would lose an acknowledged block."""
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "fsck", "--no-payload", str(self.daemon.data_dir)],
                              capture_output=True, text=True, timeout=300)
        hidden = [line.strip() for line in done.stdout.splitlines() if "does not find its record" in line]
        self.result.problems += [f"{self._when()}, after the life [{'; '.join(self.life)}]: kvstore fsck: {line}"
                                 for line in hidden]

    def _recover(self, how: str) -> None:
        data_dir = self.daemon.data_dir
        self._event({"restart": "restarted", "delete_index": "index deleted",
                          "fsck_rebuild": "kvstore fsck --rebuild"}[how])
        if how == "delete_index":
            shutil.rmtree(data_dir / "index", ignore_errors=True)
            self.result.rebuilds += 1
        elif how == "fsck_rebuild":
            done = subprocess.run([sys.executable, "-m", "kvstore.cli", "fsck", "--rebuild", str(data_dir)],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode not in (0, 1):  # 1: it found (and repaired) problems
                raise AssertionError(f"kvstore fsck --rebuild exited with {done.returncode}:\n{done.stderr[-3000:]}")
            self.result.rebuilds += 1

    def _check_all(self, why: str) -> None:
        self._judged(lambda: self.oracle.check(self.daemon.address, list(self.oracle.owner), self.log_path,
                                               f"{self._when()}, {why}"))
        if self._alive():
            self._judged(lambda: self.oracle.check_capacity(self.daemon.address, f"{self._when()}, {why}", 0))

    def _judged(self, check) -> None:
        """Run a check; a daemon that a fault point killed meanwhile ends it without a verdict."""
        try:
            check()
        except grpc.RpcError:
            if not self._died():
                raise

    # -- the workload -----------------------------------------------------------------------------

    def _some_blocks(self) -> tuple[Tenant, list[Block]]:
        """A tenant and the leading blocks of one of the shared prompts, under its keys."""
        tenant = self.rng.choice(self.tenants)
        prompt = self.rng.choice(self.prompts)
        return tenant, tenant.blocks(prompt, self.rng.randint(1, PROMPT_BLOCKS))

    def _records(self, tenant: Tenant, blocks: list[Block]) -> list[Record]:
        traffic_class = self.rng.choices(list(CLASSES), list(CLASSES.values()))[0]
        self.doing += f" ({traffic_class}: {' '.join(block.key.hex()[:8] for block in blocks)})"
        for block in blocks:
            self.oracle.know(block.key, tenant.name)
        return [build_record(block, payload_of(block.key), LAYOUT.num_layers, traffic_class) for block in blocks]

    def _acknowledged(self, blocks: list[Block], statuses: list[int]) -> None:
        assert len(statuses) == len(blocks), "one status per record"
        for block, status in zip(blocks, statuses):
            assert status in (pb.STORED, pb.EXISTS)
            self.oracle.acked[block.key] = f"{self._when()} ({self.doing}: {pb.PutStatus.Name(status)})"

    def _put_grpc(self) -> None:
        tenant, blocks = self._some_blocks()
        self.doing += f" by {tenant.name}"
        records = self._records(tenant, blocks)
        assert self.channel is not None
        self._acknowledged(blocks, grpc_put(self.channel, records))

    def _put_data(self) -> None:
        tenant, blocks = self._some_blocks()
        self.doing += f" by {tenant.name}"
        records = self._records(tenant, blocks)
        piece = self.rng.choice([4 * KiB, 32 * KiB, 1 * MiB])
        self._acknowledged(blocks, data_put(self.daemon, records, piece))

    def _get(self) -> None:
        tenant, blocks = self._some_blocks()
        self.oracle.check(self.daemon.address, [b.key for b in blocks if b.key in self.oracle.owner], self.log_path,
                          f"{self._when()}, a Get of {tenant.name}")

    def _delete(self) -> None:
        _, blocks = self._some_blocks()
        keys = [block.key for block in blocks]
        for key in keys:  # before: the delete may take effect though its answer is lost
            self.oracle.acked.pop(key, None)
        assert self.channel is not None
        grpc_delete(self.channel, keys)

    # -- the attacker -----------------------------------------------------------------------------

    def _attacker_block(self) -> Block:
        """A block of the attacker's own tenant no one has put: its record gets a place of its own."""
        tokens = range(self.fresh_tokens, self.fresh_tokens + BLOCK_TOKENS)
        self.fresh_tokens += BLOCK_TOKENS
        return self.attacker.namespace.blocks(tokens)[0]

    def _hostile_embedded(self) -> None:
        """The review's finding 1: the attacker's payload holds whole, well-formed records of a victim's keys
        (of a prompt both send), with the attacker's bytes. As the attacker's record they are only payload;
        as records of their own they would serve the victim the attacker's KV."""
        embedded = b""
        room = HOSTILE_SENT_LAYERS * HOSTILE_LAYER_BYTES  # only what is sent before the stall is on disk
        while True:
            victim, prompt = self.rng.choice(self.victims), self.rng.choice(self.prompts)
            for block in victim.blocks(prompt):
                header, payload = build_record(block, planted_payload(block.key), LAYOUT.num_layers, "chat")
                if len(embedded) + len(header) + len(payload) > room:
                    self._hostile_put(embedded)
                    return
                self.oracle.know(block.key, victim.name)  # served with the attacker's bytes, it is wrong
                embedded += header + payload

    def _hostile_bare(self) -> None:
        """The review's finding 2: the attacker's payload holds bare headers of its own blocks declaring huge
        lengths, each ending further past the attacker's record than the next: a scan that takes one as a
        record jumps over what other tenants appended after it."""
        total = HOSTILE_LAYERS * HOSTILE_LAYER_BYTES
        bare = bytearray()
        for i in range(BARE_HEADERS):
            at = i * 4 * KiB  # where this header lies in the payload
            block = self._attacker_block()
            declared_end = total + (BARE_HEADERS - i) * BARE_HEADER_STEP  # from the payload's start
            header_len = len(encode_header(block, "chat", 1, 1, [0]))
            header = encode_header(block, "chat", 1, declared_end - at - header_len, [0])
            bare += bytes(at - len(bare)) + header
        self._hostile_put(bytes(bare))

    def _hostile_put(self, planted: bytes) -> None:
        """The attacker's own record whose payload starts with `planted`, on the data channel: cut off
        mid-payload, stalled and left open (until the kill), or sent whole."""
        self.result.hostile_puts += 1
        total = HOSTILE_LAYERS * HOSTILE_LAYER_BYTES
        payload = planted + hashlib.shake_128(planted[:64]).digest(total - len(planted))
        block = self._attacker_block()
        header, payload = build_record(block, payload, HOSTILE_LAYERS, "chat")
        sent = HOSTILE_SENT_LAYERS * HOSTILE_LAYER_BYTES
        how = self.rng.choices(["stall", "cut", "whole"], [6, 2, 2])[0]
        if how == "stall" and len(self.stalled) >= 2:
            how = "whole"
        self.doing = f"{self.doing}, {how}"
        self._event(f"{self.doing} at {self._when()}")
        sock = data_connect(self.daemon)
        try:
            send_put_start(sock, header, len(header) + len(payload))
            sock.sendall(payload[:sent])
            if how == "stall":
                self.stalled.append(sock)
                sock = None
            elif how == "whole":
                self.oracle.know(block.key, self.attacker.name, payload)
                sock.sendall(payload[sent:] + wire.frame(wire.PUT_END))
                kind, head = read_frame(sock)
                assert kind == wire.PUT_RESULT, f"frame kind {kind}: {head!r}"
                self._acknowledged([block], list(pb.PutResponse.FromString(head).results))
        finally:
            if sock is not None:
                sock.close()


def run_seed(seed: int, steps: int = DEFAULT_STEPS, progress: bool = False, keep: bool = False,
             attacks: tuple[str, ...] = ATTACKS, trace: bool = False, snapshots: bool = False) -> Result:
    workdir = Path(tempfile.mkdtemp(prefix=f"crash-sim-{seed}-"))
    result: Result | None = None
    try:
        result = Simulation(seed, steps, workdir, progress, attacks, trace, snapshots).run()
        return result
    finally:
        if keep or result is None or result.failed:  # a failing seed's evidence is always kept
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def report(result: Result, limit: int = 5) -> None:
    firsts = "".join(f"; first {what} after {at:.1f} s" for what, at in (("wrong", result.first_wrong_s),
                                                                       ("lost", result.first_lost_s)) if at is not None)
    print(f"seed {result.seed}: {result.line()}  ({result.seconds:.1f} s; let go: {dict(result.let_go)}{firsts})")
    for what, found in (("wrong", result.wrong), ("lost", result.lost), ("over capacity", result.over_capacity),
                        ("problem", result.problems), ("refused", result.errors)):
        for detail in found[:limit]:
            print(f"  {what}: {detail}")
        if len(found) > limit:
            print(f"  ... {len(found) - limit} more {what}")
    if result.failed:
        print(f"  replay: {result.replay()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.simulation.crash", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="the seed (with --seconds, the first of successive ones)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="operations per seed")
    parser.add_argument("--seconds", type=float, help="run successive seeds until this much time has passed")
    parser.add_argument("--keep", action="store_true",
                        help="keep each seed's data directory and logs (a failing seed's is always kept)")
    parser.add_argument("--trace", action="store_true", help="print every operation and daemon life event")
    parser.add_argument("--snapshots", action="store_true",
                        help="copy the data directory as each life left it, before its recovery (kept with a failure)")
    parser.add_argument("--attacks", default=",".join(ATTACKS),
                        help=f"the attacker's hostile puts, of {','.join(ATTACKS)} (empty: none; a control run)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    totals = Result(seed=args.seed, steps=args.steps)
    failing: list[Result] = []
    seed = args.seed
    while True:
        attacks = tuple(filter(None, args.attacks.split(",")))
        result = run_seed(seed, args.steps, progress=args.seconds is None, keep=args.keep, attacks=attacks,
                          trace=args.trace, snapshots=args.snapshots)
        report(result)
        for name in ("operations", "crashes", "restarts", "rebuilds", "hostile_puts"):
            setattr(totals, name, getattr(totals, name) + getattr(result, name))
        for name in ("wrong", "lost", "over_capacity", "problems", "errors"):
            getattr(totals, name).extend(getattr(result, name))
        if result.failed:
            failing.append(result)
        seed += 1
        if args.seconds is None or time.monotonic() - started >= args.seconds:
            break
        print(f"progress: {seed - args.seed} seeds in {time.monotonic() - started:.0f} s; {totals.line()}", flush=True)
    for result in failing:
        print(f"failed: seed {result.seed}: replay with {result.replay()}")
    print(totals.line())
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
