import dataclasses
import os
import struct

import crc32c
import numpy as np
import pytest
import xxhash

from kvstore.block import NO_TENANT, KVLayout, Namespace
from kvstore.record import (
    FIXED_HEADER_BYTES,
    FORMAT_VERSION,
    MAGIC,
    MAX_LAYERS,
    MAX_TOKENS_PER_BLOCK,
    CorruptRecord,
    build_record,
    decode_header,
    header_len_for,
    layer_checksum,
    payload_layer_sums,
    peek_header,
)

pytestmark = pytest.mark.unit

NS = Namespace("m", KVLayout(num_layers=3, kv_heads=1, head_dim=8, dtype="float16"), block_tokens=4)


def make(tokens=range(8), index=1):
    block = NS.blocks(tokens)[index]
    payload = os.urandom(NS.block_bytes)
    header, payload = build_record(block, payload, NS.num_layers, "agent")
    return block, header, payload


def test_roundtrip_and_layer_offsets():
    block, header_bytes, payload = make()
    header = decode_header(header_bytes)
    assert header.key == block.key and header.parent == block.parent and header.namespace == NS.digest
    assert list(header.tokens) == [4, 5, 6, 7] and header.traffic_class == "agent"
    assert header.n_layers == 3 and header.layer_bytes == NS.layer_bytes
    assert header.header_len == len(header_bytes) and header.layer_offset(2) == len(header_bytes) + 2 * NS.layer_bytes
    header.check_identity()
    header.check_expected(block, NS.num_layers, NS.layer_bytes)
    header.check_layers(payload, 0)
    header.check_layers(payload[NS.layer_bytes:], 1)


@pytest.mark.parametrize("mask", [0x01, 0x40, 0xFF])
def test_every_flipped_header_byte_is_detected(mask):
    """Every byte of the header, not a sample of offsets: invariant 1 promises every one (and it is cheap)."""
    _, header_bytes, _ = make()
    undetected = []
    for offset in range(len(header_bytes)):
        corrupt = bytearray(header_bytes)
        corrupt[offset] ^= mask
        try:
            decode_header(bytes(corrupt))
        except CorruptRecord:
            continue
        undetected.append(offset)
    assert len(header_bytes) > FIXED_HEADER_BYTES and not undetected, f"flips not detected at {undetected}"


def test_truncated_header_is_detected():
    _, header_bytes, _ = make()
    for cut in (0, 10, FIXED_HEADER_BYTES, len(header_bytes) - 1):
        with pytest.raises(CorruptRecord, match="truncated"):
            decode_header(header_bytes[:cut])


def test_flipped_payload_byte_fails_only_its_layer():
    _, header_bytes, payload = make()
    header = decode_header(header_bytes)
    corrupt = bytearray(payload)
    corrupt[NS.layer_bytes + 7] ^= 1  # layer 1
    header.check_layers(bytes(corrupt[: NS.layer_bytes]), 0)
    with pytest.raises(CorruptRecord, match="layer 1"):
        header.check_layers(bytes(corrupt), 0)
    with pytest.raises(CorruptRecord, match="truncated"):
        header.check_layers(payload[:-1], 0)


def test_a_header_for_another_request_is_a_miss():
    block, header_bytes, _ = make()
    header = decode_header(header_bytes)
    other_tenant = Namespace("m", NS.layout, 4, salt="other").blocks(range(8))[1]
    with pytest.raises(CorruptRecord, match="key_mismatch|namespace"):
        header.check_expected(other_tenant)
    # A forged collision: same key, other tokens. The self-certifying key check and the token check catch it.
    forged = type(block)(block.namespace, block.key, block.parent, (9, 9, 9, 9))
    with pytest.raises(CorruptRecord, match="tokens_mismatch"):
        header.check_expected(forged)
    wrong_parent = type(block)(block.namespace, block.key, bytes(16), block.tokens)
    with pytest.raises(CorruptRecord, match="parent_mismatch"):
        header.check_expected(wrong_parent)


def test_substituted_key_fails_identity():
    block, _, payload = make()
    liar = type(block)(block.namespace, bytes(16), block.parent, block.tokens)
    header, _ = build_record(liar, payload, NS.num_layers, "chat")
    with pytest.raises(CorruptRecord, match="key_mismatch"):
        decode_header(header).check_identity()


