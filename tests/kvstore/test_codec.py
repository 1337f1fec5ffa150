"""KV codecs: round trips, the bounds of each, codecs in the namespace and the record, and bad bytes refused."""

import dataclasses
import os
import struct

import numpy as np
import pytest
import xxhash
import zstandard

from kvstore.block import KVLayout, Namespace
from kvstore.codec import CODECS, BlockCodec, CorruptLayer, LayerGeometry, check_codec, codec_named
from kvstore.record import CorruptRecord, build_record, decode_header

GEOMETRY = LayerGeometry(kv_per_layer=2, tokens=16, channels=64, dtype="bfloat16")


def kv_like(geometry: LayerGeometry, seed: int = 0) -> bytes:
    """One layer shaped like attention KV: normal values, a few key channels and value tokens far larger
    (the outliers the per-channel and per-token groupings are for)."""
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(geometry.kv_per_layer, geometry.tokens, geometry.channels)).astype(np.float32)
    values[0, :, :: geometry.channels // 4] *= 20  # outlier key channels
    values[-1, :: geometry.tokens // 4] *= 10  # outlier value tokens
    return to_dtype(values, geometry.dtype)


def to_dtype(values: np.ndarray, dtype: str) -> bytes:
    if dtype == "bfloat16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    return values.astype({"float32": "<f4", "float16": "<f2"}[dtype]).tobytes()


def as_float32(raw: bytes, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, {"float32": "<f4", "float16": "<f2"}[dtype]).astype(np.float32)


def round_trip(codec: BlockCodec, raw: bytes) -> bytes:
    stored, slot = codec.encode(raw, 1)
    assert slot == len(stored) <= codec.max_slot_bytes
    out = bytearray(len(raw))
    codec.decode(stored, memoryview(out))
    return bytes(out)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_lossless_codecs_give_back_every_bit_and_zstd_shrinks_kv(dtype):
    geometry = LayerGeometry(2, 16, 64, dtype)
    raw = kv_like(geometry)
    for name in ("raw", "zstd"):
        assert round_trip(BlockCodec(codec_named(name), geometry), raw) == raw
    stored, _ = BlockCodec(codec_named("zstd"), geometry).encode(raw, 1)
    assert len(stored) < len(raw)


def test_a_layer_zstd_cannot_shrink_is_stored_raw_in_a_slot_four_bytes_longer():
    codec = BlockCodec(codec_named("zstd"), GEOMETRY)
    noise = os.urandom(GEOMETRY.raw_bytes)
    stored, slot = codec.encode(noise, 1)
    assert slot == GEOMETRY.raw_bytes + 4 == codec.max_slot_bytes
    assert round_trip(codec, noise) == noise


@pytest.mark.parametrize(("dtype", "tokens"), [("bfloat16", 16), ("float16", 16), ("float32", 16),
                                               ("bfloat16", 150)])  # 150: key runs of 64, the last partial
@pytest.mark.parametrize(("name", "bound"), [("int8", 0.01), ("int4", 0.12)])
def test_quantisers_stay_within_their_step_and_shrink_the_layer(name, bound, dtype, tokens):
    """Relative error per group: int8 is within 1/254 of each group's largest value, int4 within 1/30 of its
    range; measured on the whole layer, both well inside `bound`."""
    geometry = LayerGeometry(2, tokens, 64, dtype)
    raw = kv_like(geometry, seed=3)
    codec = BlockCodec(codec_named(name), geometry)
    got, want = as_float32(round_trip(codec, raw), dtype), as_float32(raw, dtype)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < bound
    stored, _ = codec.encode(raw, 1)
    assert len(stored) < len(raw) / (1.6 if name == "int8" else 2.5)


def test_quantisers_keep_an_outlier_channel_from_flattening_the_others():
    """Per-channel key scales: a key channel 1000x larger leaves the small ones as exact as without it."""
    geometry = LayerGeometry(2, 16, 64, "float32")
    values = np.random.default_rng(1).normal(size=(2, 16, 64)).astype(np.float32)
    values[0, :, 5] *= 1000
    got = as_float32(round_trip(BlockCodec(codec_named("int8"), geometry), to_dtype(values, "float32")), "float32")
    small = np.delete(values[0], 5, axis=1)
    assert np.abs(np.delete(got.reshape(values.shape)[0], 5, axis=1) - small).max() < np.abs(small).max() / 100


def test_an_all_zero_layer_decodes_to_zeros_under_every_codec():
    raw = bytes(GEOMETRY.raw_bytes)
    for codec in CODECS.values():
        assert round_trip(BlockCodec(codec, GEOMETRY), raw) == raw


def test_many_layers_share_one_slot_length_and_decode_one_by_one():
    codec = BlockCodec(codec_named("zstd"), GEOMETRY)
    layers = [kv_like(GEOMETRY, seed) for seed in range(3)] + [os.urandom(GEOMETRY.raw_bytes)]
    stored, slot = codec.encode(b"".join(layers), len(layers))
    assert len(stored) == slot * len(layers)
    for i, layer in enumerate(layers):
        out = bytearray(GEOMETRY.raw_bytes)
        codec.decode(memoryview(stored)[i * slot : (i + 1) * slot], memoryview(out))
        assert bytes(out) == layer


@pytest.mark.parametrize("name", ["zstd", "int8", "int4"])
def test_bytes_no_encoder_wrote_are_refused_never_decoded(name):
    codec = BlockCodec(codec_named(name), GEOMETRY)
    stored, slot = codec.encode(kv_like(GEOMETRY), 1)
    out = memoryview(bytearray(GEOMETRY.raw_bytes))
    for bad in (stored[:3], b"\xff\xff\xff\x7f" + stored[4:], stored[:4] + bytes(len(stored) - 4),
                stored[:4] + os.urandom(len(stored) - 4)):
        with pytest.raises(CorruptLayer):
            codec.decode(bad, out)


def test_a_wrong_payload_length_is_refused_before_encoding():
    with pytest.raises(ValueError, match="not 2 layers"):
        BlockCodec(codec_named("int8"), GEOMETRY).encode(bytes(GEOMETRY.raw_bytes), 2)


# -- the codec in the namespace and the record ---------------------------------------------------------

LAYOUT = KVLayout(num_layers=3, kv_heads=2, head_dim=32, dtype="bfloat16")


def layout(codec: str) -> KVLayout:
    return KVLayout(LAYOUT.num_layers, LAYOUT.kv_heads, LAYOUT.head_dim, LAYOUT.dtype, codec=codec)


def test_each_codec_is_a_namespace_of_its_own_and_raw_keeps_the_old_digest():
    spaces = {name: Namespace("m", layout(name), block_tokens=16) for name in CODECS}
    assert spaces["raw"].digest == Namespace("m", LAYOUT, block_tokens=16).digest
    assert len({space.digest for space in spaces.values()}) == len(CODECS)
    assert len({space.blocks(range(16))[0].key for space in spaces.values()}) == len(CODECS)
    assert spaces["raw"].codec is None and spaces["int8"].blocks(range(16))[0].codec == spaces["int8"].codec


def test_a_layout_refuses_an_unknown_codec_and_quantising_non_float_kv():
    with pytest.raises(ValueError, match="one of raw, zstd, int8, int4"):
        layout("lz77")
    with pytest.raises(ValueError, match="quantises"):
        KVLayout(1, 1, 8, dtype="int8", codec="int4")
    KVLayout(1, 1, 8, dtype="int8", codec="zstd")  # lossless codecs take any bytes


def test_the_record_names_its_codec_and_checksums_the_stored_bytes():
    space = Namespace("m", layout("int4"), block_tokens=16)
    block = space.blocks(range(16))[0]
    raw = b"".join(kv_like(space.codec.geometry, seed) for seed in range(LAYOUT.num_layers))
    header_bytes, payload = build_record(block, raw, LAYOUT.num_layers, "chat")
    header = decode_header(header_bytes)
    assert (header.version, header.codec) == (4, codec_named("int4").code)
    assert header.payload_len == len(payload) < len(raw) / 2.5
    header.check_expected(block)
    header.check_layers(payload, 0)
    damaged = bytearray(payload)
    damaged[len(payload) // 2] ^= 1
    with pytest.raises(CorruptRecord, match="checksum"):
        header.check_layers(bytes(damaged), 0)


def test_a_record_of_another_codec_is_a_codec_mismatch_for_the_reader():
    """Keys already differ per codec; a record under a key of one codec that names another (a writer that
    got it wrong) is still never decoded as the reader's."""
    int8 = Namespace("m", layout("int8"), block_tokens=16)
    block = int8.blocks(range(16))[0]
    raw = bytes(int8.block_bytes)
    header, _ = build_record(block, raw, LAYOUT.num_layers, "chat")
    as_zstd = _as_codec(block, "zstd")
    with pytest.raises(CorruptRecord) as caught:
        decode_header(header).check_expected(as_zstd)
    assert caught.value.cause == "codec_mismatch"


def test_a_format_3_record_reads_as_raw():
    """Format 3 had no codec field: its layers are the engine's bytes, and a raw reader takes them."""
    space = Namespace("m", LAYOUT, block_tokens=16)
    block = space.blocks(range(16))[0]
    header_bytes, payload = build_record(block, bytes(space.block_bytes), LAYOUT.num_layers, "chat")
    tenant_end = 4 + 2 + 2 + 4 + 16 * 4 + 4 + 4 + 8 + 16
    body = bytearray(header_bytes[:tenant_end] + header_bytes[tenant_end + 4 : -8])
    struct.pack_into("<HHI", body, 4, 3, 0, len(body) + 8)
    old = decode_header(bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body))))
    assert (old.version, old.codec, old.layer_sums) == (3, 0, decode_header(header_bytes).layer_sums)
    old.check_expected(block)
    with pytest.raises(CorruptRecord, match="codec"):
        old.check_expected(_as_codec(block, "zstd"))


