"""Properties of the block record's encoder and its verifying decoder (kvstore/record.py)."""

from __future__ import annotations

import struct

import crc32c
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block import Block, chain_hash
from kvstore.record import (
    CLASS_NAME_BYTES,
    FIXED_HEADER_BYTES,
    FORMAT_VERSION,
    CorruptRecord,
    RecordHeader,
    build_record,
    decode_header,
    encode_header,
    payload_layer_sums,
)

pytestmark = pytest.mark.unit
PROPERTY = settings(max_examples=200, deadline=None)

digests = st.binary(min_size=16, max_size=16)
tokens = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40)
class_names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1,
                      max_size=CLASS_NAME_BYTES).filter(lambda name: len(name.encode()) <= CLASS_NAME_BYTES)


@st.composite
def records(draw) -> tuple[Block, str, int, bytes]:
    """(block, traffic class, n_layers, layer-major payload) of a well-formed record."""
    namespace, parent, tenant = draw(digests), draw(digests), draw(digests)
    ids = draw(tokens)
    block = Block(namespace, chain_hash(parent, ids, tenant), parent, tuple(ids), tenant)
    n_layers = draw(st.integers(1, 8))
    payload = draw(st.binary(min_size=1, max_size=32)) * n_layers  # any bytes, cut into n_layers equal layers
    return block, draw(class_names), n_layers, payload


def reencode(header: RecordHeader) -> bytes:
    block = Block(header.namespace, header.key, header.parent, tuple(int(t) for t in header.tokens), header.tenant)
    return encode_header(block, header.traffic_class, header.n_layers, header.layer_bytes, header.layer_sums)


def version_of(buf: bytes) -> int:
    return struct.unpack_from("<H", buf, 4)[0]


def with_checksum(body: bytes) -> bytes:
    """`body` (a header but its last 8 bytes) sealed with a right header checksum."""
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def decodes_consistently(buf: bytes) -> None:
    """The property: CorruptRecord, or a header that says exactly what the bytes say."""
    try:
        header = decode_header(buf)
    except CorruptRecord:
        return
    assert header.header_len <= len(buf)
    assert len(header.tokens) >= 1 and len(header.layer_sums) == header.n_layers >= 1 and header.layer_bytes >= 1
    if version_of(buf) == FORMAT_VERSION:
        assert reencode(header) == bytes(buf[: header.header_len])


@PROPERTY
@given(records())
def test_a_built_record_decodes_to_what_was_built_and_verifies(record):
    block, traffic_class, n_layers, payload = record
    header_bytes, body = build_record(block, payload, n_layers, traffic_class)
    header = decode_header(header_bytes + body)  # a header followed by its payload decodes the same
    assert (header.namespace, header.parent, header.key, header.tenant) == (block.namespace, block.parent,
                                                                            block.key, block.tenant)
    assert header.traffic_class == traffic_class and list(header.tokens) == list(block.tokens)
    assert header.n_layers == n_layers and header.payload_len == len(payload) == len(body)
    assert header.header_len == len(header_bytes) and reencode(header) == header_bytes
    header.check_identity()
    header.check_expected(block, n_layers, len(payload) // n_layers)
    header.check_layers(body, 0)
    for layer in range(n_layers):
        start = header.layer_offset(layer) - header.header_len
        header.check_layers(body[start : start + header.layer_bytes], layer)


@PROPERTY
@given(records(), st.data())
def test_layer_sums_do_not_depend_on_how_the_payload_is_cut(record, data):
    block, traffic_class, n_layers, payload = record
    header = decode_header(build_record(block, payload, n_layers, traffic_class)[0])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(payload)), max_size=8)))
    chunks = [payload[a:b] for a, b in zip([0] + cuts, cuts + [len(payload)])]
    assert tuple(payload_layer_sums(chunks, header.layer_bytes)) == header.layer_sums


@PROPERTY
@given(st.binary(max_size=400))
def test_any_bytes_are_a_corrupt_record_or_a_consistent_header(buf):
    decodes_consistently(buf)


@PROPERTY
@given(records(), st.data())
def test_flipped_or_cut_bytes_of_a_header_are_caught_or_harmless(record, data):
    block, traffic_class, n_layers, payload = record
    header_bytes = build_record(block, payload, n_layers, traffic_class)[0]
    buf = bytearray(header_bytes)
    for position in data.draw(st.lists(st.integers(0, len(buf) - 1), min_size=1, max_size=4, unique=True)):
        buf[position] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(buf)))
    decodes_consistently(bytes(buf[:cut]))
    with pytest.raises(CorruptRecord):
        decode_header(bytes(buf))  # the header checksum catches every flipped byte


