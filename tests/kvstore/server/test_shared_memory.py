"""The same-host data plane: the daemon writes payloads straight into a client's shared memory.

Shared memory is a sealed memfd the client passes by descriptor over the daemon's Unix socket
(tests/faults/test_shared_memory.py pins what that protects against)."""

import fcntl
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from kvstore import wire
from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.proto import pb
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

NS = Namespace("shm-test", KVLayout(num_layers=4, kv_heads=2, head_dim=32, dtype="float16"), block_tokens=16)


def prompt(n: int, seed: int = 0):
    return [(b, os.urandom(NS.block_bytes)) for b in NS.blocks(range(seed * 10**5, seed * 10**5 + 16 * n))]


def region_bytes(client: KVClient, address: str) -> float:
    return client.server_stats()[address].value("kvstore_region_read_bytes_total")


@pytest.mark.parametrize("mode, used", [("auto", True), ("off", False)])
def test_same_host_gets_into_shared_buffers_go_through_shared_memory(daemons, mode, used):
    daemon, = daemons(1)
    items = prompt(5)
    with KVClient(ClientConfig((daemon.address,), shared_memory=mode)) as client:
        client.put(items, NS.num_layers)
        memory = client.shared_buffer(5 * NS.block_bytes)
        buffers = [memory[i * NS.block_bytes : (i + 1) * NS.block_bytes] for i in range(5)]
        got = client.get([b for b, _ in items], into=buffers)
        assert [bytes(b) for b in buffers] == [p for _, p in items] and len(got) == 5
        layered = client.get([b for b, _ in items], 1, 3, layer_major=True, into=buffers)
        assert [bytes(g.payload) for g in layered] == [p[NS.layer_bytes : 3 * NS.layer_bytes] for _, p in items]
        assert (region_bytes(client, daemon.address) > 0) == used
        private = client.get([b for b, _ in items], into=[bytearray(NS.block_bytes) for _ in items])
        assert [bytes(g.payload) for g in private] == [p for _, p in items], "other memory: over the socket"
        del buffers, got, layered
    wait_until_unmapped(daemon, os.getpid())


def unix_connection(daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(daemon.data_dir / "data.sock"))
    return sock


def sealed_memfd(size: int) -> int:
    fd = os.memfd_create(f"kvstore-{os.getpid()}-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def send_register(sock, size: int, fd: int | None) -> None:
    sock.sendall(wire.frame(wire.REGISTER, pb.RegisterRegion(size=size).SerializeToString()))
    if fd is not None:
        socket.send_fds(sock, [b"\0"], [fd])


def lend(sock, size: int) -> int:
    fd = sealed_memfd(size)
    try:
        send_register(sock, size, fd)
    finally:
        os.close(fd)  # the daemon's mapping keeps the memory
    kind, head = wire.parse_prefix(_recv(sock, wire.PREFIX.size))
    assert kind == wire.REGISTERED, kind
    return pb.RegionRegistered.FromString(_recv(sock, head)).region_id


def _recv(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def error_code(sock) -> str:
    kind, head_len = wire.parse_prefix(_recv(sock, wire.PREFIX.size))
    assert kind == wire.ERROR, kind
    return pb.DataError.FromString(_recv(sock, head_len)).code


@pytest.mark.parametrize("case", ["outside the region", "another connection's region", "no offsets"])
def test_offsets_outside_a_registered_region_are_rejected(daemon_with_block, case):
    daemon, key = daemon_with_block
    with unix_connection(daemon) as sock, unix_connection(daemon) as other:
        region_id = lend(sock, 64 * 1024)
        other_id = lend(other, 64 * 1024)
        request = {
            "outside the region": pb.GetRequest(keys=[key] * 2, region_id=region_id, region_offsets=[0, 70_000]),
            "another connection's region": pb.GetRequest(keys=[key], region_id=other_id + 7, region_offsets=[0]),
            "no offsets": pb.GetRequest(keys=[key], region_id=region_id),
        }[case]
        sock.sendall(wire.frame(wire.GET, request.SerializeToString()))
        assert error_code(sock) == "INVALID_ARGUMENT"


def test_oversized_or_missing_regions_are_refused(daemons):
    daemon, = daemons(1, "--max-region-bytes", "1MiB")
    with unix_connection(daemon) as sock:
        send_register(sock, 2**21, None)
        assert error_code(sock) == "RESOURCE_EXHAUSTED"
    with unix_connection(daemon) as sock:  # the frame, then a message without a descriptor
        send_register(sock, 4096, None)
        sock.sendall(b"\0")
        assert error_code(sock) == "INVALID_ARGUMENT"
    with socket.create_connection(("127.0.0.1", daemon.data_port)) as sock:  # not offered over TCP
        send_register(sock, 4096, None)
        assert error_code(sock) == "PERMISSION_DENIED"


@pytest.fixture
def daemon_with_block(daemons):
    daemon, = daemons(1)
    items = prompt(1, seed=9)
    with KVClient([daemon.address]) as client:
        client.put(items, NS.num_layers)
    return daemon, items[0][0].key


def mapped_regions(daemon, client_pid: int) -> list[str]:
    """The daemon's mappings of memory lent by `client_pid` (its memfds are named kvstore-<pid>)."""
    with open(f"/proc/{daemon.proc.pid}/maps") as f:
        return [line for line in f if f"/memfd:kvstore-{client_pid} " in line]


def wait_until_unmapped(daemon, client_pid: int) -> None:
    wait_for(lambda: not mapped_regions(daemon, client_pid), "the daemon unmapping a closed client's region",
             timeout_s=10)


def test_a_client_that_dies_leaves_no_region_behind(daemon_with_block, tmp_path):
    daemon, _ = daemon_with_block
    script = textwrap.dedent(f"""
        import os, sys, time
        from kvstore.block import KVLayout, Namespace
        from kvstore.client import KVClient
        ns = Namespace("shm-test", KVLayout(4, 2, 32, "float16"), 16)
        with KVClient(["{daemon.address}"]) as client:
            blocks = ns.blocks(range(9 * 10**5, 9 * 10**5 + 16))
            memory = client.shared_buffer(ns.block_bytes)
            assert client.get(blocks, into=[memory])
            print("ready", flush=True)
            time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert mapped_regions(daemon, child.pid), "lent: the daemon maps it"
        child.send_signal(signal.SIGKILL)
        child.wait()
        wait_until_unmapped(daemon, child.pid)
    finally:
        child.kill()


def test_gets_into_a_shared_buffer_land_in_place(daemons):
    daemon, = daemons(1)
    items = prompt(4, seed=5)
    with KVClient([daemon.address]) as client:
        client.put(items, NS.num_layers)
        shared = client.shared_buffer(4 * NS.block_bytes)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("kvstore-")], "memory with no name at all"
        views = [shared[i * NS.block_bytes : (i + 1) * NS.block_bytes] for i in range(4)]
        before = region_bytes(client, daemon.address)
        got = client.get([b for b, _ in items], into=views)
        assert [bytes(g.payload) for g in got] == [p for _, p in items]
        assert bytes(shared) == b"".join(p for _, p in items), "written by the daemon, straight into place"
        assert region_bytes(client, daemon.address) - before == 4 * NS.block_bytes
        views[1][5] ^= 0xFF  # a reader that scribbles on its buffer only hurts itself: the next get heals it
        assert [bytes(g.payload) for g in client.get([b for b, _ in items], into=views)] == [p for _, p in items]
        del views, got
