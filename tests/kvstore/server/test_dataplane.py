"""The bulk data channel (TCP, or the Unix socket on the same host): used when offered, precise errors for
hostile frames, bounded memory (hostile clients: tests/faults/test_data_channel.py)."""

import os
import socket
import struct
import time

import grpc
import psutil
import pytest

from kvstore import wire
from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.proto import method, pb
from kvstore.record import build_record

pytestmark = pytest.mark.integration

NS = Namespace("data-test", KVLayout(num_layers=4, kv_heads=2, head_dim=32, dtype="float16"), block_tokens=16)


@pytest.fixture
def daemon(daemons):
    return daemons(1, "--max-block-bytes", "4MiB", "--data-frame-timeout-s", "1")[0]


def prompt(n_blocks: int, start: int = 0):
    return [(b, os.urandom(NS.block_bytes)) for b in NS.blocks(range(start, start + n_blocks * NS.block_tokens))]


def data_calls(client: KVClient, address: str, method: str) -> float:
    return client.server_stats()[address].value("kvstore_rpc_seconds_count", method=method)


@pytest.mark.parametrize("transport, shared_memory, channel", [("auto", "auto", "unix"), ("auto", "off", "tcp"),
                                                                ("grpc", "auto", None)])
def test_transport_choice(daemon, transport, shared_memory, channel):
    items = prompt(5)
    with KVClient(ClientConfig((daemon.address,), transport=transport, shared_memory=shared_memory)) as client:
        assert client.put(items, NS.num_layers).stored == 5
        assert [g.payload for g in client.get([b for b, _ in items])] == [p for _, p in items]
        layered = client.get([b for b, _ in items], 2, 4, layer_major=True)
        assert [bytes(g.payload) for g in layered] == [p[2 * NS.layer_bytes :] for _, p in items]
        assert (data_calls(client, daemon.address, "data.Get") > 0) == (channel is not None)
        assert (data_calls(client, daemon.address, "data.Put") > 0) == (channel is not None)
        used = client._async.shards[daemon.address].known_data_channel()
        assert (None if used is None else "unix" if used.same_host else "tcp") == channel
        assert not client.stats.data_fallbacks