@PROPERTY
@given(records(), st.data())
def test_any_fields_under_a_right_checksum_are_caught_or_consistent(record, data):
    """Rewrite fixed-part fields to anything and reseal the header checksum: only the decoder's own
    checks stand between these bytes and a reader."""
    block, traffic_class, n_layers, payload = record
    buf = bytearray(build_record(block, payload, n_layers, traffic_class)[0])
    fields = {"version": (4, "<H"), "flags": (6, "<H"), "header_len": (8, "<I"), "n_tokens": (76, "<I"),
              "n_layers": (80, "<I"), "layer_bytes": (84, "<Q")}
    for name in data.draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        offset, fmt = fields[name]
        struct.pack_into(fmt, buf, offset, data.draw(st.integers(0, 2 ** (8 * struct.calcsize(fmt)) - 1)))
    if data.draw(st.booleans()):
        buf[60:76] = data.draw(st.binary(min_size=16, max_size=16))  # the traffic class
    decodes_consistently(with_checksum(bytes(buf[:-8])))
    if len(buf) > FIXED_HEADER_BYTES + 8:
        decodes_consistently(with_checksum(bytes(buf[: data.draw(st.integers(FIXED_HEADER_BYTES, len(buf) - 8))])))


@PROPERTY
@given(records(), st.binary(max_size=300))
def test_check_layers_accepts_exactly_the_payload_it_describes(record, other):
    block, traffic_class, n_layers, payload = record
    header = decode_header(build_record(block, payload, n_layers, traffic_class)[0])
    try:
        header.check_layers(other, 0)
    except CorruptRecord:
        return
    size, layers = header.layer_bytes, len(other) // header.layer_bytes
    assert [crc32c.crc32c(other[i * size : (i + 1) * size]) for i in range(layers)] == \
        list(header.layer_sums[:layers])


def test_tokens_round_trip_as_little_endian_u32():
    block = Block(bytes(16), chain_hash(bytes(16), [2**32 - 1, 0]), bytes(16), (2**32 - 1, 0))
    header = decode_header(build_record(block, b"\x01\x02", 1, "chat")[0])
    assert header.tokens.dtype == np.uint32 and list(header.tokens) == [2**32 - 1, 0]


@PROPERTY
@given(records(), st.text(st.characters(blacklist_categories=("Cs",)), max_size=20))
def test_any_traffic_class_is_refused_or_read_back_as_written(record, traffic_class):
    block, _, n_layers, payload = record
    try:
        header_bytes = build_record(block, payload, n_layers, traffic_class)[0]
    except ValueError:
        return
    assert decode_header(header_bytes).traffic_class == traffic_class


def as_format_2(header_bytes: bytes, payload: bytes) -> bytes:
    """The same record as a format-2 writer made it: version 2, xxh3-64 layer checksums."""
    header = decode_header(header_bytes)
    size = header.layer_bytes
    sums = [xxhash.xxh3_64_intdigest(payload[i * size : (i + 1) * size]) for i in range(header.n_layers)]
    tenant_end = 4 + 2 + 2 + 4 + 16 * 4 + 4 + 4 + 8 + 16
    body = bytearray(header_bytes[:tenant_end] + header_bytes[tenant_end + 4 : -8])  # format 4's codec dropped
    struct.pack_into("<HHI", body, 4, 2, 0, len(body) + 8)
    struct.pack_into(f"<{header.n_layers}Q", body, len(body) - 8 * header.n_layers, *sums)
    return with_checksum(bytes(body))


@PROPERTY
@given(records(), st.binary(min_size=1, max_size=300))
def test_format_2_records_are_still_read_with_their_xxh3_layer_checksums(record, other):
    block, traffic_class, n_layers, payload = record
    header_bytes, _ = build_record(block, payload, n_layers, traffic_class)
    old = decode_header(as_format_2(header_bytes, payload))
    assert old.version == 2 and old.key == block.key
    old.check_layers(payload, 0)
    assert payload_layer_sums([payload[:3], payload[3:]], old.layer_bytes, old.version) == list(old.layer_sums)
    new = decode_header(header_bytes)
    assert new.version == FORMAT_VERSION == 4 and new.layer_sums != old.layer_sums
    if other[: len(payload)] != payload and len(other) >= len(payload):
        with pytest.raises(CorruptRecord):
            old.check_layers(other[: len(payload)], 0)
