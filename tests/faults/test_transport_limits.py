"""One tenant against the others at the transports.

Call slots: 256 Gets that tenant A never read took every gRPC call slot; tenant B's Lookups, Gets and
even the health check were refused for as long as A held them.
The put budget: PutHeads declaring 8 x 64 MiB (136 bytes sent) reserved the whole put budget, so every put of
tenant B failed; the reservation was never given back on gRPC.
Idle connections: idle TCP connections to the gRPC port were unlimited and never closed; the daemon ran out of
descriptors and failed to open segments for clients already connected.
Unread Gets: 32 gRPC Gets of 4 x 16 MiB that were never read took RSS up by a GiB, for good.

Each test runs real daemons on loopback and asserts what a client sees; the only clocks are hang guards.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import wire
from kvstore.block import Block, KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.proto import method, pb
from kvstore.server.auth import new_token, token_entry
from tests.waiting import wait_for

from .conftest import read_frame

pytestmark = pytest.mark.crash

MiB = 2**20
CODE = grpc.StatusCode
HANG_GUARD_S = 60  # liveness only: far longer than any timeout these daemons are given
LAYOUT = KVLayout(num_layers=4, kv_heads=8, head_dim=64, dtype="float16")  # 16 MiB blocks of 2048 tokens
ALICE = Namespace("transport-limits", LAYOUT, block_tokens=2048, salt="alice's salt")
BOB = Namespace("transport-limits", LAYOUT, block_tokens=2048, salt="bob's salt")
TOKENS = {name: new_token() for name in ("alice", "alice-reader", "bob")}
OPTIONS = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB),
           ("grpc.use_local_subchannel_pool", 1)]  # a connection of its own for each channel


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(token_entry("alice", TOKENS["alice"], [ALICE.tenant], ["read", "write"])
                    + token_entry("alice-reader", TOKENS["alice-reader"], [ALICE.tenant], ["read"])
                    + token_entry("bob", TOKENS["bob"], [BOB.tenant], ["read", "write"]))
    return path


def blocks_of(namespace: Namespace, n: int, seed: int = 0) -> list[tuple[Block, bytes]]:
    tokens = range(seed * 2**20, seed * 2**20 + n * namespace.block_tokens)
    return [(block, os.urandom(namespace.block_bytes)) for block in namespace.blocks(tokens)]


def client(daemon, token: str | None = None, transport: str = "grpc") -> KVClient:
    return KVClient(ClientConfig((daemon.address,), token=token, transport=transport, timeout_s=20,
                                 lookup_timeout_s=10, down_backoff_s=0.05, max_down_backoff_s=0.2))


def metadata(token: str | None) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token else ()


def lookup(daemon, keys: list[bytes], token: str | None = None) -> int:
    with grpc.insecure_channel(daemon.address) as channel:
        call = channel.unary_unary(method("Lookup"), pb.LookupRequest.SerializeToString, pb.LookupResponse.FromString)
        return call(pb.LookupRequest(keys=keys), metadata=metadata(token), timeout=10).hits


def healthy(daemon) -> bool:
    """A health check on a connection of its own answers SERVING."""
    with grpc.insecure_channel(daemon.address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return answer.status == health_pb2.HealthCheckResponse.SERVING


def refused(fn: Callable[[], object]) -> grpc.StatusCode | None:
    """The status code `fn`'s call ended with, None if it succeeded."""
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return None


def put_head(nbytes: int) -> bytes:
    return pb.PutHead(record_bytes=nbytes).SerializeToString()


# -- call slots ------------------------------------------------------------------------------------------


def test_a_tenant_holding_256_unread_gets_leaves_the_others_served(daemons, token_file):
    daemon, = daemons(1, "--auth-tokens", str(token_file))
    stored = blocks_of(ALICE, 1)
    with client(daemon, TOKENS["alice"]) as alice:
        assert alice.put(stored, LAYOUT.num_layers).stored == 1
    bobs = blocks_of(BOB, 1, seed=1)
    with client(daemon, TOKENS["bob"]) as bob:
        assert bob.put(bobs, LAYOUT.num_layers).stored == 1

    # Alice's read-only token opens 256 Gets of her own block over 8 connections and never reads them.
    channels = [grpc.insecure_channel(daemon.address, options=OPTIONS) for _ in range(8)]
    request = pb.GetRequest(keys=[stored[0][0].key]).SerializeToString()
    streams = [channels[i % 8].unary_stream(method("Get"), None, None)(
        request, metadata=metadata(TOKENS["alice-reader"]), timeout=HANG_GUARD_S) for i in range(256)]
    try:
        first = [refused(lambda stream=stream: next(stream)) for stream in streams]  # her head, or a refusal
        held = first.count(None)
        assert held >= 1 and set(first) <= {None, CODE.RESOURCE_EXHAUSTED}, set(first)

        # While she holds them, Bob is served, and so is a probe without a token.
        bob_keys = [block.key for block, _ in bobs]
        assert lookup(daemon, bob_keys, TOKENS["bob"]) == 1
        with client(daemon, TOKENS["bob"]) as bob:
            assert [bytes(got.payload) for got in bob.get([bobs[0][0]])] == [bobs[0][1]]
        assert healthy(daemon)
        assert held < 256, "one principal held every call slot the daemon has"
    finally:
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()