def test_info_names_the_unix_socket(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        info = channel.unary_unary(method("Info"), pb.InfoRequest.SerializeToString,
                                   pb.InfoResponse.FromString)(pb.InfoRequest(), timeout=10)
    assert info.data_socket == str(daemon.data_dir.absolute() / "data.sock") and info.host_id
    assert info.data_port == daemon.data_port


@pytest.mark.parametrize("shared_memory", ["auto", "off"])
def test_pooled_connections_the_daemon_closed_while_idle_are_not_reused(daemons, shared_memory):
    daemon, = daemons(1, "--data-idle-timeout-s", "0.5")
    items = prompt(2, start=1000)
    with KVClient(ClientConfig((daemon.address,), shared_memory=shared_memory)) as client:
        assert client.put(items, NS.num_layers).stored == 2
        assert len(client.get([b for b, _ in items])) == 2
        assert data_connections(daemon) > 0, "the client pools its data connection"
        # the daemon closes the pooled connections once idle: waited for as the daemon's sockets show it
        while data_connections(daemon):
            time.sleep(0.05)
        assert len(client.get([b for b, _ in items])) == 2
        assert not client.stats.data_fallbacks and not client.stats.shard_errors
        assert data_calls(client, daemon.address, "data.Get") == 2


def data_connections(daemon) -> int:
    """The daemon's open data-channel connections: TCP ones on its data port, and Unix ones on its socket (the
    kernel names an accepted Unix connection by the listening socket's path, and shows no state: all but the
    listener)."""
    socket_path = str(daemon.data_dir.absolute() / "data.sock")
    sockets = psutil.Process(daemon.proc.pid).net_connections(kind="all")
    tcp = sum(1 for c in sockets if c.family != socket.AF_UNIX and c.laddr and c.laddr.port == daemon.data_port
              and c.status == psutil.CONN_ESTABLISHED)
    unix = sum(1 for c in sockets if c.family == socket.AF_UNIX and c.laddr == socket_path)
    return tcp + max(0, unix - 1)


def test_get_into_caller_buffers(daemon):
    items = prompt(3)
    buffers = [bytearray(NS.block_bytes) for _ in items]
    with KVClient([daemon.address]) as client:
        client.put(items, NS.num_layers)
        got = client.get([b for b, _ in items], into=buffers)
        assert [bytes(b) for b in buffers] == [p for _, p in items]
        assert all(g.payload.obj is buf for g, buf in zip(got, buffers)), "no copy: payload views the caller's buffer"
        # buffers too small for the records: misses counted by cause, not an exception that would leave the
        # other daemons' reads writing into buffers the caller has taken back
        assert client.get([b for b, _ in items], into=[bytearray(10) for _ in range(3)]) == []
        assert client.stats.miss_causes["layout_mismatch"] == 3


def exchange(daemon, payload: bytes, read_timeout: float = 5.0) -> tuple[int, bytes]:
    """Send raw bytes on a fresh data connection; the first frame the daemon answers with."""
    with socket.create_connection(("127.0.0.1", daemon.data_port), timeout=read_timeout) as sock:
        sock.sendall(payload)
        prefix = _recv(sock, wire.PREFIX.size)
        kind, head_len = wire.parse_prefix(prefix)
        return kind, _recv(sock, head_len)


def _recv(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _bad_frames():
    (block, payload), = prompt(1, start=500)
    header, body = build_record(block, payload, NS.num_layers, "chat")
    put = lambda declared: wire.frame(wire.PUT, pb.PutHead(record_bytes=declared).SerializeToString())  # noqa: E731
    flipped = bytearray(body)
    flipped[7] ^= 1
    return {
        "bad magic": (b"XXXX" + bytes(8), "INVALID_ARGUMENT"),
        "head too long": (struct.pack("<4sBxxxI", b"KVD1", wire.GET, wire.MAX_HEAD_BYTES + 1), "INVALID_ARGUMENT"),
        "unknown kind": (wire.frame(42), "INVALID_ARGUMENT"),
        "get head not protobuf": (wire.frame(wire.GET, b"\xff\xff"), "INVALID_ARGUMENT"),
        "get short key": (wire.frame(wire.GET, pb.GetRequest(keys=[b"abc"]).SerializeToString()), "INVALID_ARGUMENT"),
        "put of zero bytes": (put(0), "INVALID_ARGUMENT"),
        "put over the block limit": (put(5 * 2**20), "RESOURCE_EXHAUSTED"),
        "put garbage header": (put(len(header) + len(body)) + os.urandom(len(header)), "INVALID_ARGUMENT"),
        "put lying length": (put(len(header) + len(body) + 8) + header, "INVALID_ARGUMENT"),
        "put flipped payload": (put(len(header) + len(body)) + header + bytes(flipped), "INVALID_ARGUMENT"),
        "put then a get frame": (put(len(header) + len(body)) + header + body + wire.frame(wire.GET),
                                 "INVALID_ARGUMENT"),
    }


@pytest.fixture(scope="module")
def shared(module_daemons):
    """One daemon for the hostile frames: each case checks its own error frame, and puts blocks of its own."""
    return module_daemons(1, "--max-block-bytes", "4MiB", "--data-frame-timeout-s", "1")[0]


@pytest.mark.parametrize("case", list(_bad_frames()))
def test_hostile_frames_get_an_error_frame_and_the_daemon_keeps_serving(shared, case):
    daemon = shared
    payload, code = _bad_frames()[case]
    kind, head = exchange(daemon, payload)
    assert kind == wire.ERROR
    assert pb.DataError.FromString(head).code == code
    with KVClient([daemon.address]) as client:
        stored_before = client.server_stats()[daemon.address].value("kvstore_puts_total", result="stored")
        items = prompt(2, start=10_000 + 100 * list(_bad_frames()).index(case))  # new to the shared daemon
        assert client.put(items, NS.num_layers).stored == 2
        assert len(client.get([b for b, _ in items])) == 2
        assert client.server_stats()[daemon.address].value("kvstore_puts_total", result="stored") == stored_before + 2


def get_frame() -> bytes:
    return wire.frame(wire.GET, pb.GetRequest(keys=[b"k" * 16]).SerializeToString())


def answered(sock) -> list[int]:
    """The kinds of the frames of one Get's answer, up to its DONE; those before the close if the daemon closed
    the connection."""
    kinds: list[int] = []
    try:
        while wire.DONE not in kinds:
            kind, head_len = wire.parse_prefix(_recv(sock, wire.PREFIX.size))
            _recv(sock, head_len)
            kinds.append(kind)
    except ConnectionError:
        pass
    return kinds


def test_a_client_stalled_inside_a_frame_is_dropped_and_one_idle_between_frames_is_not(daemons):
    # Told apart by the order of the daemon's own deadlines, not by a clock here: the idle connection has waited
    # longer than the stalled one when the stalled one is dropped. An idle timeout past the hang guard (60 s)
    # leaves the frame timeout the only one that can drop the stalled connection while the test runs.
    daemon, = daemons(1, "--data-frame-timeout-s", "1", "--data-idle-timeout-s", "1h")
    with socket.create_connection(("127.0.0.1", daemon.data_port), timeout=60) as idle:
        idle.sendall(get_frame())
        assert answered(idle) == [wire.PART, wire.DONE]  # from here the daemon waits for this one's next frame
        with socket.create_connection(("127.0.0.1", daemon.data_port), timeout=60) as stalled:
            stalled.sendall(wire.frame(wire.PUT, pb.PutHead(record_bytes=100_000).SerializeToString())[:-1])
            assert stalled.recv(1) == b"", "the daemon closes the connection stalled inside a frame"
        idle.sendall(get_frame())
        assert answered(idle) == [wire.PART, wire.DONE], "the connection idle between frames is still served"


def test_memory_stays_bounded_under_abandoned_puts(daemon):
    """100 clients each send the header and half the payload of a valid 3 MiB record, then hang up: what
    they sent (150 MiB in all) is dropped with them. The record is valid so that the daemon reads on: one
    it refuses at once resets the connection while the client still sends."""
    big = Namespace("data-test-big", KVLayout(num_layers=4, kv_heads=8, head_dim=128, dtype="float16"),
                    block_tokens=192)
    block, = big.blocks(range(big.block_tokens))
    header, payload = build_record(block, os.urandom(big.block_bytes), big.num_layers, "chat")
    rss_before = daemon.rss_bytes()
    for _ in range(100):
        with socket.create_connection(("127.0.0.1", daemon.data_port), timeout=5) as sock:
            sock.sendall(wire.frame(wire.PUT, pb.PutHead(record_bytes=len(header) + len(payload)).SerializeToString())
                         + header + payload[: len(payload) // 2])
    while data_connections(daemon):  # the daemon has seen every hang-up (not a guess of how long that takes)
        time.sleep(0.05)
    assert daemon.rss_bytes() - rss_before < 96 * 2**20
    with KVClient([daemon.address]) as client:
        assert client.put(prompt(1, start=800), NS.num_layers).stored == 1


def test_a_daemon_without_a_data_channel_serves_over_grpc(daemons):
    daemon, = daemons(1, "--data-port", "off")
    assert daemon.data_port is None
    items = prompt(2)
    with KVClient([daemon.address]) as client:
        assert client.put(items, NS.num_layers).stored == 2
        assert len(client.get([b for b, _ in items])) == 2