def _as_codec(block, name: str):
    return dataclasses.replace(block, codec=Namespace("m", layout(name), block_tokens=16).codec)


def test_a_quantised_layer_no_smaller_than_raw_is_stored_raw():
    """A block of one token: int8's float32 scales outweigh its codes, so the layer is kept as it is, exactly,
    in a slot no longer than any codec's bound."""
    geometry = LayerGeometry(2, 1, 64, "bfloat16")
    codec = BlockCodec(codec_named("int8"), geometry)
    raw = kv_like(LayerGeometry(2, 4, 64, "bfloat16"))[: geometry.raw_bytes]
    assert codec.encode(raw, 1)[1] == codec.max_slot_bytes and round_trip(codec, raw) == raw


def test_a_zstd_frame_declaring_another_size_is_refused_before_it_is_decoded():
    codec = BlockCodec(codec_named("int8"), GEOMETRY)
    huge = zstandard.ZstdCompressor().compress(bytes(1 << 20))  # checksums would hold: a writer's garbage
    with pytest.raises(CorruptLayer, match="frame of"):
        codec.decode(struct.pack("<I", len(huge)) + huge, memoryview(bytearray(GEOMETRY.raw_bytes)))


def test_a_record_naming_an_unknown_codec_is_a_bad_header():
    space = Namespace("m", LAYOUT, block_tokens=16)
    header_bytes, _ = build_record(space.blocks(range(16))[0], bytes(space.block_bytes), LAYOUT.num_layers, "chat")
    tenant_end = 4 + 2 + 2 + 4 + 16 * 4 + 4 + 4 + 8 + 16
    body = bytearray(header_bytes[:-8])
    struct.pack_into("<I", body, tenant_end, 99)
    with pytest.raises(CorruptRecord, match="unknown codec"):
        decode_header(bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body))))


