"""The daemon over real gRPC: protocol, status codes, hostile input, health, metrics, shutdown."""

import os
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.block import Block, KVLayout, Namespace
from kvstore.client import KVClient
from kvstore.proto import SERVICE, method, pb
from kvstore.record import build_record

pytestmark = pytest.mark.integration

NS = Namespace("svc-test", KVLayout(num_layers=4, kv_heads=2, head_dim=32, dtype="float16"), block_tokens=16)
CODE = grpc.StatusCode


def prompt(n_blocks: int, start: int = 0):
    blocks = NS.blocks(range(start, start + n_blocks * NS.block_tokens))
    return [(block, os.urandom(NS.block_bytes)) for block in blocks]


def raw_put(channel, messages, timeout=10):
    call = channel.stream_unary(method("Put"), None, pb.PutResponse.FromString)
    return call(iter(messages), timeout=timeout)


def record_messages(block, payload, traffic_class="chat"):
    header, payload = build_record(block, payload, NS.num_layers, traffic_class)
    return [pb.PutHead(record_bytes=len(header) + len(payload)).SerializeToString(), header, payload]


ARGS = ("--max-block-bytes", "4MiB", "--max-message-bytes", "2MiB", "--max-inflight-put-bytes", "16MiB",
        "--max-keys-per-request", "1000", "--metrics-port", "0")


@pytest.fixture
def daemon(daemons):
    return daemons(1, *ARGS)[0]


