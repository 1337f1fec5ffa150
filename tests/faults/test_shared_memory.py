"""Hostile clients of the same-host shared-memory path.

A shrunk region: a client registered a 64 KiB /dev/shm object, truncated it to 0 and asked
for a Get into it: the daemon died of SIGBUS. Another process's object: REGISTER took any /dev/shm name, so a Get
overwrote another process's object with KV bytes, and `unlink` deleted it.

Now a region is a sealed memfd whose descriptor the client passes over the daemon's Unix socket: only a
peer on the host, only memory it holds, and memory that cannot shrink under the daemon's mapping.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import socket

import pytest

from kvstore import wire
from kvstore.client import KVClient
from kvstore.proto import pb

from .conftest import NS, items, read_frame

pytestmark = pytest.mark.crash

REGION = 64 * 1024


def refusal(sock: socket.socket) -> pb.DataError:
    kind, head = read_frame(sock)
    assert kind == wire.ERROR, f"expected an ERROR frame, got kind {kind}"
    return pb.DataError.FromString(head)


def register_by_name(name: str, size: int, unlink: bool) -> bytes:
    """A REGISTER frame as clients sent it before: RegisterRegion{name = 1, size = 2, unlink = 3}."""
    raw = name.encode()
    head = bytes([0x0A, len(raw)]) + raw + bytes([0x10]) + _varint(size) + bytes([0x18, int(unlink)])
    return wire.frame(wire.REGISTER, head)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def unix_connection(daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(daemon.data_dir / "data.sock"))
    return sock


def memfd(size: int, seals: int) -> int:
    fd = os.memfd_create(f"kvstore-fault-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def lend(sock: socket.socket, fd: int, size: int) -> tuple[int, bytes]:
    """REGISTER `fd` (in a message of its own after the frame); the daemon's answer."""
    sock.sendall(wire.frame(wire.REGISTER, pb.RegisterRegion(size=size).SerializeToString()))
    socket.send_fds(sock, [b"\0"], [fd])
    return read_frame(sock)


@pytest.fixture
def daemon_with_block(daemons):
    daemon, = daemons(1)
    block, payload = items(seed=71)[0]
    with KVClient([daemon.address]) as client:
        assert client.put([(block, payload)], NS.num_layers).stored == 1
    return daemon, block.key, payload


def get_into_region(sock: socket.socket, key: bytes, region_id: int) -> None:
    request = pb.GetRequest(keys=[key], region_id=region_id, region_offsets=[0])
    sock.sendall(wire.frame(wire.GET, request.SerializeToString()))


