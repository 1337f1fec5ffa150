import os

import numpy as np
import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.record import FIXED_HEADER_BYTES, CorruptRecord, build_record, decode_header, payload_layer_sums

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
