"""Properties of the daemon's request parsers (kvstore/server/requests.py), shared by gRPC and the data
channel: whatever a client sends, each answers with a RequestError or a request it has fully checked."""

from __future__ import annotations

import crc32c
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block import KEY_BYTES, Block, chain_hash
from kvstore.proto import pb
from kvstore.record import build_record
from kvstore.server.config import ServerConfig
from kvstore.server.requests import (
    RequestError,
    check_get,
    check_keys,
    check_payload,
    check_put_head,
    parse,
    parse_record_header,
    reuse_hint,
)

pytestmark = pytest.mark.unit
PROPERTY = settings(max_examples=200, deadline=None)
CONFIG = ServerConfig(max_keys_per_request=8, max_block_bytes=4096)
CLASSES = ["agent", "chat"]
MESSAGES = [pb.LookupRequest, pb.KeysRequest, pb.AdviseRequest, pb.GetRequest, pb.PutHead, pb.StatsRequest,
            pb.InfoRequest, pb.RegisterRegion]
u32 = st.integers(0, 2**32 - 1)
keys = st.lists(st.one_of(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), st.binary(max_size=40)), max_size=12)


def record_of(seed: bytes, tokens: list[int], n_layers: int, layer: bytes, traffic_class: str) -> tuple[bytes, bytes]:
    parent = xxhash.xxh3_128_digest(seed)
    block = Block(bytes(16), chain_hash(parent, tokens), parent, tuple(tokens))
    return build_record(block, layer * n_layers, n_layers, traffic_class)


records = st.builds(record_of, st.binary(max_size=8), st.lists(u32, min_size=1, max_size=16), st.integers(1, 4),
                    st.binary(min_size=1, max_size=64), st.sampled_from(CLASSES + ["bulk"]))


@PROPERTY
@given(st.sampled_from(MESSAGES), st.binary(max_size=64))
def test_any_bytes_parse_to_the_message_or_a_request_error(message_type, raw):
    try:
        message = parse(message_type, raw)
    except RequestError as exc:
        assert message_type.DESCRIPTOR.name in str(exc) and not exc.exhausted
        return
    assert isinstance(message, message_type)


@PROPERTY
@given(keys)
def test_keys_pass_only_when_few_enough_and_all_16_bytes(candidate):
    try:
        check_keys(candidate, CONFIG)
    except RequestError as exc:
        assert str(exc)
        assert len(candidate) > CONFIG.max_keys_per_request or any(len(k) != KEY_BYTES for k in candidate)
        return
    assert len(candidate) <= CONFIG.max_keys_per_request and all(len(k) == KEY_BYTES for k in candidate)


@PROPERTY
@given(keys, u32, u32, st.booleans())
def test_a_get_passes_only_with_good_keys_and_a_nonempty_layer_range(candidate, begin, end, stop_at_miss):
    request = pb.GetRequest(keys=candidate, layer_begin=begin, layer_end=end, stop_at_miss=stop_at_miss)
    try:
        check_get(request, CONFIG)
    except RequestError:
        return
    assert all(len(k) == KEY_BYTES for k in candidate) and (end == 0 or begin < end)


@PROPERTY
@given(st.integers(0, 2**64 - 1))
def test_a_declared_record_size_is_positive_and_within_max_block_bytes_or_refused(declared):
    try:
        check_put_head(declared, CONFIG)
    except RequestError as exc:
        assert exc.exhausted == (declared > CONFIG.max_block_bytes)
        return
    assert 0 < declared <= CONFIG.max_block_bytes


@PROPERTY
@given(u32, u32, u32)
def test_a_reuse_hint_is_none_valid_or_refused(hit_blocks, blocks, turn):
    try:
        hint = reuse_hint(pb.PutHead(record_bytes=1, request_hit_blocks=hit_blocks, request_blocks=blocks,
                                     request_turn=turn))
    except RequestError:
        assert hit_blocks > blocks > 0
        return
    assert hint is None if blocks == 0 else (hint is not None and hit_blocks <= blocks)


@PROPERTY
@given(records, st.data())
def test_a_record_header_passes_only_if_it_is_exactly_a_verified_header_of_the_declared_size(record, data):
    header_bytes, payload = record
    declared = len(header_bytes) + len(payload)
    mutation = data.draw(st.sampled_from(["none", "flip", "cut", "extend", "other size", "random"]))
    if mutation == "flip":
        buf = bytearray(header_bytes)
        buf[data.draw(st.integers(0, len(buf) - 1))] ^= data.draw(st.integers(1, 255))
        header_bytes = bytes(buf)
    elif mutation == "cut":
        header_bytes = header_bytes[: data.draw(st.integers(0, len(header_bytes) - 1))]
    elif mutation == "extend":
        header_bytes += data.draw(st.binary(min_size=1, max_size=8))
    elif mutation == "other size":
        declared = data.draw(st.integers(0, 2**64 - 1).filter(lambda n: n != declared))
    elif mutation == "random":
        header_bytes = data.draw(st.binary(max_size=300))
    try:
        header = parse_record_header(header_bytes, declared, CLASSES)
    except RequestError as exc:
        assert str(exc)
        return
    assert mutation == "none" and header.record_len == declared and header.traffic_class in CLASSES
    header.check_identity()


@PROPERTY
@given(records, st.data())
def test_a_payload_passes_only_if_it_matches_the_header_however_it_is_cut(record, data):
    header_bytes, payload = record
    header = parse_record_header(header_bytes, len(header_bytes) + len(payload), CLASSES + ["bulk"])
    body = data.draw(st.one_of(st.just(payload), st.binary(max_size=len(payload) + 8)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=6)))
    chunks = [body[a:b] for a, b in zip([0] + cuts, cuts + [len(body)])]
    try:
        check_payload(header, chunks)
    except RequestError as exc:
        assert str(exc)
        return
    assert body == payload or len(body) == len(payload)  # accepted: its layer checksums all match
    size = header.layer_bytes
    assert header.layer_sums == tuple(crc32c.crc32c(body[i * size : (i + 1) * size]) for i in range(header.n_layers))