def test_a_region_shrunk_under_the_daemon_cannot_kill_it(daemon_with_block):
    daemon, key, payload = daemon_with_block
    # The attack as it was: a named object over TCP, truncated once the daemon has mapped it.
    path = f"/dev/shm/kvstore-fault2-{os.getpid()}"
    with open(path, "wb") as f:
        f.truncate(REGION)
    try:
        with socket.create_connection(("127.0.0.1", daemon.data_port), timeout=10) as sock:
            sock.sendall(register_by_name(os.path.basename(path), REGION, unlink=False))
            kind, head = read_frame(sock)
            if kind == wire.REGISTERED:
                os.truncate(path, 0)
                get_into_region(sock, key, pb.RegionRegistered.FromString(head).region_id)
                try:
                    read_frame(sock)
                except OSError:
                    pass
            else:
                assert kind == wire.ERROR and pb.DataError.FromString(head).code == "PERMISSION_DENIED"
    finally:
        if os.path.exists(path):
            os.unlink(path)
    assert daemon.proc.poll() is None, f"the daemon died with {daemon.proc.returncode}"

    # Today's way: memory that is not sealed against shrinking is refused ...
    for seals in (0, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL):
        with unix_connection(daemon) as sock:
            fd = memfd(REGION, seals)
            try:
                kind, head = lend(sock, fd, REGION)
            finally:
                os.close(fd)
            assert kind == wire.ERROR
            error = pb.DataError.FromString(head)
            assert error.code == "INVALID_ARGUMENT" and "F_SEAL_SHRINK" in error.message, error.message
    # ... and sealed memory cannot be shrunk, so a Get into it is safe.
    with unix_connection(daemon) as sock:
        fd = memfd(REGION, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        try:
            kind, head = lend(sock, fd, REGION)
            assert kind == wire.REGISTERED
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            get_into_region(sock, key, pb.RegionRegistered.FromString(head).region_id)
            kind, head = read_frame(sock)
            part = pb.GetPartHead.FromString(head)
            assert kind == wire.PART and part.in_region and read_frame(sock)[0] == wire.DONE
            with mmap.mmap(fd, REGION) as mapping:
                assert mapping[: len(payload)] == payload, "written by the daemon, straight into place"
        finally:
            os.close(fd)
    assert daemon.proc.poll() is None


def test_a_region_smaller_than_declared_is_refused(daemon_with_block):
    daemon, *_ = daemon_with_block
    with unix_connection(daemon) as sock:
        fd = memfd(4096, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        try:
            kind, head = lend(sock, fd, REGION)
        finally:
            os.close(fd)
        assert kind == wire.ERROR and pb.DataError.FromString(head).code == "INVALID_ARGUMENT"
    assert daemon.proc.poll() is None


def untouched(path: str, content: bytes) -> None:
    assert os.path.exists(path), "another process's object was deleted"
    with open(path, "rb") as f:
        assert f.read() == content, "another process's object was overwritten"


def test_a_client_cannot_name_another_process_object(daemon_with_block):
    daemon, key, _ = daemon_with_block
    path = f"/dev/shm/kvstore-victim-{os.getpid()}"
    secret = os.urandom(REGION)
    with open(path, "wb") as f:
        f.write(secret)
    try:
        with socket.create_connection(("127.0.0.1", daemon.data_port), timeout=10) as sock:
            sock.sendall(register_by_name(os.path.basename(path), REGION, unlink=True))
            kind, head = read_frame(sock)
            if kind == wire.REGISTERED:  # the fault: mapped, unlinked, and now written into
                get_into_region(sock, key, pb.RegionRegistered.FromString(head).region_id)
                read_frame(sock)
            else:
                error = pb.DataError.FromString(head)
                assert error.code == "PERMISSION_DENIED" and "Unix socket" in error.message, error.message
        untouched(path, secret)
        with unix_connection(daemon) as sock:  # on the Unix socket a name is no region either
            sock.sendall(register_by_name(os.path.basename(path), REGION, unlink=True))
            assert refusal(sock).code == "INVALID_ARGUMENT"
        untouched(path, secret)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_a_regular_file_is_not_a_region(daemon_with_block, tmp_path):
    daemon, *_ = daemon_with_block
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(REGION))
    with unix_connection(daemon) as sock:
        fd = os.open(victim, os.O_RDWR)
        try:
            kind, head = lend(sock, fd, REGION)
        finally:
            os.close(fd)
        assert kind == wire.ERROR and pb.DataError.FromString(head).code == "INVALID_ARGUMENT"
    assert victim.read_bytes() == bytes(REGION)


@pytest.fixture
def huge_pages():
    """A few huge pages reserved for the test, where this host has none and lets root reserve them."""
    setting = "/proc/sys/vm/nr_hugepages"
    try:
        with open(setting) as f:
            before = int(f.read())
        if before < 2:
            with open(setting, "w") as f:
                f.write("4")
    except (OSError, ValueError):
        pytest.skip("no huge pages on this host, and they cannot be reserved (needs root)")
    try:
        fd = os.memfd_create("kvstore-hugetlb-probe", os.MFD_HUGETLB)
        try:
            os.ftruncate(fd, 2 * 2**20)
            with mmap.mmap(fd, 2 * 2**20) as probe:
                probe[0] = 1
        finally:
            os.close(fd)
    except OSError as exc:
        pytest.skip(f"no huge page could be had: {exc}")
    yield
    if before < 2:
        with open(setting, "w") as f:
            f.write(str(before))


def test_huge_pages_are_refused_since_seals_do_not_keep_them(daemon_with_block, huge_pages):
    """Seals do not keep huge pages: a sealed MFD_HUGETLB memfd passed the F_SEAL_SHRINK check, but PUNCH_HOLE
    still freed its pages, and the next Get into it killed the daemon with SIGBUS."""
    daemon, key, _ = daemon_with_block
    size = 2 * 2**20
    fd = os.memfd_create("kvstore-fault-hugetlb", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        with unix_connection(daemon) as sock:
            kind, head = lend(sock, fd, size)
            if kind == wire.REGISTERED:  # the old daemon took it: the attack goes on
                _punch_hole(fd, size)
                hog = _take_every_free_huge_page()  # so that the daemon's next write finds none
                try:
                    get_into_region(sock, key, pb.RegionRegistered.FromString(head).region_id)
                    try:
                        read_frame(sock)
                    except OSError:
                        pass
                finally:
                    os.close(hog)
            else:
                error = pb.DataError.FromString(head)
                assert kind == wire.ERROR and "huge pages" in error.message, error.message
    finally:
        os.close(fd)
    assert daemon.proc.poll() is None, f"the daemon died with {daemon.proc.returncode}"
    assert kind == wire.ERROR, "huge pages must be refused at REGISTER"


def _punch_hole(fd: int, size: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
    if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, ctypes.c_long(0), ctypes.c_long(size)):
        raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")


def _take_every_free_huge_page() -> int:
    """A hugetlbfs memfd holding every huge page still free (fallocate fails cleanly where a touch would
    be a SIGBUS); close it to give them back."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.memfd_create("kvstore-hugetlb-hog", os.MFD_HUGETLB)
    page, taken = 2 * 2**20, 0
    while libc.fallocate(fd, 0, ctypes.c_long(taken), ctypes.c_long(page)) == 0:
        taken += page
    return fd