def test_put_streams_that_send_a_head_and_stall_are_ended_and_health_answers_throughout(daemons):
    daemon, = daemons(1, "--rpc-stream-timeout-s", "2")
    release = threading.Event()

    def stalled() -> Iterator[bytes]:
        yield put_head(MiB)
        release.wait(HANG_GUARD_S)

    channels = [grpc.insecure_channel(daemon.address, options=OPTIONS) for _ in range(8)]
    calls = [channels[i % 8].stream_unary(method("Put"), None, None).future(stalled(), timeout=HANG_GUARD_S)
             for i in range(256)]
    try:
        key = b"k" * 16
        # The slots are taken once a Lookup from the same address is refused for want of them.
        wait_for(lambda: refused(lambda: lookup(daemon, [key])) == CODE.RESOURCE_EXHAUSTED,
                 "256 stalled Put streams taking the slots a Lookup needs")
        assert healthy(daemon), "the health check must answer whatever the tenants hold"
        # The daemon ends every stalled stream by itself: none waits for the client to give up.
        wait_for(lambda: all(call.done() for call in calls), "the daemon ending the stalled Put streams")
        assert {call.code() for call in calls} <= {CODE.DEADLINE_EXCEEDED, CODE.RESOURCE_EXHAUSTED}
        assert CODE.DEADLINE_EXCEEDED in {call.code() for call in calls}
        assert lookup(daemon, [key]) == 0
    finally:
        release.set()
        for channel in channels:
            channel.close()
    assert "Traceback" not in daemon.log()


# -- the put budget ----------------------------------------------------------------------------------------


