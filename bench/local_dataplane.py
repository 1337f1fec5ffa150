"""Same-host Get through shared memory beside raw pread of the same segment bytes and a plain memcpy.

    python bench/local_dataplane.py [--block-mib 4] [--blocks 64] [--repeats 7] [--json out.json]

One daemon with its DRAM tier off, so every Get reads the segment files (from the page cache, which an
untimed `pread` fills before them) straight into the destination buffers, which the client has lent the daemon
(`KVClient.shared_buffer`); the client verifies every layer in place. The limits, in the same run: `pread`
of exactly the same payload ranges from the same segment files into the same buffers (no daemon, no
checks), and a memcpy of the same bytes from memory. Also the same Get over the loopback socket.

Cold: the same Get with the segment files dropped from the page cache before each repeat (fsync, then
POSIX_FADV_DONTNEED), beside an O_DIRECT read of the same payload ranges in the same order (each rounded out
to 4 KiB, into one reused aligned buffer): `cold_get_vs_odirect`, the device's own limit. The daemon reads what the page
cache lacks with O_DIRECT too (kvstore/server/segments.py).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.block import KVLayout, Namespace  # noqa: E402
from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402
from kvstore.server.segments import SegmentSet  # noqa: E402

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and memory


def record_ranges(data_dir: Path, keys: list[bytes]) -> list[tuple[Path, int, int]]:
    """(segment file, payload offset, payload length) of each stored block, read from the segments, in the
    order of `keys`: the order the Gets read them in (a client puts a prompt's blocks leaf first, so in the
    files they lie back to front)."""
    segments = SegmentSet(data_dir / "segments", 1 << 40, fsync=False)
    segments.open_existing()
    found: dict[bytes, tuple[Path, int, int]] = {}
    try:
        for segment in segments.segments.values():
            for offset, header in segments.scan(segment):
                found[header.key] = (segment.path, offset + header.header_len, header.payload_len)
    finally:
        for segment in segments.segments.values():
            os.close(segment.fd)
    return [found[key] for key in keys]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-mib", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="blocks per Get")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    layers = 32
    tokens = args.block_mib * 2**20 // (layers * 2 * 8 * 128 * 2)
    namespace = Namespace("bench-local", KVLayout(layers, 8, 128, "bfloat16"), tokens)
    size = namespace.block_bytes
    blocks = namespace.blocks(range(args.blocks * tokens))
    payload = os.urandom(size)
    source = bytearray(payload)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-local-bench-"))
    daemon = DaemonProcess(workdir / "data", workdir, ["--hot-tier-bytes", "0", "--max-block-bytes", "64MiB"])
    rates: dict[str, list[float]] = {name: [] for name in ("odirect", "cold_shm_get", "shm_get", "socket_get",
                                                           "pread", "memcpy")}
    buffers: list[memoryview] = []
    try:
        daemon.start()
        with KVClient(ClientConfig((daemon.address,), timeout_s=60)) as shm_client, \
                KVClient(ClientConfig((daemon.address,), shared_memory="off", timeout_s=60)) as socket_client:
            assert shm_client.put([(b, payload) for b in blocks], layers).stored == len(blocks)
            # Pre-touched destinations, the same for every contender: memory lent to the daemon, so that
            # it can write into them (for the others it is ordinary memory).
            shared = shm_client.shared_buffer(len(blocks) * size)
            buffers = [shared[i * size : (i + 1) * size] for i in range(len(blocks))]
            ranges = record_ranges(daemon.data_dir, [b.key for b in blocks])
            files = {path: os.open(path, os.O_RDONLY) for path, _, _ in ranges}
            total = len(blocks) * size

            def get(client: KVClient) -> None:
                for start in range(0, len(blocks), args.batch):
                    got = client.get(blocks[start : start + args.batch], into=buffers[start : start + args.batch])
                    assert len(got) == len(blocks[start : start + args.batch])

            def pread() -> None:
                for (path, offset, length), buffer in zip(ranges, buffers):
                    assert os.preadv(files[path], [buffer], offset) == length

            def memcpy() -> None:
                for buffer in buffers:
                    buffer[:] = source

            direct = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for path in files}
            staging = mmap.mmap(-1, size + 2 * ALIGN)  # page-aligned, as O_DIRECT needs
            staging[:] = b"\x01" * len(staging)

            def odirect() -> None:
                for path, offset, length in ranges:
                    begin, end = offset // ALIGN * ALIGN, -(-(offset + length) // ALIGN) * ALIGN
                    assert os.preadv(direct[path], [memoryview(staging)[: end - begin]], begin) >= length

            def uncached() -> None:
                for fd in files.values():
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

            # The cold pair first. The daemon reads what the page cache lacks with O_DIRECT, which leaves the
            # page cache as it was: an untimed pread reads the files back in for the warm contenders.
            contenders = {"odirect": odirect, "cold_shm_get": lambda: get(shm_client), "pread": pread,
                          "shm_get": lambda: get(shm_client), "socket_get": lambda: get(socket_client),
                          "memcpy": memcpy}
            cold = {"cold_shm_get", "odirect"}
            for fn in contenders.values():  # warm-up: connections, regions, page cache
                fn()
            for _ in range(args.repeats):  # interleaved, so drift in the machine's speed hits all alike
                for name, fn in contenders.items():
                    if name in cold:
                        uncached()
                    elif name == "pread":  # untimed: back into the page cache, so that every warm read finds it
                        pread()
                    started = time.perf_counter()
                    fn()
                    rates[name].append(total / (time.perf_counter() - started) / 1e9)
            assert all(bytes(b) == payload for b in buffers)
            del buffers[:]
            region_bytes = shm_client.server_stats()[daemon.address].value("kvstore_region_read_bytes_total")
            assert region_bytes >= total, "the shared-memory path was not used"
            for fd in [*files.values(), *direct.values()]:
                os.close(fd)
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(f"\n{args.blocks} blocks of {args.block_mib} MiB, Gets of {args.batch}, {args.repeats} interleaved repeats")
    print(f"{'path':>12} {'GB/s median':>12} {'[min - max]':>16}")
    for name, values in rates.items():
        print(f"{name:>12} {medians[name]:>12.2f} {f'[{min(values):.2f} - {max(values):.2f}]':>16}")
    report = {"GBps": medians, "all_GBps": rates,
              "shm_get_vs_pread": medians["shm_get"] / medians["pread"],
              "shm_get_vs_memcpy": medians["shm_get"] / medians["memcpy"],
              "shm_get_vs_socket_get": medians["shm_get"] / medians["socket_get"],
              "cold_get_vs_odirect": medians["cold_shm_get"] / medians["odirect"]}
    print(f"\nshm_get_vs_pread = {report['shm_get_vs_pread']:.2f}   shm_get_vs_memcpy = "
          f"{report['shm_get_vs_memcpy']:.2f}   shm_get_vs_socket_get = {report['shm_get_vs_socket_get']:.2f}   "
          f"cold_get_vs_odirect = {report['cold_get_vs_odirect']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
