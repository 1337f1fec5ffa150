"""One Put path for both transports (put_stream.py): the same records give the same outcome over gRPC and
over the data channel, including a stream that breaks after a record that arrived whole."""

from __future__ import annotations

import os
import socket

import grpc
import pytest

from kvstore import wire
from kvstore.block import KVLayout, Namespace
from kvstore.proto import method, pb
from kvstore.record import build_record
from tests.faults.conftest import raw_get, read_frame

pytestmark = pytest.mark.integration

NS = Namespace("put-stream", KVLayout(num_layers=4, kv_heads=2, head_dim=32, dtype="float16"), block_tokens=16)
Record = tuple[bytes, bytes, bytes]  # (key, header, payload)


def records(seed: int, n: int) -> list[Record]:
    blocks = NS.blocks(range(seed * 4096, seed * 4096 + n * NS.block_tokens))
    return [(b.key, *build_record(b, os.urandom(NS.block_bytes), NS.num_layers, "chat")) for b in blocks]


def head(nbytes: int) -> bytes:
    return pb.PutHead(record_bytes=nbytes).SerializeToString()


def put_grpc(daemon, stream: list[Record]) -> tuple[str, str]:
    """(status code name, details or the stored count) of one gRPC Put stream of these records."""
    def messages():
        for _, header, payload in stream:
            yield head(len(header) + len(payload))
            yield header
            yield payload[: len(payload) // 2]  # chunks of any size
            yield payload[len(payload) // 2 :]

    with grpc.insecure_channel(daemon.address) as channel:
        call = channel.stream_unary(method("Put"), None, pb.PutResponse.FromString)
        try:
            response = call(messages(), timeout=30)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()
    return "OK", str(sum(r == pb.STORED for r in response.results))


def put_data(daemon, stream: list[Record]) -> tuple[str, str]:
    """The same over the data channel: PUT frames, the record's bytes, PUT_END."""
    with socket.create_connection(("127.0.0.1", daemon.data_port), timeout=30) as sock:
        try:
            for _, header, payload in stream:
                sock.sendall(wire.frame(wire.PUT, head(len(header) + len(payload))) + header + payload)
            sock.sendall(wire.frame(wire.PUT_END))
        except OSError:
            pass  # refused mid-stream: its ERROR frame says why
        kind, body = read_frame(sock)
    if kind == wire.ERROR:
        error = pb.DataError.FromString(body)
        return error.code, error.message
    return "OK", str(sum(r == pb.STORED for r in pb.PutResponse.FromString(body).results))


TRANSPORTS = {"grpc": put_grpc, "data channel": put_data}


def corrupted(record: Record) -> Record:
    key, header, payload = record
    return key, header, payload[:-1] + bytes([payload[-1] ^ 1])


def foreign_class(record: Record) -> Record:
    """The record's header re-encoded with a traffic class the daemon does not know."""
    _, _, payload = record
    block = NS.blocks(range(9_000_000, 9_000_000 + NS.block_tokens))[0]
    header, _ = build_record(block, payload, NS.num_layers, "no-such-class")
    return block.key, header, payload


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_good_stream_is_stored_whole_on_either_transport(daemons, transport):
    daemon, = daemons(1)
    stream = records(seed=1 + len(transport), n=3)
    assert TRANSPORTS[transport](daemon, stream) == ("OK", "3")
    assert [s.payload for s in raw_get(daemon.address, [k for k, _, _ in stream])] == [p for _, _, p in stream]


def test_both_transports_refuse_a_bad_record_alike_and_keep_the_records_before_it(daemons):
    daemon, = daemons(1)
    outcomes = {}
    for seed, (transport, put) in enumerate(TRANSPORTS.items(), start=10):
        first, second = records(seed, 2)
        for breakage, bad in (("checksum", corrupted(second)), ("class", foreign_class(second))):
            code, message = put(daemon, [first, bad])
            outcomes.setdefault(breakage, {})[transport] = (code, message)
            served = raw_get(daemon.address, [first[0], bad[0]])  # at once: the error came after the store
            assert served[0].payload == first[2], "a record that arrived whole is stored before the error is sent"
            assert served[1].status != pb.OK, "a record that failed verification is not stored"
    for breakage, by_transport in outcomes.items():
        assert set(by_transport.values()) == {next(iter(by_transport.values()))}, (breakage, by_transport)
        code, _ = by_transport["grpc"]
        assert code == "INVALID_ARGUMENT", (breakage, by_transport)
    assert "checksums" in outcomes["checksum"]["grpc"][1]
    assert "no-such-class" in outcomes["class"]["grpc"][1]