def test_layer_sums_over_arbitrary_chunks():
    _, header_bytes, payload = make()
    header = decode_header(header_bytes)
    cuts = [0, 1, 100, NS.layer_bytes, NS.layer_bytes + 1, len(payload)]
    chunks = [payload[a:b] for a, b in zip(cuts, cuts[1:])]
    assert tuple(payload_layer_sums(chunks, NS.layer_bytes)) == header.layer_sums
    with pytest.raises(CorruptRecord):
        payload_layer_sums([payload[:-3]], NS.layer_bytes)


def test_bad_build_input():
    block = NS.blocks(range(4))[0]
    with pytest.raises(ValueError, match="equal layers"):
        build_record(block, b"x" * 10, 3, "chat")
    with pytest.raises(ValueError, match="traffic class"):
        build_record(block, b"x" * 12, 3, "a-much-too-long-class-name")
    assert np.array_equal(decode_header(build_record(block, b"x" * 12, 3, "chat")[0]).tokens, [0, 1, 2, 3])


# What follows pins each bound and each format's fields one by one: `make mutate` found that moving any of them
# (a `<` made `<=`, a version test made strict) left every test above passing.

FIXED_V1 = "<4sHHI16s16s16s16sIIQ"  # the fixed part of every format, as docs/design.md lays it out


def as_format(header_bytes: bytes, payload: bytes, version: int) -> bytes:
    """The same record as a writer of format `version` made it: no tenant before 2, xxh3-64 layer checksums
    before 3, no codec before 4."""
    header = decode_header(header_bytes)
    fixed = struct.calcsize(FIXED_V1)
    tenant, codec = header_bytes[fixed:fixed + 16], header_bytes[fixed + 16:fixed + 20]
    size = header.layer_bytes
    layers = [payload[i * size:(i + 1) * size] for i in range(header.n_layers)]
    sums = [xxhash.xxh3_64_intdigest(layer) if version < 3 else crc32c.crc32c(layer) for layer in layers]
    body = bytearray(header_bytes[:fixed] + (tenant if version >= 2 else b"") + (codec if version >= 4 else b"")
                     + header.tokens.astype("<u4").tobytes() + struct.pack(f"<{header.n_layers}Q", *sums))
    struct.pack_into("<HHI", body, 4, version, 0, len(body) + 8)
    return sealed(bytes(body))


def sealed(body: bytes) -> bytes:
    """`body`, a header but its checksum, with a right header checksum: what only the field checks can refuse."""
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def forged(n_tokens: int, n_layers: int, layer_bytes: int) -> bytes:
    """A format-4 header declaring these counts, its length consistent with them and its checksum right."""
    fixed = struct.pack(FIXED_V1, MAGIC, FORMAT_VERSION, 0, header_len_for(n_tokens, n_layers), bytes(16),
                        bytes(16), bytes(16), b"chat".ljust(16, b"\x00"), n_tokens, n_layers, layer_bytes)
    return sealed(fixed + bytes(16) + struct.pack("<I", 0) + bytes(4 * n_tokens) + bytes(8 * n_layers))


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_each_format_reads_its_own_fields_and_layer_checksums(version):
    """Tenant from format 2, CRC32C layer checksums from 3, the codec from 4; each older record still verifies
    its payload with its own checksum, and a flipped payload byte fails it."""
    codec_ns = Namespace("m", KVLayout(num_layers=3, kv_heads=1, head_dim=8, dtype="float16", codec="zstd"), 4,
                         salt="tenant")
    block = codec_ns.blocks(range(8))[1]
    header_bytes, payload = build_record(block, os.urandom(codec_ns.block_bytes), 3, "agent")
    header = decode_header(as_format(header_bytes, payload, version))
    assert header.version == version and header.key == block.key
    assert header.record_len == header.header_len + len(payload)
    assert header.tenant == (block.tenant if version >= 2 else NO_TENANT) and block.tenant != NO_TENANT
    assert header.codec == (block.codec.code if version >= 4 else 0) and block.codec.code != 0
    header.check_layers(payload, 0)
    checksum = crc32c.crc32c if version >= 3 else xxhash.xxh3_64_intdigest
    assert header.layer_sums[0] == checksum(payload[:header.layer_bytes]) == layer_checksum(
        payload[:header.layer_bytes], version)
    corrupt = bytearray(payload)
    corrupt[-1] ^= 1
    with pytest.raises(CorruptRecord, match="layer 2"):
        header.check_layers(bytes(corrupt), 0)


