"""A tenant's payload holding what looks like records, and a crash while it is unfinished.

A record written as it arrives has its payload on disk before its header, so a kill -9 can leave a tenant's
bytes in a segment with no record around them. Whatever they hold (whole, well-formed records of another
tenant's keys; bare headers declaring huge lengths), no scan may take them for records: not the recovery of
the open segment, not a rebuild of a lost index, not `kvstore fsck --rebuild` (kvstore/server/frames.py).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import wire
from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.proto import pb
from kvstore.record import build_record, encode_header
from tests.waiting import wait_for

from .conftest import raw_get

pytestmark = [pytest.mark.crash, pytest.mark.kills_daemons]

LAYOUT = KVLayout(num_layers=4, kv_heads=8, head_dim=128, dtype="float16")  # 2 MiB records of 512 KiB layers
ATTACKER = Namespace("forged", LAYOUT, block_tokens=128, salt="mallory")
VICTIM = Namespace("forged", LAYOUT, block_tokens=128, salt="bob")  # a salt an attacker can guess
DIRECT = ("--direct-io-min-bytes", "64KiB", "--max-block-bytes", "4MiB", "--durability", "fsync")
PROMPT = range(10 * 128)  # a prompt both tenants send


def hostile_payload(embedded: bytes) -> bytes:
    """An attacker's payload of ATTACKER's layout that starts with `embedded`, then random bytes."""
    assert len(embedded) <= ATTACKER.block_bytes
    return embedded + os.urandom(ATTACKER.block_bytes - len(embedded))


def forged_records(blocks, fill: int) -> bytes:
    """Whole, well-formed records of `blocks` (the victim's; 16 KiB payloads of byte `fill`), each at a 4 KiB
    boundary, as a scan that resyncs would meet them."""
    out = b""
    for block in blocks:
        header, payload = build_record(block, bytes([fill]) * 16384, 4, "chat")
        record = header + payload
        out += record + bytes(-len(record) % 4096)
    return out


def stall_a_put(daemon, payload: bytes, layers_sent: int) -> socket.socket:
    """Start a put of ATTACKER's next block on the data channel, send its first `layers_sent` layers and stop,
    the connection left open. Returns once the daemon has written them to its segment file."""
    block = ATTACKER.blocks(range(90_000, 90_000 + 128))[0]
    header, payload = build_record(block, payload, ATTACKER.num_layers, "chat")
    head = pb.PutHead(record_bytes=len(header) + len(payload)).SerializeToString()
    sock = socket.create_connection(("127.0.0.1", daemon.data_port), timeout=30)
    sent = payload[: layers_sent * ATTACKER.layer_bytes]
    sock.sendall(wire.frame(wire.PUT, head) + header + sent)
    marker = sent[:64]
    wait_for(lambda: any(marker in path.read_bytes() for path in segment_files(daemon.data_dir)),
             "the stalled put's verified layers written to its place")
    return sock


def segment_files(data_dir: Path) -> list[Path]:
    return [p for p in (data_dir / "segments").iterdir() if p.suffix in (".open", ".sealed")]


def put_blocks(daemon, namespace: Namespace, tokens, fill: int | None = None) -> dict[bytes, bytes]:
    """Put the blocks of `tokens` through the client; key -> payload."""
    stored = {}
    with KVClient(ClientConfig((daemon.address,), shared_memory="off")) as client:
        for block in namespace.blocks(tokens):
            payload = os.urandom(namespace.block_bytes) if fill is None else bytes([fill]) * namespace.block_bytes
            assert client.put([(block, payload)], namespace.num_layers).stored == 1
            stored[block.key] = payload
    return stored


def served(daemon, keys: list[bytes]) -> dict[bytes, bytes]:
    """key -> payload of each key the daemon serves (unverified: raw gRPC)."""
    return {key: got.payload for key, got in zip(keys, raw_get(daemon.address, keys)) if got.status == pb.OK}


@pytest.mark.parametrize("rebuild", ["index lost", "fsck --rebuild"])
def test_records_forged_inside_an_unfinished_put_are_never_served_after_a_crash(daemons, rebuild):
    daemon, = daemons(1, *DIRECT)
    victim = put_blocks(daemon, VICTIM, PROMPT[: 2 * 128])
    forged = forged_records(VICTIM.blocks(PROMPT[: 4 * 128]), fill=0xAA)  # two it holds, two it has not yet put
    with stall_a_put(daemon, hostile_payload(forged), layers_sent=3):
        daemon.kill()
    if rebuild == "index lost":
        shutil.rmtree(daemon.data_dir / "index")
    else:
        subprocess.run([sys.executable, "-m", "kvstore.cli", "fsck", "--rebuild", str(daemon.data_dir)], check=True,
                       capture_output=True, timeout=120)
    daemon.start()
    keys = [block.key for block in VICTIM.blocks(PROMPT[: 4 * 128])]
    assert served(daemon, keys) == victim, "the victim's own blocks, byte for byte, and nothing forged"


def test_bare_headers_inside_an_unfinished_put_cost_no_other_tenant_an_acknowledged_block(daemons):
    daemon, = daemons(1, *DIRECT)
    attacker_blocks = ATTACKER.blocks(range(50 * 128, 114 * 128))  # the attacker's own keys: nothing checks them
    # lengths of 16 MiB down to 256 KiB: whatever the segment holds after the place, one of them ends inside it,
    # as far as it can
    bare = b"".join(encode_header(block, "chat", 4, (64 - k) * 2**16, [0] * 4)
                    for k, block in enumerate(attacker_blocks))
    with stall_a_put(daemon, hostile_payload(bare), layers_sent=2):
        victim = put_blocks(daemon, VICTIM, PROMPT[: 6 * 128])  # appended after the stalled put's place
        small = Namespace("forged-small", KVLayout(num_layers=2, kv_heads=1, head_dim=16, dtype="float16"),
                          block_tokens=16, salt="bob")
        victim |= put_blocks(daemon, small, range(24 * 16))  # buffered appends too
        daemon.kill()
    daemon.start()
    assert served(daemon, list(victim)) == victim, "every acknowledged block of the victim is served after the crash"


def test_fsck_names_an_indexed_record_that_a_scan_of_its_segment_walks_past(daemons):
    # The index is not the only copy of what the segments hold: a rebuild (a lost index, fsck --rebuild) finds
    # records by scanning. A record whole and framed where the index says, but hidden from the scan (here by a
    # reservation forged with the daemon's own key, standing for a bug of the daemon's), is one only the index
    # knows: fsck says so before a rebuild would lose it.
    from kvstore.server.frames import FRAME_BYTES, Frames
    from kvstore.server.segments import Segment, scan, segment_files

    (daemon,) = daemons(1, *DIRECT)
    blocks = VICTIM.blocks(PROMPT)[:2]
    with KVClient(ClientConfig(servers=(daemon.address,))) as client:
        client.put([(block, os.urandom(VICTIM.block_bytes)) for block in blocks], VICTIM.num_layers)
        assert client.write_behind.flush()
    daemon.stop()
    clean = subprocess.run([sys.executable, "-m", "kvstore.cli", "fsck", "--no-payload", str(daemon.data_dir)],
                           capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    segments_dir = daemon.data_dir / "segments"
    frames = Frames.of_directory(segments_dir, may_create=False)
    path, seg_id, _ = next(entry for entry in segment_files(segments_dir) if entry[0].stat().st_size)
    with open(path, "r+b") as f:
        segment = Segment(seg_id, 0, path, f.fileno(), os.fstat(f.fileno()).st_size, sealed=True)
        (first, first_header), (second, second_header) = list(scan(segment, frames))[:2]
        at = first + first_header.record_len  # the zeros that pad the first record to its last page
        assert second - FRAME_BYTES - at >= FRAME_BYTES, "room for a frame before the second record's"
        f.seek(at)
        f.write(frames.reserved(seg_id, at, second + 64 - at))  # a place spanning the second record's frame
    found = subprocess.run([sys.executable, "-m", "kvstore.cli", "fsck", "--no-payload", str(daemon.data_dir)],
                           capture_output=True, text=True, timeout=120)
    assert found.returncode != 0
    assert f"{second_header.key.hex()}: a scan of segment {seg_id} does not find its record at {second}" in found.stdout
    assert first_header.key.hex() not in found.stdout
