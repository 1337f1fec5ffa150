"""KV codecs: the form a block's layers take in the store (docs/design.md section 3, docs/protocol.md).

A layer of KV is (kv_per_layer, tokens, channels) values of the engine's dtype, channels = kv_heads × head_dim;
for attention, [0] holds the keys and [1] the values. A codec turns it into fewer bytes and back:

    raw     the engine's bytes, as they are
    zstd    lossless: the bytes of each value regrouped by significance (a byte shuffle: a bf16's high bytes,
            sign and exponent, are far more alike than its low mantissa bytes), each plane zstd'd apart
    int8    keys per channel over runs of 64 tokens, values per token (the outliers of keys lie in a few
            channels, of values in a few tokens: KIVI, Liu et al., ICML 2024), symmetric int8 with float32
            scales, then zstd
    int4    the same grouping, asymmetric 4-bit (a minimum and a step per group), values in runs of 32
            channels per token; bfloat16 minima and steps; then zstd

Quantising codecs compute in float32 and round back to the engine's dtype on decoding. zstd runs with the
GIL released (the `zstandard` package), and so do numpy's array passes, so a load's decoding runs beside
the engine's threads.

The codec is part of a namespace (KVLayout.codec), so a block stored with one codec has another key than
the same block stored with another and is never read as it; the record names its codec too (format 4).

In a record, every layer slot is as long as the block's largest encoded layer, so that layer l still starts at
header_len + l × layer_bytes and a layer-major Get streams layer by layer:

    slot = length u32 (bit 31: the layer is stored raw) | encoded bytes | zeros to the slot's end

A layer that a codec cannot shrink is stored raw (bit 31), so no slot is longer than the raw layer plus its
4-byte length.

The codes name an encoding for good: a change to how a codec groups or lays out its bytes takes a new code
(and name), so that a record written before it is never decoded by the rules after it.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import zstandard

Buffer = bytes | bytearray | memoryview

_LENGTH = struct.Struct("<I")
_STORED_RAW = 1 << 31
# zstd's fastest level with entropy coding: on Gemma 3's bf16 KV its byte planes compressed no better at level 3
# (1.40x against level 1's 1.41x, measured over 16 blocks of real text when the codec was chosen)
ZSTD_LEVEL = 1
_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # what the quantising codecs read and write


class CorruptLayer(ValueError):
    """Encoded bytes that do not decode to a layer of the expected geometry."""


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    """One layer of one block: (kv_per_layer, tokens, channels) values of `dtype`."""

    kv_per_layer: int
    tokens: int
    channels: int
    dtype: str

    @property
    def raw_bytes(self) -> int:
        return self.kv_per_layer * self.tokens * self.channels * _ITEM_BYTES[self.dtype]


class KVCodec(Protocol):
    name: str
    code: int  # in the record header (format 4); 0 is raw
    lossless: bool

    def encode(self, layer: Buffer, geometry: LayerGeometry) -> bytes:
        """The encoded bytes of one raw layer."""

    def decode(self, data: memoryview, geometry: LayerGeometry, out: memoryview) -> None:
        """Write the raw layer `data` encodes into `out` (geometry.raw_bytes bytes). Raises CorruptLayer."""


# zstd contexts are not thread-safe: one per thread that encodes or decodes
_contexts = threading.local()


def _compress(data: Buffer) -> bytes:
    if not hasattr(_contexts, "compressor"):
        _contexts.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return _contexts.compressor.compress(data)


def _decompress(data: Buffer, size: int) -> bytes:
    """The `size` bytes a zstd frame holds; CorruptLayer for any other frame (one that declares another size
    is refused before a byte is allocated for it)."""
    if not hasattr(_contexts, "decompressor"):
        _contexts.decompressor = zstandard.ZstdDecompressor()
    try:
        declared = zstandard.frame_content_size(data)
        if declared != size:
            raise CorruptLayer(f"a zstd frame of {declared} bytes where the layer holds {size}")
        out = _contexts.decompressor.decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptLayer(f"zstd: {exc}") from exc
    if len(out) != size:
        raise CorruptLayer(f"zstd frame holds {len(out)} bytes, the layer {size}")
    return out


class Raw:
    name, code, lossless = "raw", 0, True

    def encode(self, layer: Buffer, geometry: LayerGeometry) -> bytes:
        return bytes(layer)

    def decode(self, data: memoryview, geometry: LayerGeometry, out: memoryview) -> None:
        if len(data) != geometry.raw_bytes:
            raise CorruptLayer(f"a raw layer of {len(data)} bytes, expected {geometry.raw_bytes}")
        out[:] = data


class ShuffleZstd:
    """Lossless: byte planes (every value's byte 0, then every byte 1, ...), each zstd-compressed on its own
    or, when that gains nothing (a bf16's low byte, mostly mantissa, is nearly 8 bits of entropy), kept as it
    is. Compressing the planes apart lets each use its own entropy table: 1.41x on Gemma 3's bf16 KV, against
    1.25x for the same planes in one frame (bench/compression.py)."""

    name, code, lossless = "zstd", 1, True

    def encode(self, layer: Buffer, geometry: LayerGeometry) -> bytes:
        item = _ITEM_BYTES[geometry.dtype]
        planes = np.frombuffer(layer, dtype=np.uint8).reshape(-1, item).T  # (item, values) bytes
        framed = []
        for plane in planes:
            plain = np.ascontiguousarray(plane)
            packed = _compress(plain.data)
            framed += [_LENGTH.pack(len(packed)), packed] if len(packed) < plain.size else \
                [_LENGTH.pack(plain.size | _STORED_RAW), plain.tobytes()]
        return b"".join(framed)

    def decode(self, data: memoryview, geometry: LayerGeometry, out: memoryview) -> None:
        item = _ITEM_BYTES[geometry.dtype]
        values = geometry.raw_bytes // item
        target = np.frombuffer(out, dtype=np.uint8).reshape(values, item)
        at = 0
        for byte in range(item):
            if at + _LENGTH.size > len(data):
                raise CorruptLayer("a byte plane is cut short")
            (length,) = _LENGTH.unpack_from(data, at)
            stored_raw, length = bool(length & _STORED_RAW), length & ~_STORED_RAW
            at += _LENGTH.size
            if at + length > len(data) or (stored_raw and length != values):
                raise CorruptLayer(f"byte plane {byte} of {length} bytes does not fit")
            plane = data[at : at + length] if stored_raw else _decompress(data[at : at + length], values)
            target[:, byte] = np.frombuffer(plane, dtype=np.uint8)
            at += length
        if at != len(data):
            raise CorruptLayer(f"{len(data) - at} bytes after the last byte plane")


def _to_float32(layer: Buffer, geometry: LayerGeometry) -> np.ndarray:
    """(kv_per_layer, tokens, channels) float32 of a raw layer."""
    shape = (geometry.kv_per_layer, geometry.tokens, geometry.channels)
    if geometry.dtype == "bfloat16":
        bits = np.frombuffer(layer, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(layer, dtype="<" + {"float32": "f4", "float16": "f2"}[geometry.dtype]) \
        .astype(np.float32).reshape(shape)


def _from_float32(values: np.ndarray, dtype: str, out: memoryview) -> None:
    """Write float32 `values` into `out` in `dtype`, rounding to nearest even."""
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).ravel()
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        np.frombuffer(out, dtype="<u2")[:] = rounded
    else:
        np.frombuffer(out, dtype="<" + {"float32": "f4", "float16": "f2"}[dtype])[:] = values.ravel()


def _bf16_round(values: np.ndarray) -> np.ndarray:
    """float32 `values` rounded to the nearest bfloat16, as float32 (what a bf16 parameter decodes to)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return (((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16).astype(np.uint32).view(np.float32)


def _split(data: memoryview, sizes: Sequence[int]) -> list[memoryview]:
    if sum(sizes) != len(data):
        raise CorruptLayer(f"{len(data)} bytes where the geometry needs {sum(sizes)}")
    parts, at = [], 0
    for size in sizes:
        parts.append(data[at : at + size])
        at += size
    return parts


KEY_GROUP_TOKENS = 64  # keys share a scale per channel over runs of this many tokens (KIVI groups 32-128)
INT4_VALUE_RUN = 32  # int4 values share a scale per token over runs of this many channels


def _group_shape(keys: bool, run: int, tokens: int, channels: int) -> tuple[int, int]:
    """(groups, members) of one part: a key group is a channel over a run of KEY_GROUP_TOKENS tokens (the last
    run padded), a value group a run of `run` channels of one token."""
    if keys:
        return -(-tokens // KEY_GROUP_TOKENS) * channels, min(tokens, KEY_GROUP_TOKENS)
    run = run if channels % run == 0 else channels
    return tokens * channels // run, run


def _grouped(part: np.ndarray, keys: bool, run: int) -> np.ndarray:
    """`part` (tokens, channels) as (groups, members) (_group_shape); a key run past the last token repeats it,
    which widens no group's range."""
    tokens, channels = part.shape
    groups, members = _group_shape(keys, run, tokens, channels)
    if not keys:
        return part.reshape(groups, members)
    runs = groups // channels
    padded = np.pad(part, ((0, runs * members - tokens), (0, 0)), mode="edge")  # (runs * members, channels)
    return padded.reshape(runs, members, channels).transpose(0, 2, 1).reshape(groups, members)


def _ungrouped(groups: np.ndarray, keys: bool, tokens: int, channels: int) -> np.ndarray:
    """The inverse of _grouped: (tokens, channels)."""
    if not keys:
        return groups.reshape(tokens, channels)
    members = groups.shape[1]
    runs = groups.shape[0] // channels
    return groups.reshape(runs, channels, members).transpose(0, 2, 1).reshape(runs * members, channels)[:tokens]


def _parts(geometry: LayerGeometry) -> list[bool]:
    """Per part of a layer, whether it holds keys (grouped per channel): K of K and V; a latent vector is not."""
    return [i == 0 and geometry.kv_per_layer == 2 for i in range(geometry.kv_per_layer)]


class Int8:
    """Keys per channel (over runs of KEY_GROUP_TOKENS tokens), values per token: symmetric int8, a float32
    scale per group, then zstd."""

    name, code, lossless = "int8", 2, False

    def encode(self, layer: Buffer, geometry: LayerGeometry) -> bytes:
        kv = _to_float32(layer, geometry)  # (kv, tokens, channels)
        pieces = []
        for part, keys in zip(kv, _parts(geometry)):
            groups = _grouped(part, keys, geometry.channels)  # (groups, members)
            scale = np.abs(groups).max(axis=1, keepdims=True) / 127.0
            scale[scale == 0] = 1.0
            codes = np.clip(np.rint(groups / scale), -127, 127).astype(np.int8)
            pieces += [scale.astype("<f4").tobytes(), codes.tobytes()]
        return _compress(b"".join(pieces))

    def decode(self, data: memoryview, geometry: LayerGeometry, out: memoryview) -> None:
        t, c = geometry.tokens, geometry.channels
        shapes = [_group_shape(keys, c, t, c) for keys in _parts(geometry)]
        sizes = [size for groups, members in shapes for size in (4 * groups, groups * members)]
        parts = _split(memoryview(_decompress(data, sum(sizes))), sizes)
        values = np.empty((geometry.kv_per_layer, t, c), dtype=np.float32)
        for i, ((groups, members), keys) in enumerate(zip(shapes, _parts(geometry))):
            scale = np.frombuffer(parts[2 * i], dtype="<f4").reshape(groups, 1)
            codes = np.frombuffer(parts[2 * i + 1], dtype=np.int8).reshape(groups, members)
            values[i] = _ungrouped(codes * scale, keys, t, c)
        _from_float32(values, geometry.dtype, out)


class Int4:
    """Keys per channel (over runs of KEY_GROUP_TOKENS tokens), values per token in runs of INT4_VALUE_RUN
    channels: asymmetric 4-bit codes, a bfloat16 minimum and step per group, two codes a byte, then zstd."""

    name, code, lossless = "int4", 3, False

    def encode(self, layer: Buffer, geometry: LayerGeometry) -> bytes:
        kv = _to_float32(layer, geometry)
        pieces = []
        for part, keys in zip(kv, _parts(geometry)):
            groups = _grouped(part, keys, INT4_VALUE_RUN)  # (groups, members)
            low = _bf16_round(groups.min(axis=1, keepdims=True))
            step = _bf16_round((groups.max(axis=1, keepdims=True) - low) / 15.0)
            step[step == 0] = 1.0
            codes = np.clip(np.rint((groups - low) / step), 0, 15).astype(np.uint8).ravel()
            if codes.size % 2:
                codes = np.append(codes, np.uint8(0))
            packed = codes[0::2] | (codes[1::2] << 4)
            pieces += [(np.concatenate([low, step], axis=1).astype(np.float32).view(np.uint32) >> 16)
                       .astype("<u2").tobytes(), packed.tobytes()]
        return _compress(b"".join(pieces))

    def decode(self, data: memoryview, geometry: LayerGeometry, out: memoryview) -> None:
        t, c = geometry.tokens, geometry.channels
        shapes = [_group_shape(keys, INT4_VALUE_RUN, t, c) for keys in _parts(geometry)]
        sizes = [size for groups, members in shapes for size in (groups * 2 * 2, (groups * members + 1) // 2)]
        parts = _split(memoryview(_decompress(data, sum(sizes))), sizes)
        values = np.empty((geometry.kv_per_layer, t, c), dtype=np.float32)
        for i, ((groups, members), keys) in enumerate(zip(shapes, _parts(geometry))):
            params = (np.frombuffer(parts[2 * i], dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            params = params.reshape(groups, 2)
            packed = np.frombuffer(parts[2 * i + 1], dtype=np.uint8)
            codes = np.empty(packed.size * 2, dtype=np.uint8)
            codes[0::2], codes[1::2] = packed & 0xF, packed >> 4
            decoded = codes[: groups * members].reshape(groups, members) * params[:, 1:] + params[:, :1]
            values[i] = _ungrouped(decoded, keys, t, c)
        _from_float32(values, geometry.dtype, out)


CODECS: dict[str, KVCodec] = {codec.name: codec for codec in (Raw(), ShuffleZstd(), Int8(), Int4())}
BY_CODE: dict[int, KVCodec] = {codec.code: codec for codec in CODECS.values()}
RAW = "raw"
DEFAULT = "zstd"  # lossless: what an engine stores unless it chooses otherwise (docs/performance.md says why)


def codec_named(name: str, owner: str = "") -> KVCodec:
    """The codec called `name`; a ValueError naming the choices (and `owner`, a config's name) for any other."""
    if name not in CODECS:
        raise ValueError(f"{owner + ': ' if owner else ''}KV codec must be one of {', '.join(CODECS)}, got {name!r}")
    return CODECS[name]


def check_codec(name: str, dtype: str) -> None:
    """Refuse a codec that cannot encode KV of `dtype`."""
    codec = codec_named(name)
    if not codec.lossless and dtype not in _FLOAT_DTYPES:
        raise ValueError(f"the {name} codec quantises {', '.join(_FLOAT_DTYPES)} KV, not {dtype}")


@dataclass(frozen=True, slots=True)
class BlockCodec:
    """A codec bound to the layers of one namespace's blocks: what the client encodes before a put and
    decodes as layers arrive."""

    codec: KVCodec
    geometry: LayerGeometry

    @property
    def code(self) -> int:
        return self.codec.code

    @property
    def max_slot_bytes(self) -> int:
        """The longest slot a layer of this geometry is stored in: raw, with its length (lossy codecs and
        zstd'd layers are shorter)."""
        return self.geometry.raw_bytes + _LENGTH.size

    def encode(self, payload: Buffer, num_layers: int) -> tuple[bytes, int]:
        """(the record's layer-major payload of equal slots, the slot's length) of a raw layer-major payload."""
        raw = self.geometry.raw_bytes
        view = memoryview(payload).cast("B")
        if len(view) != num_layers * raw:
            raise ValueError(f"a payload of {len(view)} bytes is not {num_layers} layers of {raw}")
        framed = []
        for layer in range(num_layers):
            plain = view[layer * raw : (layer + 1) * raw]
            encoded = self.codec.encode(plain, self.geometry)
            if len(encoded) >= raw:  # nothing gained (a lossless codec on noise, a quantiser's scales on a
                # block of a token or two): keep the layer as it is
                framed.append(_LENGTH.pack(raw | _STORED_RAW) + bytes(plain))
            else:
                framed.append(_LENGTH.pack(len(encoded)) + encoded)
        slot = max(len(f) for f in framed)
        return b"".join(f.ljust(slot, b"\x00") for f in framed), slot

    def decode(self, slot: Buffer, out: memoryview) -> None:
        """Write the raw layer a stored slot holds into `out`. Raises CorruptLayer."""
        view = memoryview(slot).cast("B")
        if len(view) < _LENGTH.size:
            raise CorruptLayer(f"a slot of {len(view)} bytes")
        (length,) = _LENGTH.unpack_from(view)
        stored_raw, length = bool(length & _STORED_RAW), length & ~_STORED_RAW
        if length > len(view) - _LENGTH.size:
            raise CorruptLayer(f"a slot of {len(view)} bytes says it holds {length}")
        data = view[_LENGTH.size : _LENGTH.size + length]
        if stored_raw:
            CODECS[RAW].decode(data, self.geometry, out)
        else:
            self.codec.decode(data, self.geometry, out)
