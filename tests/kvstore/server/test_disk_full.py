"""A disk smaller than capacity_bytes: the budget becomes the file system's, puts that meet a full disk are
refused precisely (RESOURCE_EXHAUSTED), and gets go on. (tests/faults/test_disk_full.py fills the disk
from outside the daemon, which is how puts meet ENOSPC once the daemon knows the file system's size.)"""

import os
import subprocess

import grpc
import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import KVClient
from kvstore.proto import method, pb
from kvstore.record import build_record
from kvstore.server.process import DaemonProcess
from tests.clean_stop import stop_clean

pytestmark = pytest.mark.integration

NS = Namespace("disk-full", KVLayout(num_layers=4, kv_heads=2, head_dim=64, dtype="float16"), block_tokens=128)


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs made for the test (needs root, as in CI)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_small_disk_is_the_budget_puts_fail_precisely_if_at_all_and_gets_go_on(tmp_path, small_fs):
    daemon = DaemonProcess(small_fs / "data", tmp_path, ["--segment-bytes", "1MiB", "--capacity-bytes", "1GiB",
                                                   "--lmdb-map-bytes", "1MiB"]).start()
    try:
        blocks = NS.blocks(range(40 * NS.block_tokens))  # 40 x 256 KiB = 10 MiB > 8 MiB
        payloads = [os.urandom(NS.block_bytes) for _ in blocks]
        codes = []
        with grpc.insecure_channel(daemon.address) as channel:
            put = channel.stream_unary(method("Put"), None, pb.PutResponse.FromString)
            for block, payload in zip(blocks, payloads):
                header, body = build_record(block, payload, NS.num_layers, "chat")
                try:
                    put(iter([pb.PutHead(record_bytes=len(header) + len(body)).SerializeToString(), header, body]),
                        timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        stored = [i for i, code in enumerate(codes) if code == grpc.StatusCode.OK]
        with KVClient([daemon.address]) as client:
            readable = 0
            for i in stored:
                got = client.get([blocks[i]])
                if got:
                    assert got[0].payload == payloads[i]
                    readable += 1
            assert readable >= len(stored) // 2, "gets go on after the disk filled"
            stats = client.server_stats()[daemon.address]
            # The daemon learned the disk's real size (a full disk, or its first maintenance pass): its
            # capacity fits the file system, and it evicted to stay in it.
            assert stats.value("kvstore_capacity_bytes") <= 8 * 2**20
            assert stats.value("kvstore_evictions_total") >= 1
        assert daemon.proc.poll() is None
    finally:
        problems = stop_clean(daemon)
    assert not problems, "\n".join(problems)