def authed_data_socket(daemon, token: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", daemon.data_port), timeout=HANG_GUARD_S)
    sock.sendall(wire.frame(wire.AUTH, pb.DataAuth(token=token).SerializeToString()))
    assert read_frame(sock)[0] == wire.AUTHED
    return sock


def test_put_heads_that_declare_the_whole_budget_leave_other_tenants_putting(daemons, token_file):
    """Alice declares 8 records of 17 MiB (the whole 136 MiB budget) on each transport and sends nothing
    more; Bob's puts on both transports must still be stored, and her stalled reservations come back."""
    daemon, = daemons(1, "--auth-tokens", str(token_file), "--max-block-bytes", "17MiB", "--max-inflight-put-bytes",
                      "136MiB", "--max-inflight-put-bytes-per-principal", "68MiB", "--put-record-timeout-s", "3")
    release = threading.Event()

    def declared_only() -> Iterator[bytes]:
        yield put_head(17 * MiB)
        release.wait(HANG_GUARD_S)

    with grpc.insecure_channel(daemon.address, options=OPTIONS) as channel:
        grpc_puts = [channel.stream_unary(method("Put"), None, None).future(
            declared_only(), metadata=metadata(TOKENS["alice"]), timeout=HANG_GUARD_S) for _ in range(8)]
        data_puts = [authed_data_socket(daemon, TOKENS["alice"]) for _ in range(8)]
        try:
            for sock in data_puts:
                sock.sendall(wire.frame(wire.PUT, put_head(17 * MiB)))
            for transport, seed in (("grpc", 1), ("auto", 2)):
                with client(daemon, TOKENS["bob"], transport) as bob:
                    summary = bob.put(blocks_of(BOB, 2, seed), LAYOUT.num_layers)
                    assert summary.stored == 2, (transport, summary, bob.last_errors())

            # Her stalled records are ended by the daemon, on both transports, and their bytes given back.
            wait_for(lambda: all(call.done() for call in grpc_puts), "the daemon ending the stalled gRPC puts")
            assert {call.code() for call in grpc_puts} <= {CODE.DEADLINE_EXCEEDED, CODE.RESOURCE_EXHAUSTED}
            for sock in data_puts:
                kind, head = read_frame(sock)
                assert kind == wire.ERROR
                assert pb.DataError.FromString(head).code in ("DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
            with client(daemon, TOKENS["alice"]) as alice:
                assert alice.put(blocks_of(ALICE, 4, seed=3), LAYOUT.num_layers).stored == 4
        finally:
            release.set()
            for sock in data_puts:
                sock.close()
    assert "Traceback" not in daemon.log()


# -- gRPC Gets that are never read -------------------------------------------------------------------------

PLAIN = Namespace("transport-limits", LAYOUT, block_tokens=2048)
GET_RSS_BOUND = 512 * MiB  # the daemon's send budget (256 MiB) and its own slack; the old code took 1 GiB


def get_errors(daemon) -> float:
    with client(daemon) as probe:
        return probe.server_stats()[daemon.address].value("kvstore_rpc_errors_total", method="Get")


def test_gets_never_read_hold_bounded_memory_and_are_ended(daemons):
    daemon, = daemons(1, "--rpc-stream-timeout-s", "3")
    stored = blocks_of(PLAIN, 4)
    with client(daemon) as writer:
        assert writer.put(stored, LAYOUT.num_layers).stored == 4
    keys = [block.key for block, _ in stored]
    assert lookup(daemon, keys) == 4
    baseline = daemon.rss_bytes()
    errors_before = get_errors(daemon)

    channels = [grpc.insecure_channel(daemon.address, options=OPTIONS) for _ in range(4)]
    request = pb.GetRequest(keys=keys).SerializeToString()
    streams = [channels[i % 4].unary_stream(method("Get"), None, None)(request, timeout=HANG_GUARD_S)
               for i in range(32)]
    try:
        peak = baseline

        def all_ended() -> bool:
            nonlocal peak
            peak = max(peak, daemon.rss_bytes())
            assert peak - baseline < GET_RSS_BOUND, f"32 unread Gets took RSS up by {(peak - baseline) // MiB} MiB"
            return get_errors(daemon) - errors_before >= 32

        # Each was ended by the daemon (counted as such). Its client is not told at once: what it learns is
        # left to its own deadline, since gRPC queues the end behind the messages it has not taken.
        wait_for(all_ended, "the daemon ending Gets whose clients take nothing")
    finally:
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()
    with client(daemon) as reader:  # what they held is free again: another client gets every block
        assert [bytes(got.payload) for got in reader.get([block for block, _ in stored])] == \
            [payload for _, payload in stored]
    assert daemon.rss_bytes() - baseline < GET_RSS_BOUND
    assert "Traceback" not in daemon.log()


# -- idle connections to the gRPC port ---------------------------------------------------------------------

DESCRIPTORS = 600  # RLIMIT_NOFILE (soft and hard) the daemon runs under


def limited_descriptors(tmp_path) -> dict[str, str]:
    """The environment of a daemon started under RLIMIT_NOFILE = DESCRIPTORS, soft and hard, set by a
    sitecustomize module before any of the daemon's code runs (as `ulimit -n` would)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, ({DESCRIPTORS}, {DESCRIPTORS}))\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}


def silent_connection(daemon) -> socket.socket | None:
    """A TCP connection to the gRPC port that sends nothing; None if the kernel refuses it."""
    try:
        return socket.create_connection(("127.0.0.1", daemon.port), timeout=HANG_GUARD_S)
    except OSError:
        return None


def closed_by_daemon(sock: socket.socket, deadline: float) -> bool:
    """Whether the daemon closes `sock` (after its HTTP/2 settings, if any) before `deadline` (monotonic)."""
    try:
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except OSError:  # reset: closed too
        return True


def test_silent_grpc_connections_are_limited_and_closed_and_leave_descriptors_for_segments(
        daemons, tmp_path):
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2000:  # this test's own end of the connections
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    daemon, = daemons(1, "--segment-bytes", "2MiB", "--max-block-bytes", "1MiB", "--max-data-connections", "32",
                      "--max-data-connections-per-peer", "32", "--fd-reserve", "128",
                      "--grpc-handshake-timeout-s", "2", env=limited_descriptors(tmp_path))
    small = Namespace("transport-limits", KVLayout(num_layers=2, kv_heads=2, head_dim=64, dtype="float16"),
                      block_tokens=256)  # 256 KiB blocks: a new 2 MiB segment every few puts
    writer = client(daemon)
    attackers: list[socket.socket] = []
    try:
        first = [(block, os.urandom(small.block_bytes)) for block in small.blocks(range(0, 256 * 4))]
        assert writer.put(first, 2).stored == 4  # connected before the flood
        attackers = [sock for sock in (silent_connection(daemon) for _ in range(1500)) if sock]

        # The connected client keeps putting (new segment files) and getting while the silent ones are held.
        for round_ in range(1, 21):
            blocks = [(block, os.urandom(small.block_bytes))
                      for block in small.blocks(range(256 * 4 * round_, 256 * 4 * (round_ + 1)))]
            summary = writer.put(blocks, 2)
            assert summary.stored == 4, (round_, summary, writer.last_errors())
            got = writer.get([block for block, _ in blocks])
            assert [bytes(g.payload) for g in got] == [payload for _, payload in blocks], writer.last_errors()

        # The daemon closes every silent connection by itself, and then answers new ones.
        deadline = time.monotonic() + HANG_GUARD_S
        assert all(closed_by_daemon(sock, deadline) for sock in attackers), "a silent connection was never closed"
        assert healthy(daemon)
    finally:
        writer.close()
        for sock in attackers:
            sock.close()
    assert "Too many open files" not in daemon.log()