@pytest.fixture
def channel(daemon):
    with grpc.insecure_channel(daemon.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def shared(module_daemons):
    """One daemon for the tests of malformed requests: each checks its own refusal and what it stored."""
    return module_daemons(1, *ARGS)[0]


@pytest.fixture(scope="module")
def shared_channel(shared):
    with grpc.insecure_channel(shared.address) as ch:
        yield ch


def test_put_lookup_get_touch_delete_advise_stats(daemon):
    items = prompt(6)
    blocks = [b for b, _ in items]
    with KVClient([daemon.address]) as client:
        assert client.lookup(blocks) == 0
        assert client.put(items, NS.num_layers).stored == 6
        assert client.put(items[:2], NS.num_layers).existed == 2
        assert client.lookup(blocks) == 6
        got = client.get(blocks)
        assert [g.payload for g in got] == [p for _, p in items]
        layered = client.get(blocks, 1, 3, layer_major=True)
        assert [bytes(g.layer(2)) for g in layered] == [p[2 * NS.layer_bytes : 3 * NS.layer_bytes] for _, p in items]
        assert client.touch(blocks[:3], "agent") == 3
        assert client.delete(blocks[3:4]) == 1
        assert client.advise(blocks, continues=False) == 5, "advice counts the blocks held"
        assert client.lookup(blocks) == 3
        assert len(client.get(blocks)) == 3, "a get stops at the first missing block"
        stats = client.server_stats()[daemon.address]
    assert stats.value("kvstore_puts_total", result="stored") == 6
    assert stats.value("kvstore_hits_total", tier="dram") >= 6
    assert stats.value("kvstore_misses_total", cause="missing") >= 1
    assert stats.value("kvstore_blocks", traffic_class="chat") == 5
    assert stats.value("kvstore_advised_blocks_total", continues="false") == 5


def test_get_streams_layer_major_in_layer_order(channel, daemon):
    items = prompt(3)
    with KVClient([daemon.address]) as client:
        client.put(items, NS.num_layers)
    call = channel.unary_stream(method("Get"), pb.GetRequest.SerializeToString, None)
    order, pending = [], False
    for message in call(pb.GetRequest(keys=[b.key for b, _ in items], order=pb.LAYER_MAJOR), timeout=10):
        if pending:
            pending = False
            continue
        head = pb.GetPartHead.FromString(message)
        if head.payload_bytes:
            order.append((head.layer_begin, head.index))
            pending = True
    assert order == [(layer, index) for layer in range(NS.num_layers) for index in range(3)]


def test_health_and_reflection(shared_channel):
    channel = shared_channel
    stub = health_pb2_grpc.HealthStub(channel)
    assert stub.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    response = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert SERVICE in {s.name for s in response.list_services_response.service}


def test_prometheus_endpoint(daemon):
    with KVClient([daemon.address]) as client:
        client.put(prompt(1), NS.num_layers)
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    assert 'kvstore_puts_total{result="stored"} 1.0' in text
    assert "kvstore_rpc_seconds_bucket" in text and "kvstore_capacity_bytes" in text


@pytest.mark.parametrize("name, request_bytes", [
    ("Lookup", pb.LookupRequest(keys=[b"short"]).SerializeToString()),
    ("Lookup", pb.LookupRequest(keys=[b"k" * 16] * 1001).SerializeToString()),
    ("Lookup", b"\xff\xff\xff garbage"),
    ("Touch", pb.KeysRequest(keys=[b"k" * 16], traffic_class="nope").SerializeToString()),
    ("Delete", pb.KeysRequest(keys=[b""]).SerializeToString()),
    ("Advise", pb.AdviseRequest(keys=[b"k" * 17], continues=True).SerializeToString()),
    ("Stats", b"\x0a\x05abc"),
], ids=["short-key", "too-many-keys", "not-protobuf", "unknown-class", "empty-key", "advise-long-key",
        "truncated-field"])
def test_malformed_unary_requests_are_invalid_argument(shared_channel, name, request_bytes):
    call = shared_channel.unary_unary(method(name), None, None)
    with pytest.raises(grpc.RpcError) as info:
        call(request_bytes, timeout=5)
    assert info.value.code() == CODE.INVALID_ARGUMENT, info.value.details()


@pytest.mark.parametrize("request_bytes", [
    b"\xff garbage",
    pb.GetRequest(keys=[b"x" * 15]).SerializeToString(),
    pb.GetRequest(keys=[b"k" * 16], layer_begin=3, layer_end=2).SerializeToString(),
], ids=["not-protobuf", "short-key", "empty-layer-range"])
def test_malformed_get_is_invalid_argument(shared_channel, request_bytes):
    call = shared_channel.unary_stream(method("Get"), None, None)
    with pytest.raises(grpc.RpcError) as info:
        list(call(request_bytes, timeout=5))
    assert info.value.code() == CODE.INVALID_ARGUMENT


def test_layer_range_outside_the_block_is_a_bad_range_part(channel, daemon):
    items = prompt(1)
    with KVClient([daemon.address]) as client:
        client.put(items, NS.num_layers)
    call = channel.unary_stream(method("Get"), pb.GetRequest.SerializeToString, None)
    parts = list(call(pb.GetRequest(keys=[items[0][0].key], layer_begin=2, layer_end=9), timeout=5))
    assert len(parts) == 1 and pb.GetPartHead.FromString(parts[0]).status == pb.BAD_RANGE


def _bad_puts():
    (block, payload), = prompt(1, start=5000)
    head, header, body = record_messages(block, payload)
    declared = len(header) + len(body)
    other_class = record_messages(block, payload, traffic_class="bulk")
    flipped = bytearray(body)
    flipped[100] ^= 1
    forged = Block(block.namespace, os.urandom(16), block.parent, block.tokens)  # key is not H(parent, tokens)
    return {
        "not a head": ([b"\xff\xfe garbage"], CODE.INVALID_ARGUMENT),
        "zero length": ([pb.PutHead(record_bytes=0).SerializeToString()], CODE.INVALID_ARGUMENT),
        "impossible hint": ([pb.PutHead(record_bytes=declared, request_hit_blocks=5,
                                        request_blocks=4).SerializeToString(), header, body], CODE.INVALID_ARGUMENT),
        "oversized declared": ([pb.PutHead(record_bytes=5 * 2**20).SerializeToString()], CODE.RESOURCE_EXHAUSTED),
        "garbage header": ([head, os.urandom(len(header)), body], CODE.INVALID_ARGUMENT),
        "truncated header": ([head, header[:50]], CODE.INVALID_ARGUMENT),
        "lying length": ([pb.PutHead(record_bytes=declared + 10).SerializeToString(), header, body],
                         CODE.INVALID_ARGUMENT),
        "payload longer than declared": ([head, header, body + b"extra"], CODE.INVALID_ARGUMENT),
        "stream ends inside the payload": ([head, header, body[:1000]], CODE.INVALID_ARGUMENT),
        "flipped payload byte": ([head, header, bytes(flipped)], CODE.INVALID_ARGUMENT),
        "forged key": (record_messages(forged, payload), CODE.INVALID_ARGUMENT),
        "unknown class": (other_class, CODE.INVALID_ARGUMENT),
        "message over the size limit": ([head, header, os.urandom(3 * 2**20)], CODE.RESOURCE_EXHAUSTED),
    }


@pytest.mark.parametrize("case", list(_bad_puts()))
def test_malformed_puts_get_precise_codes_and_store_nothing(shared_channel, shared, case):
    messages, code = _bad_puts()[case]
    with KVClient([shared.address]) as client:
        stored = client.server_stats()[shared.address].value("kvstore_puts_total", result="stored")
        with pytest.raises(grpc.RpcError) as info:
            raw_put(shared_channel, messages)
        assert info.value.code() == code, info.value.details()
        assert client.server_stats()[shared.address].value("kvstore_puts_total", result="stored") == stored
        items = prompt(2, start=9000 + 10 * list(_bad_puts()).index(case))  # blocks new to the shared daemon
        assert client.put(items, NS.num_layers).stored == 2, "the daemon keeps serving"
        assert len(client.get([b for b, _ in items])) == 2


def test_memory_stays_bounded_under_a_flood_of_bad_puts(channel, daemon):
    (block, payload), = prompt(1, start=7000)
    head, header, body = record_messages(block, payload)
    rss_before = daemon.rss_bytes()
    for _ in range(100):
        # Declares a large record, sends most of it, then stops: the daemon must let go of it.
        with pytest.raises(grpc.RpcError):
            raw_put(channel, [pb.PutHead(record_bytes=4 * 2**20 - 1).SerializeToString(), header,
                              os.urandom(2 * 2**20 - 1024)])
    growth = daemon.rss_bytes() - rss_before
    assert growth < 96 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    with KVClient([daemon.address]) as client:
        assert client.put(prompt(1, start=8000), NS.num_layers).stored == 1


def test_a_foreign_or_colliding_header_is_a_miss_at_the_client(daemon):
    items = prompt(2)
    (first, _), (second, _) = items
    with KVClient([daemon.address]) as client:
        client.put(items, NS.num_layers)
        other_tenant = Block(os.urandom(16), first.key, first.parent, first.tokens)
        collided_tokens = Block(first.namespace, first.key, first.parent, tuple(reversed(first.tokens)))
        wrong_parent = Block(second.namespace, second.key, os.urandom(16), second.tokens)
        for liar in (other_tenant, collided_tokens, wrong_parent):
            assert client.get([liar]) == []
        assert set(client.stats.miss_causes) == {"namespace_mismatch", "tokens_mismatch", "parent_mismatch"}
        assert len(client.get([first, second])) == 2


def test_sigterm_shuts_down_cleanly_and_data_persists(daemon):
    items = prompt(3)
    with KVClient([daemon.address]) as client:
        client.put(items, NS.num_layers)
    assert daemon.stop() == 0
    assert "stopped cleanly" in daemon.log()
    daemon.start()
    with KVClient([daemon.address]) as client:
        assert [g.payload for g in client.get([b for b, _ in items])] == [p for _, p in items]
