"""Hostile clients of the bulk data channel: idle sockets, connection floods, declared sizes.

Silent sockets: 260 silent sockets turned every other client's hits into misses (connections
past the limit were reset, idle time between frames was never timed out, and the client did not fall back to
gRPC).
Declared sizes: a 13-byte prefix declaring an 8 MiB head made the daemon allocate 8 MiB at once, and the
memory never came back.
"""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import pytest

from kvstore import wire
from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.client.loading import BufferDestination
from kvstore.proto import pb
from kvstore.record import build_record
from kvstore.server.config import ServerConfig, load_config
from tests.waiting import wait_for

from .conftest import NS, items, read_frame

pytestmark = pytest.mark.crash

MiB = 2**20


def connect(daemon, source: str = "127.0.0.1", timeout_s: float = 10.0) -> socket.socket:
    """A TCP connection to the daemon's data port from `source` (any 127.x address is this host)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", daemon.data_port))
    return sock


def error_code(sock: socket.socket) -> str:
    kind, head = read_frame(sock)
    assert kind == wire.ERROR, f"expected an ERROR frame, got kind {kind}"
    return pb.DataError.FromString(head).code


def data_gets(address: str) -> float:
    with KVClient(ClientConfig((address,), transport="grpc")) as client:
        return client.server_stats()[address].value("kvstore_rpc_seconds_count", method="data.Get")


def served_over_the_data_channel(daemon, source: str = "127.0.0.3") -> None:
    """A Get answered on a fresh connection (from an address of its own, past any per-peer limit): every
    connection accepted before it has been read from."""
    with connect(daemon, source) as sock:
        sock.sendall(wire.frame(wire.GET, pb.GetRequest(keys=[b"k" * 16]).SerializeToString()))
        assert read_frame(sock)[0] == wire.PART


# -- fault 5: idle connections ----------------------------------------------------------------------


def test_an_idle_connection_is_closed_after_the_idle_timeout(daemons):
    daemon, = daemons(1, "--data-idle-timeout-s", "1")
    with connect(daemon, timeout_s=20) as sock:
        assert sock.recv(1) == b"", "the daemon closes a connection that stays silent between frames"
    with connect(daemon) as sock:  # a connection in use is not affected
        for _ in range(3):
            sock.sendall(wire.frame(wire.GET, pb.GetRequest(keys=[b"k" * 16]).SerializeToString()))
            assert read_frame(sock)[0] == wire.PART and read_frame(sock)[0] == wire.DONE


def test_connections_past_the_per_peer_limit_get_an_error_frame(daemons):
    daemon, = daemons(1, "--max-data-connections-per-peer", "4")
    held = [connect(daemon, source="127.0.0.2") for _ in range(4)]
    try:
        with connect(daemon, source="127.0.0.2") as extra:
            assert error_code(extra) == "RESOURCE_EXHAUSTED"
        served_over_the_data_channel(daemon)  # another address is served
    finally:
        for sock in held:
            sock.close()


def test_connections_past_the_total_limit_get_an_error_frame(daemons):
    daemon, = daemons(1, "--max-data-connections", "6", "--max-data-connections-per-peer", "4")
    held = [connect(daemon, source=f"127.0.0.{2 + i % 2}") for i in range(6)]
    try:
        with connect(daemon, source="127.0.0.4") as extra:
            assert error_code(extra) == "RESOURCE_EXHAUSTED"
    finally:
        for sock in held:
            sock.close()


def test_silent_sockets_do_not_turn_other_clients_hits_into_misses(daemons):
    daemon, = daemons(1)  # the default limits
    blocks = items(seed=51, n=20)
    tcp = ClientConfig((daemon.address,), shared_memory="off")  # the data channel over TCP, from 127.0.0.1
    with KVClient(tcp) as client:
        assert client.put(blocks, NS.num_layers).stored == 20
    attackers = [connect(daemon, source="127.0.0.2") for _ in range(260)]
    try:
        before = data_gets(daemon.address)
        with KVClient(tcp) as client:  # another address: served over the data channel itself
            assert sum(len(client.get([block])) for block, _ in blocks) == 20
        assert data_gets(daemon.address) - before == 20

        attackers += [connect(daemon, source="127.0.0.1") for _ in range(260)]
        with KVClient(tcp) as client:  # the attacker's address: its data connections are refused ...
            buffers = [bytearray(NS.block_bytes) for _ in blocks]  # a layer-pipelined load (the engines' path)
            handle = client.load([block for block, _ in blocks], BufferDestination(buffers, NS.num_layers,
                                                                                   NS.layer_bytes))
            assert handle.wait(timeout=10) == 20 * NS.block_tokens
            assert [bytes(b) for b in buffers] == [payload for _, payload in blocks]
            assert client.stats.data_fallbacks[daemon.address] == 1
            got = [client.get([block]) for block, _ in blocks]
            assert [bytes(g[0].payload) for g in got] == [payload for _, payload in blocks], "... and gRPC serves"
            assert client.stats.data_fallbacks[daemon.address] > 0
            assert not client.last_errors() and not client.stats.shard_errors, "the daemon is not marked down"
            assert client.put(items(seed=52, n=2), NS.num_layers).stored == 2
    finally:
        for sock in attackers:
            sock.close()


# -- fault 6: memory amplification ------------------------------------------------------------------

# Each connection costs the daemon a task, a socket and its kernel buffers: well under 100 KiB. 64 of them,
# with the bytes they actually sent, stay far below this; allocating by the declared sizes (512 MiB for
# the heads, 480 MiB for the records) is 15 times over it.
RSS_BOUND = 32 * MiB


def unread(daemon, socks) -> int:
    """Bytes sent on `socks` that the daemon has not read yet: what its ends of these connections hold in their
    receive queues (/proc/net/tcp: rx_queue, in hex)."""
    clients = {sock.getsockname() for sock in socks}
    queued = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, _, queues = line.split()[1:5]
        address, port = remote.split(":")
        if int(local.split(":")[1], 16) == daemon.data_port and \
                (socket.inet_ntoa(int(address, 16).to_bytes(4, "little")), int(port, 16)) in clients:
            queued += int(queues.split(":")[1], 16)
    return queued


def settled_rss(daemon, sent=()) -> int:
    """The daemon's RSS once it has read every byte sent on `sent`: whatever it allocates for what they declared
    before the rest arrives, it has allocated by then."""
    wait_for(lambda: unread(daemon, sent) == 0, "the daemon reading every byte sent")
    served_over_the_data_channel(daemon)
    return daemon.rss_bytes()


def rss_growth_until(daemon, baseline: int, reached, timeout_s: float = 60.0) -> int:
    """The daemon's RSS growth over `baseline`, polled until `reached(growth)` (the daemon reads what was sent,
    or frees what was closed, in its own time) or the timeout, which only ends a hang."""
    deadline = time.monotonic() + timeout_s
    while True:
        served_over_the_data_channel(daemon)
        growth = daemon.rss_bytes() - baseline
        if reached(growth) or time.monotonic() > deadline:
            return growth
        time.sleep(0.1)


def test_a_declared_head_size_is_not_allocated_before_it_arrives(daemons):
    daemon, = daemons(1)
    baseline = settled_rss(daemon)
    socks = [connect(daemon) for _ in range(64)]
    try:
        for sock in socks:  # 13 bytes each: a prefix declaring the largest head, and one byte of it
            sock.sendall(wire.PREFIX.pack(wire.MAGIC, wire.GET, wire.MAX_HEAD_BYTES) + b"\x0a")
        grown = settled_rss(daemon, socks) - baseline
        assert grown < RSS_BOUND, f"64 declared 8 MiB heads took {grown / MiB:.0f} MiB"
    finally:
        for sock in socks:
            sock.close()


BIG = Namespace("fault6", KVLayout(num_layers=16, kv_heads=16, head_dim=128, dtype="float16"), block_tokens=256)


def big_record_start() -> tuple[bytes, int]:
    """A PUT frame and the valid header of a 32 MiB record: the start of a put that never finishes."""
    block = BIG.blocks(range(BIG.block_tokens))[0]
    header, payload = build_record(block, bytes(BIG.block_bytes), BIG.num_layers, "chat")
    frame = wire.frame(wire.PUT, pb.PutHead(record_bytes=len(header) + len(payload)).SerializeToString())
    return frame + header, len(payload)


def test_a_declared_record_size_is_not_allocated_before_it_arrives_and_is_given_back(daemons):
    daemon, = daemons(1)
    start, payload_len = big_record_start()
    assert payload_len == 32 * MiB
    baseline = settled_rss(daemon)
    socks = [connect(daemon) for _ in range(15)]  # 480 MiB declared: inside the daemon's put budget
    try:
        for sock in socks:  # the record's own bytes (zeros): each layer is verified as soon as it is in
            sock.sendall(start + bytes(4096))
        grown = settled_rss(daemon, socks) - baseline
        assert grown < RSS_BOUND, f"15 declared 32 MiB records took {grown / MiB:.0f} MiB"
        for sock in socks[:4]:  # bytes that did arrive are held while the record is unfinished ...
            sock.sendall(bytes(16 * MiB))
        assert rss_growth_until(daemon, baseline, lambda growth: growth > 48 * MiB) > 48 * MiB
    finally:
        for sock in socks:
            sock.close()
    grown = rss_growth_until(daemon, baseline, lambda growth: growth < RSS_BOUND)
    assert grown < RSS_BOUND, f"{grown / MiB:.0f} MiB still held once the puts were abandoned"


def test_bytes_of_abandoned_heads_are_given_back(daemons):
    daemon, = daemons(1)
    baseline = settled_rss(daemon)
    socks = [connect(daemon, source=f"127.0.1.{i % 4 + 1}") for i in range(32)]
    try:
        for sock in socks:  # half of the largest head each: 128 MiB that did arrive, held while unfinished ...
            sock.sendall(wire.PREFIX.pack(wire.MAGIC, wire.GET, wire.MAX_HEAD_BYTES) + bytes(4 * MiB))
        assert rss_growth_until(daemon, baseline, lambda growth: growth > 96 * MiB) > 96 * MiB
    finally:
        for sock in socks:
            sock.close()
    grown = rss_growth_until(daemon, baseline, lambda growth: growth < RSS_BOUND)
    assert grown < RSS_BOUND, f"{grown / MiB:.0f} MiB of abandoned heads still held"


def test_bytes_held_for_unfinished_frames_are_bounded_daemon_wide(daemons):
    daemon, = daemons(1, "--max-unfinished-frame-bytes", "1MiB", "--max-block-bytes", "1MiB",
                      "--max-inflight-put-bytes", "1MiB")
    a, b = connect(daemon), connect(daemon)
    try:
        for sock in (a, b):  # 700 KiB of an 8 MiB head each: together past the daemon's 1 MiB
            sock.sendall(wire.PREFIX.pack(wire.MAGIC, wire.GET, wire.MAX_HEAD_BYTES) + bytes(700 * 1024))
        readable, _, _ = select.select([a, b], [], [], 10)
        assert readable, "one of the two is refused at once"
        assert error_code(readable[0]) == "RESOURCE_EXHAUSTED"
    finally:
        a.close()
        b.close()
    with KVClient([daemon.address]) as client:  # what was held came back
        blocks = items(seed=61, n=2)
        assert client.put(blocks, NS.num_layers).stored == 2
        assert len(client.get([block for block, _ in blocks])) == 2


def test_the_data_channel_settings_are_checked(tmp_path):
    config = ServerConfig(data_dir=tmp_path)
    assert config.data_socket == tmp_path / "data.sock" and config.data_idle_timeout_s > 0
    assert ServerConfig(data_dir=tmp_path, data_socket=None).data_socket is None
    with pytest.raises(ValueError, match="107 bytes"):
        ServerConfig(data_dir=tmp_path / ("d" * 120))
    with pytest.raises(ValueError, match="max_data_connections_per_peer"):
        ServerConfig(data_dir=tmp_path, max_data_connections=8, max_data_connections_per_peer=9)
    with pytest.raises(ValueError, match="max_unfinished_frame_bytes"):
        ServerConfig(data_dir=tmp_path, max_unfinished_frame_bytes=MiB, max_block_bytes=2 * MiB)
    loaded = load_config(["--data-dir", str(tmp_path), "--data-socket", "off", "--data-idle-timeout-s", "2m",
                          "--max-unfinished-frame-bytes", "128MiB"], environ={})
    assert (loaded.data_socket, loaded.data_idle_timeout_s, loaded.max_unfinished_frame_bytes) == (None, 120, 128 * MiB)
