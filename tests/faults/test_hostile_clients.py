"""Hostile gRPC clients against one daemon while a well-behaved client keeps using it.

Every RPC gets malformed protobufs, messages over the size limit, too many keys and keys of the wrong
length; Put streams lie about sizes, end early, or carry records whose header does not hash to its key;
one Get asks for 65,536 keys. Each gets a precise status code (or, for the big Get, a precise answer per
key), and the steady client sees every one of its blocks served byte for byte throughout.
tests/kvstore/server/test_service.py checks single cases on a fresh daemon; here the whole matrix runs
against one daemon under load, which is what a daemon in production faces.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import xxhash

from kvstore.block import Block, KVLayout, Namespace
from kvstore.client import KVClient
from kvstore.client.config import ClientConfig
from kvstore.proto import SERVICE, method, pb
from kvstore.record import build_record, encode_header
from kvstore.server.process import DaemonProcess

from .conftest import NS, client_for, items, raw_get

pytestmark = pytest.mark.crash

CODE = grpc.StatusCode
MAX_MESSAGE = 2 * 2**20  # the daemon's --max-message-bytes: a request of 65,537 keys (1.2 MB) fits under it
MAX_KEYS = 65536  # the daemon's default max_keys_per_request
KEYED = ["Lookup", "Touch", "Delete", "Advise", "Get"]
UNARY_TYPES = {"Lookup": pb.LookupRequest, "Touch": pb.KeysRequest, "Delete": pb.KeysRequest,
               "Advise": pb.AdviseRequest, "Stats": pb.StatsRequest, "Info": pb.InfoRequest, "Get": pb.GetRequest}
# 1 MiB blocks: a Get of eight is a stream long enough for a client to leave in the middle of
BIG = Namespace("hostile-big", KVLayout(num_layers=8, kv_heads=4, head_dim=128, dtype="float16"), block_tokens=64)
NOT_PROTOBUF = {
    "invalid wire type": b"\x0f\x01",
    "truncated varint": b"\x08\xff",
    "truncated field": b"\x0a\x05abc",
    "length past the end": b"\x0a\xff\xff\xff\xff\x0f",
    "random bytes": b"\xff\xfe\xfd garbage \x00\x01",
}


class SteadyClient:
    """Puts, looks up and reads back its own prompts in a loop; remembers anything that went wrong."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.rounds = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    _seeds = itertools.count(1_000_000)  # one for the module's clients, clear of the tests' own: new blocks each round

    def _run(self) -> None:
        # Deadlines far past any answer's time: a slow answer beside a 65,536-key Get is no failure of the
        # daemon, and a 2 s deadline made it one on a loaded machine. A wrong or missing answer still is.
        config = ClientConfig((self.daemon.address,), timeout_s=120, lookup_timeout_s=120, transport="grpc")
        with KVClient(config) as client:
            while not self._stop.is_set():
                prompt = items(next(self._seeds), 3)
                blocks = [block for block, _ in prompt]
                summary = client.put(prompt, NS.num_layers)
                if summary.stored != len(prompt):
                    self.failures.append(f"round {self.rounds}: put {summary}, {client.last_errors()}")
                elif client.lookup(blocks) != len(blocks):
                    self.failures.append(f"round {self.rounds}: lookup short, {client.last_errors()}")
                elif [bytes(got.payload) for got in client.get(blocks)] != [payload for _, payload in prompt]:
                    self.failures.append(f"round {self.rounds}: get short or wrong, {client.last_errors()}")
                self.rounds += 1

    def assert_served_throughout(self) -> None:
        """No failure so far, and it completes another round from now (the daemon still serves)."""
        target = self.rounds + 2
        deadline = time.monotonic() + 60  # liveness only: generous, not a timing assertion
        while self.rounds < target and not self.failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not self.failures, self.failures[:3]
        assert self.rounds >= target, "the well-behaved client stopped making progress"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    daemon = DaemonProcess(base / "data", base, ["--max-message-bytes", str(MAX_MESSAGE), "--max-block-bytes",
                                                 "1MiB", "--max-inflight-put-bytes", "8MiB"])
    daemon.start()
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-3000:]
    assert "Traceback" not in daemon.log(), daemon.log()[-3000:]


