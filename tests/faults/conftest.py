"""Helpers of the fault campaign: blocks with known bytes, an unverifying reader, the daemon's own counts.

The oracle reads through raw gRPC, not through KVClient: the client verifies what it receives and would
turn a wrong block served by the daemon into a quiet miss, hiding the very fault these tests look for.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import grpc

from kvstore import wire
from kvstore.block import Block, KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.proto import method, pb
from kvstore.server.process import DaemonProcess
from kvstore.stats import Stats

NS = Namespace("fault-campaign", KVLayout(num_layers=4, kv_heads=2, head_dim=32, dtype="float16"), block_tokens=16)
Item = tuple[Block, bytes]  # a block and its layer-major payload, (layers, 2, block_tokens, kv_heads, head_dim)


def items(seed: int, n: int = 1) -> list[Item]:
    """The n (<= 256) blocks of prompt `seed` (distinct seeds never share a block) with fresh random payloads."""
    start = seed * 4096  # room for 256 blocks a prompt; token ids stay below 2**32 for a million seeds
    return [(block, os.urandom(NS.block_bytes)) for block in NS.blocks(range(start, start + n * NS.block_tokens))]


def client_for(daemon: DaemonProcess, transport: str = "auto") -> KVClient:
    """A client that gives up on a dead daemon quickly and probes it again soon."""
    return KVClient(ClientConfig((daemon.address,), timeout_s=3, lookup_timeout_s=2, down_backoff_s=0.05,
                                 max_down_backoff_s=0.2, transport=transport))


@dataclass(frozen=True, slots=True)
class Served:
    status: int  # pb.PartStatus
    payload: bytes | None  # the whole block's payload when status is OK
    cause: str = ""


def raw_get(address: str, keys: list[bytes], timeout_s: float = 30.0) -> list[Served]:
    """What the daemon serves for each key (all layers, block-major, not stopping at a miss), unverified."""
    options = [("grpc.max_receive_message_length", 64 * 2**20), ("grpc.max_send_message_length", 64 * 2**20)]
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_stream(method("Get"), pb.GetRequest.SerializeToString, None)
        served: dict[int, Served] = {}
        pending: pb.GetPartHead | None = None
        for message in call(pb.GetRequest(keys=keys, stop_at_miss=False), timeout=timeout_s):
            if pending is not None:
                served[pending.index] = Served(pb.OK, bytes(message))
                pending = None
                continue
            head = pb.GetPartHead.FromString(message)
            if head.status == pb.OK and head.payload_bytes:
                pending = head
            else:
                served[head.index] = Served(head.status, None, head.cause)
    assert sorted(served) == list(range(len(keys))), "the daemon must answer every key of a Get exactly once"
    return [served[i] for i in range(len(keys))]


def wrong_blocks(address: str, expected: dict[bytes, bytes]) -> list[str]:
    """Keys (hex) the daemon served with bytes other than those put; misses are allowed."""
    keys = list(expected)
    return [key.hex() for key, got in zip(keys, raw_get(address, keys))
            if got.status == pb.OK and got.payload != expected[key]]


def stats(address: str) -> Stats:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method("Stats"), pb.StatsRequest.SerializeToString, pb.StatsResponse.FromString)
        return Stats.from_pb(call(pb.StatsRequest(), timeout=10))


def misses_counted(address: str) -> int:
    """Every block the daemon has refused to serve since it started, whatever the cause."""
    return int(stats(address).value("kvstore_misses_total"))


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """One data-channel frame's kind and head, read off a raw socket; ConnectionError if it closes first."""
    kind, head_len = wire.parse_prefix(recv_exact(sock, wire.PREFIX.size))
    return kind, recv_exact(sock, head_len)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        data += chunk
    return data