# the format's limits, as numbers: a reader that took more would accept records that no writer may make
@pytest.mark.parametrize("counts", [(0, 1, 8), (1, 0, 8), (1, 1, 0), (2**20 + 1, 1, 8), (1, 2**12 + 1, 8)])
def test_counts_out_of_range_are_refused_under_a_right_checksum(counts):
    with pytest.raises(CorruptRecord, match="bad_header"):
        decode_header(forged(*counts))


def test_counts_at_their_limits_are_read():
    header = decode_header(forged(2**20, 2**12, 1))
    assert (len(header.tokens), header.n_layers, header.layer_bytes) == (2**20, 2**12, 1)
    assert (MAX_TOKENS_PER_BLOCK, MAX_LAYERS) == (2**20, 2**12)


def test_a_fixed_part_alone_is_parsed_and_a_byte_less_is_truncated():
    """Exactly FIXED_HEADER_BYTES is enough to read the magic: a wrong one is bad_magic, not truncated."""
    _, header_bytes, _ = make()
    wrong_magic = b"XXXX" + header_bytes[4:FIXED_HEADER_BYTES]
    for parse in (decode_header, peek_header):
        with pytest.raises(CorruptRecord, match="bad_magic"):
            parse(wrong_magic)
        with pytest.raises(CorruptRecord, match="truncated"):
            parse(wrong_magic[:-1])


def test_peek_reads_a_header_of_exactly_its_length():
    block, header_bytes, payload = make()
    assert peek_header(header_bytes) == (block.key, len(header_bytes), len(payload))
    with pytest.raises(CorruptRecord):
        peek_header(header_bytes[:-1])


def test_peek_refuses_every_flipped_header_byte():
    """peek_header skips the token ids and layer checksums but not the header checksum over them."""
    _, header_bytes, _ = make()
    for offset in range(len(header_bytes)):
        corrupt = bytearray(header_bytes)
        corrupt[offset] ^= 0x01
        with pytest.raises(CorruptRecord):
            peek_header(bytes(corrupt))


def test_a_decoded_header_is_immutable():
    """A verified header is held while its payload is read or arrives (block_reader, arriving): nothing may
    change it once checked."""
    header = decode_header(make()[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        header.key = bytes(16)


def test_a_header_of_another_layout_is_a_miss():
    block, header_bytes, _ = make()
    header = decode_header(header_bytes)
    with pytest.raises(CorruptRecord, match="layout_mismatch"):
        header.check_expected(block, NS.num_layers + 1)
    with pytest.raises(CorruptRecord, match="layout_mismatch"):
        header.check_expected(block, NS.num_layers, NS.layer_bytes * 2)
    header.check_expected(block)  # a reader that names no layout checks none


def test_a_codec_block_stores_its_encoded_layers_and_a_copy_keeps_them_as_they_are():
    layout = KVLayout(num_layers=3, kv_heads=1, head_dim=8, dtype="float16", codec="zstd")
    block = Namespace("m", layout, 4).blocks(range(4))[0]
    raw = bytes(layout.layer_bytes(4) * 3)  # zeros: zstd shrinks every layer
    header_bytes, stored = build_record(block, raw, 3, "chat")
    header = decode_header(header_bytes)
    assert header.codec == block.codec.code and len(stored) < len(raw) and len(stored) == 3 * header.layer_bytes
    out = bytearray(layout.layer_bytes(4))
    block.codec.decode(stored[header.layer_bytes:2 * header.layer_bytes], memoryview(out))
    assert bytes(out) == raw[:len(out)]
    copied_header, copied = build_record(block, stored, 3, "chat", encoded=True)
    assert (copied_header, copied) == (header_bytes, stored)