@pytest.fixture
def steady(daemon):
    """A well-behaved client of each test's own: what went wrong during one test is that test's failure."""
    client = SteadyClient(daemon)
    yield client
    client.stop()
    assert not client.failures, client.failures[:3]


@pytest.fixture(scope="module")
def channel(daemon):
    options = [("grpc.max_send_message_length", 64 * 2**20), ("grpc.max_receive_message_length", 64 * 2**20)]
    with grpc.insecure_channel(daemon.address, options=options) as ch:
        yield ch


def call_raw(channel: grpc.Channel, name: str, messages: list[bytes], timeout: float = 30) -> object:
    """Send raw bytes to an RPC as they are; the answer (unary, Put) or every message (Get)."""
    if name == "Get":
        return list(channel.unary_stream(method(name), None, None)(messages[0], timeout=timeout))
    if name == "Put":
        return channel.stream_unary(method(name), None, None)(iter(messages), timeout=timeout)
    return channel.unary_unary(method(name), None, None)(messages[0], timeout=timeout)


def assert_rejected(channel: grpc.Channel, name: str, messages: list[bytes], code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call_raw(channel, name, messages)
    assert info.value.code() == code, f"{name}: {info.value.code()} {info.value.details()}"
    assert info.value.details(), "a rejection must say why"
    return info.value.details()


def keys_request(name: str, keys: list[bytes]) -> bytes:
    if name == "Get":
        return pb.GetRequest(keys=keys).SerializeToString()
    if name == "Advise":
        return pb.AdviseRequest(keys=keys, continues=True).SerializeToString()
    return UNARY_TYPES[name](keys=keys).SerializeToString()


def good_key() -> bytes:
    return os.urandom(16)


# -- malformed, oversized, too many keys, wrong key lengths --------------------------------------------


@pytest.mark.parametrize("malformation", list(NOT_PROTOBUF))
@pytest.mark.parametrize("name", list(UNARY_TYPES) + ["Put"])
def test_malformed_protobuf_on_every_rpc_is_invalid_argument(channel, steady, name, malformation):
    assert_rejected(channel, name, [NOT_PROTOBUF[malformation]], CODE.INVALID_ARGUMENT)
    steady.assert_served_throughout()


@pytest.mark.parametrize("name", list(UNARY_TYPES) + ["Put"])
def test_a_message_over_the_size_limit_on_every_rpc_is_resource_exhausted(channel, steady, name):
    padding = os.urandom(MAX_MESSAGE + 1)
    # An unknown field of a legal message: only its size is wrong.
    oversized = b"\xfa\x3f" + _varint(len(padding)) + padding  # field 1023, length-delimited
    assert_rejected(channel, name, [oversized], CODE.RESOURCE_EXHAUSTED)
    steady.assert_served_throughout()


@pytest.mark.parametrize("name", KEYED)
def test_one_key_more_than_the_limit_is_invalid_argument(channel, steady, name):
    details = assert_rejected(channel, name, [keys_request(name, [good_key() for _ in range(MAX_KEYS + 1)])],
                              CODE.INVALID_ARGUMENT)
    assert str(MAX_KEYS) in details
    steady.assert_served_throughout()


@pytest.mark.parametrize("length", [0, 1, 15, 17, 32, 4096])
@pytest.mark.parametrize("name", KEYED)
def test_a_key_of_the_wrong_length_amid_good_ones_is_invalid_argument(channel, steady, name, length):
    keys = [good_key() for _ in range(5)] + [os.urandom(length)] + [good_key()]
    details = assert_rejected(channel, name, [keys_request(name, keys)], CODE.INVALID_ARGUMENT)
    assert str(length) in details
    steady.assert_served_throughout()


def test_an_unknown_method_is_unimplemented(channel, steady):
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(f"/{SERVICE}/Drop", None, None)(b"", timeout=10)
    assert info.value.code() == CODE.UNIMPLEMENTED
    steady.assert_served_throughout()


# -- Put streams that lie ------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _head(n: int) -> bytes:
    return pb.PutHead(record_bytes=n).SerializeToString()


def _record(seed: int, block: Block | None = None) -> tuple[Block, bytes, bytes]:
    (real, payload), = items(seed)
    header, payload = build_record(block or real, payload, NS.num_layers, "chat")
    return block or real, header, payload


def _header_with(block: Block, payload: bytes) -> bytes:
    """A header for `block` whose own checksum is right, whatever the block claims."""
    size = len(payload) // NS.num_layers
    sums = [xxhash.xxh3_64_intdigest(payload[i * size : (i + 1) * size]) for i in range(NS.num_layers)]
    return encode_header(block, "chat", NS.num_layers, size, sums)


def _lying_puts() -> dict[str, tuple[list[bytes], grpc.StatusCode, list[bytes]]]:
    """name -> (messages, expected code, keys that must not have been stored)."""
    block, header, payload = _record(60_000)
    n = len(header) + len(payload)
    half = len(payload) // 2
    next_block, next_header, next_payload = _record(60_001)
    swapped_tokens = Block(block.namespace, block.key, block.parent, tuple(t + 1 for t in block.tokens), block.tenant)
    other_parent = Block(block.namespace, block.key, os.urandom(16), block.tokens, block.tenant)
    random_key = Block(block.namespace, os.urandom(16), block.parent, block.tokens, block.tenant)
    bad, big = CODE.INVALID_ARGUMENT, CODE.RESOURCE_EXHAUSTED
    forged = {name: _header_with(liar, payload) for name, liar in
              [("tokens", swapped_tokens), ("parent", other_parent), ("random", random_key)]}
    return {
        "declares more, ends inside the payload": ([_head(n + 1000), header, payload[:half]], bad, [block.key]),
        "declares more than the header describes": ([_head(n + 1000), header, payload], bad, [block.key]),
        "declares less than the header describes": ([_head(n - 1000), header, payload], bad, [block.key]),
        "declares zero": ([_head(0), header, payload], bad, [block.key]),
        "declares 2**64 - 1": ([_head(2**64 - 1), header, payload], big, [block.key]),
        "declares more than max_block_bytes": ([_head(2**20 + 1), header, payload], big, [block.key]),
        "ends after the head": ([_head(n)], bad, [block.key]),
        "ends after the header": ([_head(n), header], bad, [block.key]),
        "ends one byte short": ([_head(n), header, payload[:-1]], bad, [block.key]),
        "one byte too many": ([_head(n), header, payload + b"\x00"], bad, [block.key]),
        "header and payload in one message": ([_head(n), header + payload], bad, [block.key]),
        "header cut in two messages": ([_head(n), header[:40], header[40:], payload], bad, [block.key]),
        "payload of another record": ([_head(n), header, next_payload], bad, [block.key]),
        "a head where the header belongs": ([_head(n), _head(n), payload], bad, [block.key]),
        "header of another record": ([_head(len(next_header) + len(payload)), next_header, payload], bad,
                                     [next_block.key]),
        "key not the hash of its tokens": ([_head(n), forged["tokens"], payload], bad, [block.key]),
        "key not the hash of its parent": ([_head(n), forged["parent"], payload], bad, [block.key]),
        "a random key": ([_head(n), forged["random"], payload], bad, [random_key.key]),
    }


@pytest.mark.parametrize("case", list(_lying_puts()))
def test_a_lying_put_stream_gets_a_precise_code_and_stores_nothing(channel, steady, daemon, case):
    messages, code, not_stored = _lying_puts()[case]
    assert_rejected(channel, "Put", messages, code)
    if not_stored:
        assert [got.status for got in raw_get(daemon.address, not_stored)] == [pb.MISSING] * len(not_stored)
    steady.assert_served_throughout()


def test_a_good_record_before_a_lie_in_the_same_stream_is_stored(channel, steady, daemon):
    good, good_header, good_payload = _record(61_000)
    bad, bad_header, bad_payload = _record(61_001)
    messages = [_head(len(good_header) + len(good_payload)), good_header, good_payload,
                _head(len(bad_header) + len(bad_payload) + 1), bad_header, bad_payload]
    assert_rejected(channel, "Put", messages, CODE.INVALID_ARGUMENT)
    deadline = time.monotonic() + 30  # the good record's store may still be finishing
    while raw_get(daemon.address, [good.key])[0].status != pb.OK and time.monotonic() < deadline:
        time.sleep(0.01)
    served = raw_get(daemon.address, [good.key, bad.key])
    assert served[0].payload == good_payload and served[1].status == pb.MISSING
    steady.assert_served_throughout()


def test_put_streams_abandoned_midway_release_what_they_held(channel, steady, daemon):
    """Budget held for half-sent records must come back, or later puts would wait on it forever."""
    for seed in range(62_000, 62_012):  # 12 x 1 MiB declared against an 8 MiB in-flight budget
        _, header, payload = _record(seed)

        def stall() -> Iterator[bytes]:
            yield _head(2**20)
            yield header
            yield payload[:1000]
            time.sleep(0.2)
            raise RuntimeError("the client gives up")  # cancels the call from the client side

        with pytest.raises(grpc.RpcError) as info:
            channel.stream_unary(method("Put"), None, None)(stall(), timeout=10)
        assert info.value.code() in (CODE.CANCELLED, CODE.UNKNOWN, CODE.INVALID_ARGUMENT)
    steady.assert_served_throughout()


# -- big and abandoned Gets ----------------------------------------------------------------------------


def test_a_get_of_65536_keys_answers_each_key_and_the_daemon_keeps_serving(daemon, steady):
    stored = items(63_000, 8)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == len(stored)
    keys = [block.key for block, _ in stored] + [good_key() for _ in range(MAX_KEYS - len(stored))]
    served = raw_get(daemon.address, keys, timeout_s=120)
    assert [got.payload for got in served[: len(stored)]] == [payload for _, payload in stored]
    assert {got.status for got in served[len(stored):]} == {pb.MISSING}
    steady.assert_served_throughout()


def test_a_lookup_of_65536_keys_counts_the_leading_hits(channel, daemon, steady):
    stored = items(63_100, 5)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == len(stored)
    keys = [block.key for block, _ in stored] + [good_key() for _ in range(MAX_KEYS - len(stored))]
    answer = pb.LookupResponse.FromString(call_raw(channel, "Lookup", [keys_request("Lookup", keys)]))
    assert answer.hits == len(stored)
    steady.assert_served_throughout()


def test_gets_abandoned_after_their_first_part_leave_nothing_pinned(channel, daemon, steady):
    stored = items(63_200, 16)
    with client_for(daemon) as client:
        assert client.put(stored, NS.num_layers).stored == len(stored)
    keys = [block.key for block, _ in stored]
    for _ in range(20):
        stream = channel.unary_stream(method("Get"), None, None)(keys_request("Get", keys), timeout=10)
        next(stream)
        stream.cancel()
    assert [got.payload for got in raw_get(daemon.address, keys)] == [payload for _, payload in stored]
    steady.assert_served_throughout()


def test_gets_whose_clients_close_their_channel_midway_end_quietly(daemons):
    """A client that closes its channel mid-Get (a process exiting, a pool dropping a connection) ends the call
    under the daemon's next write. That is the client's going, not a fault: the daemon logs no traceback (the
    `daemons` fixture reads its log at the stop), and the blocks read whole afterwards."""
    daemon, = daemons(1)
    stored = [(block, os.urandom(BIG.block_bytes)) for block in BIG.blocks(range(16 * BIG.block_tokens))]
    with client_for(daemon, transport="grpc") as client:
        assert client.put(stored, BIG.num_layers).stored == len(stored)
    keys = [block.key for block, _ in stored]
    for n in range(200):
        with grpc.insecure_channel(daemon.address) as channel:
            stream = channel.unary_stream(method("Get"), None, None)(keys_request("Get", keys), timeout=10)
            for _ in range(1 + n % 6):  # gone after a head or a payload, early or late in the stream
                next(stream)
    assert [got.payload for got in raw_get(daemon.address, keys)] == [payload for _, payload in stored]


def test_a_get_into_a_shared_memory_region_over_grpc_is_invalid_argument(channel, steady):
    request = pb.GetRequest(keys=[good_key()], region_id=1, region_offsets=[0]).SerializeToString()
    assert_rejected(channel, "Get", [request], CODE.INVALID_ARGUMENT)
    steady.assert_served_throughout()