# -- what `make mutate` found unpinned: the byte planes' bounds, the value runs, the bfloat16 rounding --------
def test_every_cut_of_a_byte_plane_encoding_and_bytes_after_it_are_refused_as_corrupt():
    """Cut anywhere, in a zstd'd plane or one stored raw, a layer is CorruptLayer, never another error; bytes
    after its last plane are counted."""
    geometry = LayerGeometry(2, 4, 16, "bfloat16")
    rng = np.random.default_rng(3)
    planes = np.stack([rng.integers(0, 256, geometry.raw_bytes // 2), np.full(geometry.raw_bytes // 2, 0x3F)], 1)
    raw = planes.astype(np.uint8).tobytes()  # byte 0 of each value noise (stored raw), byte 1 constant (zstd'd)
    zstd = codec_named("zstd")
    encoded = zstd.encode(raw, geometry)
    first = struct.unpack_from("<I", encoded)[0]
    assert first == (1 << 31) | geometry.raw_bytes // 2 and len(encoded) < geometry.raw_bytes + 8  # raw, then zstd
    out = memoryview(bytearray(geometry.raw_bytes))
    zstd.decode(memoryview(encoded), geometry, out)
    assert bytes(out) == raw
    for cut in range(len(encoded)):
        with pytest.raises(CorruptLayer):
            zstd.decode(memoryview(encoded[:cut]), geometry, out)
    with pytest.raises(CorruptLayer, match="^3 bytes after the last byte plane"):
        zstd.decode(memoryview(encoded + bytes(3)), geometry, out)


def test_an_unknown_codec_is_refused_naming_the_config_that_asked_for_it():
    with pytest.raises(ValueError, match="^server.toml: KV codec must be one of raw, zstd, int8, int4, got 'lz4'"):
        codec_named("lz4", "server.toml")
    with pytest.raises(ValueError, match="^KV codec must be one of"):
        codec_named("lz4")


def test_int4_values_share_a_step_over_runs_of_32_channels_and_other_widths_whole():
    """A value token's channels 0-31 1000x larger leave 32-63 as exact as without them (their own run); a
    width that 32 does not divide is one run a token, at any number of tokens."""
    geometry = LayerGeometry(2, 4, 64, "float32")
    values = np.random.default_rng(4).normal(size=(2, 4, 64)).astype(np.float32)
    values[1, :, :32] *= 1000
    got = as_float32(round_trip(BlockCodec(codec_named("int4"), geometry), to_dtype(values, "float32")), "float32")
    small = values[1, :, 32:]
    assert np.abs(got.reshape(values.shape)[1, :, 32:] - small).max() < np.abs(small).max() / 4
    odd = LayerGeometry(2, 3, 48, "bfloat16")
    raw = kv_like(LayerGeometry(2, 4, 48, "bfloat16"))[: odd.raw_bytes]
    back = as_float32(round_trip(BlockCodec(codec_named("int4"), odd), raw), "bfloat16")
    assert np.abs(back - as_float32(raw, "bfloat16")).max() < np.abs(as_float32(raw, "bfloat16")).max() / 4


def test_float32_to_bfloat16_rounds_to_nearest_and_ties_to_even():
    """What the quantisers decode into a bfloat16 layer, and the int4 parameters: IEEE round to nearest even."""
    from kvstore.codec import _bf16_round, _from_float32

    bits = np.array([0x3F800000, 0x3F807FFF, 0x3F808000, 0x3F808001, 0x3F818000, 0xBF818000], dtype=np.uint32)
    nearest = np.array([0x3F80, 0x3F80, 0x3F80, 0x3F81, 0x3F82, 0xBF82], dtype=np.uint16)  # ties: 0x3F80, 0x3F82
    out = bytearray(2 * len(bits))
    _from_float32(bits.view(np.float32), "bfloat16", memoryview(out))
    assert np.array_equal(np.frombuffer(out, "<u2"), nearest)
    assert np.array_equal(_bf16_round(bits.view(np.float32)).view(np.uint32), nearest.astype(np.uint32) << 16)


def test_a_quantised_layer_exactly_as_long_as_raw_is_stored_raw():
    """Nothing gained is nothing gained: an int4 encoding of exactly the raw length is not worth its loss. The
    layer is one whose encoding happens to land there (searched for: zstd's output length is not chosen)."""
    geometry = LayerGeometry(2, 1, 32, "bfloat16")
    int4 = codec_named("int4")
    for seed in range(1000):
        values = np.random.default_rng(seed).normal(size=geometry.raw_bytes // 2).astype(np.float32)
        raw = to_dtype(values, "bfloat16")
        if len(int4.encode(raw, geometry)) == geometry.raw_bytes:
            break
    else:
        pytest.fail("no layer of 1000 encodes to exactly its raw length")
    codec = BlockCodec(int4, geometry)
    stored, slot = codec.encode(raw, 1)
    assert struct.unpack_from("<I", stored)[0] == (1 << 31) | geometry.raw_bytes and round_trip(codec, raw) == raw


@pytest.mark.parametrize("name", ["zstd", "int8"])
def test_a_slot_whose_length_says_more_than_it_holds_is_refused(name):
    """Even by a byte, even where the bytes it does hold would decode."""
    codec = BlockCodec(codec_named(name), GEOMETRY)
    stored, _ = codec.encode(kv_like(GEOMETRY), 1)
    (length,) = struct.unpack_from("<I", stored)
    assert length == len(stored) - 4  # one layer: its slot has no padding
    for more in (1, 4):
        with pytest.raises(CorruptLayer, match="says it holds"):
            codec.decode(struct.pack("<I", length + more) + stored[4:], memoryview(bytearray(GEOMETRY.raw_bytes)))


def test_a_zstd_frame_with_bytes_after_it_is_refused():
    codec = BlockCodec(codec_named("int8"), GEOMETRY)
    stored, _ = codec.encode(kv_like(GEOMETRY), 1)
    (length,) = struct.unpack_from("<I", stored)
    with pytest.raises(CorruptLayer):
        codec.decode(struct.pack("<I", length + 3) + stored[4:] + b"\x00\x01\x02", memoryview(bytearray(
            GEOMETRY.raw_bytes)))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
def test_one_byte_kv_is_one_byte_a_value_and_only_lossless_codecs_take_it(dtype):
    geometry = LayerGeometry(2, 4, 8, dtype)
    assert geometry.raw_bytes == 2 * 4 * 8
    raw = bytes(range(geometry.raw_bytes))
    for name in ("raw", "zstd"):
        check_codec(name, dtype)
        assert round_trip(BlockCodec(codec_named(name), geometry), raw) == raw
    for name in ("int8", "int4"):
        with pytest.raises(ValueError, match="quantises"):
            check_codec(name, dtype)


def test_codec_blocks_are_immutable_and_hashable():
    """A block's codec is part of the frozen Block: blocks of a codec namespace are dict keys like any other."""
    block = Namespace("m", layout("int8"), block_tokens=16).blocks(range(16))[0]
    assert hash(block) == hash(dataclasses.replace(block))
    for value, field in ((block.codec, "codec"), (block.codec.geometry, "tokens")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_keys_share_a_scale_over_runs_of_64_tokens_only(name):
    """Keys 1000x larger from token 64 on leave tokens 0-63 as exact as without them: another run's scale."""
    geometry = LayerGeometry(2, 128, 8, "float32")
    values = np.random.default_rng(5).normal(size=(2, 128, 8)).astype(np.float32)
    values[0, 64:] *= 1000
    got = as_float32(round_trip(BlockCodec(codec_named(name), geometry), to_dtype(values, "float32")), "float32")
    first = values[0, :64]
    assert np.abs(got.reshape(values.shape)[0, :64] - first).max() < np.abs(first).max() / 4


def test_values_on_a_quantisers_own_grid_decode_exactly():
    """int8: a group of k/8 for k in -127..127 has scale 1/8 exactly; int4: a value run of k/2 for k in 0..15
    has minimum 0 and step 1/2 exactly. Such groups lose nothing, so the scale's divisor and the codes' range
    are pinned."""
    ks = np.arange(-127, 128, dtype=np.float32)
    geometry = LayerGeometry(1, 1, ks.size, "float32")  # one part: values, one group a token
    raw = to_dtype(ks / 8, "float32")
    assert round_trip(BlockCodec(codec_named("int8"), geometry), raw) == raw
    values = np.tile(np.arange(16, dtype=np.float32) / 2, 2)  # one run of 32 channels
    geometry = LayerGeometry(1, 1, 32, "float32")
    raw = to_dtype(values, "float32")
    assert round_trip(BlockCodec(codec_named("int4"), geometry), raw) == raw


def test_each_codecs_code_in_the_record_is_fixed():
    """The code is what a record's header names (format 4): renumbering one misreads every stored record."""
    assert {name: codec.code for name, codec in CODECS.items()} == {"raw": 0, "zstd": 1, "int8": 2, "int4": 3}

