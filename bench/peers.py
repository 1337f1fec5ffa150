"""The contenders of bench/dataplane.py: our daemon, raw loopback TCP, raw file I/O, Redis and Mooncake Store.

Each one stores `count` blocks of one size under names made from an integer and reads them back into
pre-touched destination buffers where its API allows (Redis and Mooncake's plain `get` return new
bytes: that is their API). `get_many` is each system's batched read path.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.server.process import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
PEER_LIBS = ROOT / "bench" / ".peers" / "lib"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


class Contender:
    name = "?"

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def prepare(self, size: int, names: int) -> None: ...
    def register(self, whole: memoryview) -> None: ...
    def memory(self, nbytes: int) -> memoryview | None:
        """Destination memory of its own (shared with its server), or None for ordinary memory."""
        return None
    def put(self, name: int, data: bytes) -> None: raise NotImplementedError
    def put_many(self, names: list[int], data: bytes) -> None:
        for name in names:
            self.put(name, data)
    def cpu_seconds(self) -> float | None:
        """CPU time so far of its client (this process) and its servers, where it can tell."""
        return None
    def get(self, name: int, buf: memoryview) -> None: raise NotImplementedError
    def get_many(self, names: list[int], bufs: list[memoryview]) -> None:
        for name, buf in zip(names, bufs):
            self.get(name, buf)
    def clear(self, names: list[int]) -> None: ...


# -- raw loopback TCP: the limit ----------------------------------------------------------------------


def _tcp_server(port_queue: mp.Queue, max_size: int) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    store = bytearray(os.urandom(max_size))  # pre-touched
    sink = memoryview(bytearray(max_size))
    sink[:] = store
    header = struct.Struct("<cIQ")
    while True:
        raw = _recv_exact(conn, header.size)
        if raw is None:
            return
        op, count, size = header.unpack(raw)
        if op == b"P":
            for _ in range(count):
                view = sink[:size]
                while len(view):
                    view = view[conn.recv_into(view):]
            conn.sendall(b"k")
        else:
            for _ in range(count):
                conn.sendall(memoryview(store)[:size])


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class RawTCP(Contender):
    """Request/response over one loopback connection, no framing beyond a 13-byte header."""
    name = "raw TCP"

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size

    def start(self) -> None:
        queue: mp.Queue = mp.Queue()
        self.proc = mp.Process(target=_tcp_server, args=(queue, self.max_size), daemon=True)
        self.proc.start()
        self.conn = socket.create_connection(("127.0.0.1", queue.get(timeout=10)))
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.header = struct.Struct("<cIQ")

    def stop(self) -> None:
        self.conn.close()
        self.proc.join(timeout=5)

    def put(self, name: int, data: bytes) -> None:
        self.conn.sendall(self.header.pack(b"P", 1, len(data)))
        self.conn.sendall(data)
        self.conn.recv(1)

    def get(self, name: int, buf: memoryview) -> None:
        self.get_many([name], [buf])

    def get_many(self, names: list[int], bufs: list[memoryview]) -> None:
        self.conn.sendall(self.header.pack(b"G", len(bufs), len(bufs[0])))
        for buf in bufs:
            view = buf
            while len(view):
                view = view[self.conn.recv_into(view):]


# -- raw file appends and reads: the limit of what a store on this file system can do ---------------------


class RawFile(Contender):
    """Blocks appended with pwrite to files in a directory of the same file system as the daemon's data
    directory, kept until the end as the daemon keeps its segments, and read back with preadv. No
    framing, no checksums, no index, no network.

    Through the page cache ("raw file") every put takes fresh page-cache pages: on these VMs guest memory
    that was never touched (or that the balloon took back) costs ~2.5 us per 4 KiB page, which bounds puts.
    With O_DIRECT ("raw file (O_DIRECT)") the bytes go from one reused, aligned buffer to the device and
    skip the page cache: what a store writing aligned records with O_DIRECT could reach here. Its reads
    come from the device too: the cold-read limit."""

    SEGMENT_BLOCKS = 64
    ALIGN = 4096

    def __init__(self, direct: bool = False) -> None:
        self.direct = direct
        self.name = "raw file (O_DIRECT)" if direct else "raw file"

    def start(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-file-"))
        self.fds: list[int] = []
        self.where: dict[int, tuple[int, int]] = {}  # name -> (fd, offset)
        self.staging: mmap.mmap | None = None  # page-aligned, reused: O_DIRECT's buffer

    def stop(self) -> None:
        for fd in self.fds:
            os.close(fd)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def prepare(self, size: int, names: int) -> None:
        if self.direct:
            if size % self.ALIGN:
                raise ValueError(f"O_DIRECT needs {self.ALIGN}-byte multiples, not {size}")
            self.staging = mmap.mmap(-1, size)
            self.staging[:] = b"\x01" * size  # pre-touched, like every destination

    def put(self, name: int, data: bytes) -> None:
        if not self.fds or self.offset + len(data) > self.SEGMENT_BLOCKS * len(data):
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
            self.fds.append(os.open(self.workdir / f"{len(self.fds):06d}", flags, 0o600))
            self.offset = 0
        source = data
        if self.direct:
            self.staging[:] = data  # the one copy a store receiving into aligned memory would not make
            source = self.staging
        _write_at(self.fds[-1], memoryview(source), self.offset)
        self.where[name] = (self.fds[-1], self.offset)
        self.offset += len(data)

    def get(self, name: int, buf: memoryview) -> None:
        fd, offset = self.where[name]
        if self.direct:
            _read_at(fd, memoryview(self.staging), offset)
            buf[:] = self.staging
        else:
            _read_at(fd, buf, offset)


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        written = os.pwritev(fd, [view], offset)
        view, offset = view[written:], offset + written


def _read_at(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        received = os.preadv(fd, [view], offset)
        if not received:
            raise EOFError(f"file ends at {offset}")
        view, offset = view[received:], offset + received


# -- our daemon ---------------------------------------------------------------------------------------


class KVStoreDaemon(Contender):
    """One kvstore-server; blocks of a 32-layer layout, every read verified by the client.

    "kvstore" reads as a remote client would (the raw-TCP data channel); "kvstore (grpc)" through gRPC
    only; "kvstore (shm)" into a shared buffer the daemon writes into directly (same host only)."""

    def __init__(self, path: str = "tcp", hot_tier_bytes: int = 512 * 2**20) -> None:
        self.path = path
        self.name = "kvstore" if path == "tcp" else f"kvstore ({path})"
        self.hot_tier_bytes = hot_tier_bytes

    def start(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
        self.daemon = DaemonProcess(self.workdir / "data", self.workdir,
                                    ["--hot-tier-bytes", str(self.hot_tier_bytes), "--max-block-bytes", "64MiB",
                                     "--max-message-bytes", "64MiB", "--capacity-bytes", "64GiB"]).start()
        self.client = KVClient(ClientConfig((self.daemon.address,), transport="grpc" if self.path == "grpc" else "auto",
                                            shared_memory="on" if self.path == "shm" else "off", timeout_s=60,
                                            max_message_bytes=80 * 2**20))

    def memory(self, nbytes: int) -> memoryview | None:
        return self.client.shared_buffer(nbytes) if self.path == "shm" else None

    def stop(self) -> None:
        self.client.close()
        self.daemon.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def prepare(self, size: int, names: int) -> None:
        layers = 32
        tokens = max(1, size // (layers * 2 * 8 * 128 * 2))  # bf16, 8 KV heads x 128: 128 KiB per token
        self.namespace = Namespace("bench", KVLayout(layers, 8, 128, "bfloat16"), tokens)
        assert self.namespace.block_bytes == size, f"{size} is not a whole number of tokens of this layout"
        # Name i is block i of one long prompt, so a batch of names is a prefix read, as an engine does.
        self.blocks = self.namespace.blocks(range(names * tokens))

    def put(self, name: int, data: bytes) -> None:
        summary = self.client.put([(self.blocks[name], data)], self.namespace.num_layers)
        assert summary.stored == 1, summary

    def put_many(self, names: list[int], data: bytes) -> None:  # one call, as an engine puts a prompt's blocks
        summary = self.client.put([(self.blocks[n], data) for n in names], self.namespace.num_layers)
        assert summary.stored == len(names), summary

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.daemon.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return time.process_time() + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def get(self, name: int, buf: memoryview) -> None:
        assert len(self.client.get([self.blocks[name]], into=[buf])) == 1

    def get_many(self, names: list[int], bufs: list[memoryview]) -> None:
        got = self.client.get([self.blocks[n] for n in names], into=bufs)
        assert len(got) == len(names), len(got)

    def clear(self, names: list[int]) -> None:
        self.client.delete([self.blocks[n] for n in names])


# -- Redis ----------------------------------------------------------------------------------------------


class Redis(Contender):
    name = "Redis"

    def start(self) -> None:
        import redis
        if not shutil.which("redis-server"):
            raise RuntimeError("redis-server is not installed; run bench/setup_peers.sh")
        self.workdir = Path(tempfile.mkdtemp(prefix="redis-bench-"))
        port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(port)
        self.client = redis.Redis(host="127.0.0.1", port=port)

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def prepare(self, size: int, names: int) -> None:
        self.prefix = f"{size}-"

    def put(self, name: int, data: bytes) -> None:
        self.client.set(f"{self.prefix}{name}", data)

    def get(self, name: int, buf: memoryview) -> None:
        assert len(self.client.get(f"{self.prefix}{name}")) == len(buf)

    def get_many(self, names: list[int], bufs: list[memoryview]) -> None:
        values = self.client.mget([f"{self.prefix}{n}" for n in names])
        assert all(v is not None for v in values)

    def clear(self, names: list[int]) -> None:
        self.client.flushall()


# -- Mooncake Store -----------------------------------------------------------------------------------


class Mooncake(Contender):
    """mooncake_master + a mooncake_client storage process; this process is a pure client over TCP."""
    name = "Mooncake"

    def __init__(self, max_size: int, batch: int, warm: bool = False) -> None:
        self.max_size, self.batch = max_size, batch
        # warm: its storage process's memory is touched once before the puts that are timed (a pass of puts
        # of its own, then removed), as a store that has run a while has it; else its puts meet fresh memory.
        self.warm = warm
        if warm:
            self.name = "Mooncake (warm)"

    def start(self) -> None:
        for lib in ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1"):  # unpacked, not installed
            if (PEER_LIBS / lib).exists():
                ctypes.CDLL(str(PEER_LIBS / lib), mode=ctypes.RTLD_GLOBAL)
        from mooncake.store import MooncakeDistributedStore
        bin_dir = Path(shutil.which("mooncake_master") or (ROOT / ".venv" / "bin" / "mooncake_master")).parent
        env = {**os.environ, "LD_LIBRARY_PATH": f"{PEER_LIBS}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        master_port, store_port = free_port(), free_port()
        self.procs = [subprocess.Popen([str(bin_dir / "mooncake_master"), f"--rpc_port={master_port}",
                                        f"--metrics_port={free_port()}"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)]
        wait_for_port(master_port)
        self.procs.append(subprocess.Popen(
            [str(bin_dir / "mooncake_client"), f"--master_server_address=127.0.0.1:{master_port}",
             "--metadata_server=P2PHANDSHAKE", "--protocol=tcp", "--host=127.0.0.1", f"--port={store_port}",
             "--global_segment_size=6 GB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        wait_for_port(store_port)
        time.sleep(1.0)  # the storage process mounts its segment with the master
        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 2 * self.max_size * self.batch, "tcp", "",
                              f"127.0.0.1:{master_port}")
        if rc != 0:
            raise RuntimeError(f"Mooncake setup failed with {rc}")
        self.registered: set[int] = set()

    def stop(self) -> None:
        self.store.close()
        for proc in reversed(self.procs):
            proc.terminate()
            proc.wait(timeout=10)

    def _address(self, buf: memoryview) -> int:
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        return address

    def register(self, whole: memoryview) -> None:
        address = self._address(whole)
        if address not in self.registered:
            assert self.store.register_buffer(address, len(whole)) == 0
            self.registered.add(address)

    def prepare(self, size: int, names: int) -> None:
        self.prefix = f"{size}-"  # names of one size never meet another size's (removal waits for leases)
        if self.warm:
            block = bytes(size)
            for name in range(names):
                assert self.store.put(f"warm-{size}-{name}", block) == 0
            self.store.remove_all()

    def put(self, name: int, data: bytes) -> None:
        assert self.store.put(f"{self.prefix}{name}", data) == 0

    def get(self, name: int, buf: memoryview) -> None:  # plain get: returns new bytes
        assert len(self.store.get(f"{self.prefix}{name}")) == len(buf)

    def get_many(self, names: list[int], bufs: list[memoryview]) -> None:  # zero-copy batch_get_into
        sizes = self.store.batch_get_into([f"{self.prefix}{n}" for n in names], [self._address(b) for b in bufs],
                                          [len(b) for b in bufs])
        assert all(s == len(b) for s, b in zip(sizes, bufs)), sizes

    def clear(self, names: list[int]) -> None:
        self.store.remove_all()
