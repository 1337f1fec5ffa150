"""Block identity: namespace digests and chained block keys (docs/design.md section 3).

A block key is a pure function of the namespace and the token ids up to and including its block:

    key_0 = H(namespace_digest ‖ tokens_0)      key_i = H(key_{i-1} ‖ tokens_i)

with H = 128-bit xxh3 and token ids encoded as little-endian uint32. Nothing depends on process state
(PYTHONHASHSEED, dict order), so two engines on two machines compute the same keys; golden vectors in
the tests pin the encoding.

An image enters a prompt as a run of placeholder tokens. For identity, each placeholder is replaced by an id
drawn from the image's content digest (`identity_tokens`), so that a block's key covers every image whose
placeholders fall in or before it; the ids lie in [2**31, 2**32), where no vocabulary's ids do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.codec import RAW, BlockCodec, LayerGeometry, check_codec, codec_named

KEY_BYTES = 16
NO_TENANT = bytes(16)  # the tenant of a record written before records named one (format 1)
MAX_TOKEN_ID = 2**32 - 1
IMAGE_ID_BASE = 1 << 31  # an image placeholder's identity id: 31 bits of its image's digest, above every vocabulary
# Placeholders that carry an image's whole identity: 5 x 31 = 155 bits, more than a key's 128. A hit that ends in
# a block holding fewer of an image's first placeholders than this is cut back to before that block
# (`image_safe_prefix`), so an image's identity in a key is never weaker than the key itself.
IMAGE_SURE_PLACEHOLDERS = 5


class NamespaceMismatch(ValueError):
    """Blocks of two namespaces were mixed in one operation."""


def chain_hash(parent: bytes, tokens: Sequence[int] | np.ndarray, tenant: bytes = NO_TENANT) -> bytes:
    """The key of a block of `tenant` whose predecessor key (or namespace digest) is `parent`.

    The tenant enters every key, not only the namespace, so that a daemon can check from a record alone
    that its key belongs to the tenant it names: no writer can put a record under another tenant's key.
    (Keys of format-1 records, which name no tenant, are H(parent ‖ tokens).)"""
    prefix = b"" if tenant == NO_TENANT else tenant
    return xxhash.xxh3_128_digest(prefix + parent + encode_tokens(tokens))


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    array = np.asarray(tokens, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {array.shape}")
    if array.size and (array.min() < 0 or array.max() > MAX_TOKEN_ID):
        raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return array.astype("<u4").tobytes()


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """An image in a prompt: its placeholders are tokens [start, start + length), its content hash `digest`."""

    start: int
    length: int
    digest: bytes  # (16,) e.g. blake2b-128 of its decoded pixels and their shape (engine/vision/images.py)

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < IMAGE_SURE_PLACEHOLDERS:
            raise ValueError(f"an image needs start >= 0 and at least {IMAGE_SURE_PLACEHOLDERS} placeholders "
                             f"(its identity is 31 bits a placeholder), got start={self.start} length={self.length}")
        if len(self.digest) != 16:
            raise ValueError(f"an image's digest is 16 bytes, got {len(self.digest)}")


def image_identity_ids(digest: bytes, length: int) -> list[int]:
    """The identity ids of an image's `length` placeholders: 31 bits each of xxh3_64(digest ‖ index), high bit set."""
    return [IMAGE_ID_BASE | (xxhash.xxh3_64_intdigest(digest + j.to_bytes(4, "little")) & (IMAGE_ID_BASE - 1))
            for j in range(length)]


def identity_tokens(tokens: Sequence[int] | np.ndarray, images: Sequence[ImageSpan] = ()) -> list[int]:
    """The ids a prompt's blocks are keyed by: its tokens, with each image's placeholders replaced by ids drawn
    from the image's digest. Two prompts alike but for one image share exactly the blocks before it. `tokens`
    may be a leading part of the prompt (an image past its end is cut); ValueError for images that overlap."""
    ids = [int(t) for t in tokens]
    end = 0
    for image in images:
        if image.start < end:
            raise ValueError(f"image at {image.start} overlaps the one before it (placeholders up to {end})")
        end = image.start + image.length
        if image.start < len(ids):
            ids[image.start : end] = image_identity_ids(image.digest, image.length)[: len(ids) - image.start]
    return ids


def image_safe_prefix(blocks: int, images: Sequence[ImageSpan], block_tokens: int) -> int:
    """`blocks` leading blocks found, cut back so that no hit ends in a block that holds fewer than
    IMAGE_SURE_PLACEHOLDERS of an image's first placeholders (those would carry under 128 bits of it)."""
    for image in images:
        first = image.start // block_tokens
        sure = (image.start + IMAGE_SURE_PLACEHOLDERS - 1) // block_tokens
        if first < blocks <= sure:
            return first
    return blocks


def tenant_of(salt: bytes | str) -> bytes:
    """The tenant digest of a namespace salt: what a daemon's tokens are scoped to (`kvstore tenant SALT`)."""
    salt_bytes = salt.encode() if isinstance(salt, str) else bytes(salt)
    return xxhash.xxh3_128_digest(b"salt\x00" + salt_bytes)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one token's persisted KV looks like; part of the namespace, so layouts never mix."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    kv_per_layer: int = 2  # K and V; 1 for an MLA-style latent vector
    codec: str = RAW  # the form its layers take in the store (kvstore/codec.py): raw, zstd, int8 or int4

    _DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "kv_per_layer"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in self._DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(self._DTYPE_BYTES)}, got {self.dtype!r}")
        check_codec(self.codec, self.dtype)

    def layer_bytes(self, block_tokens: int) -> int:
        """Bytes of one layer of one block: (kv_per_layer, block_tokens, kv_heads, head_dim)."""
        return self.kv_per_layer * block_tokens * self.kv_heads * self.head_dim * self._DTYPE_BYTES[self.dtype]

    def block_codec(self, block_tokens: int) -> BlockCodec | None:
        """The codec bound to a block's layers; None for raw, which stores the engine's bytes as they are."""
        if self.codec == RAW:
            return None
        geometry = LayerGeometry(self.kv_per_layer, block_tokens, self.kv_heads * self.head_dim, self.dtype)
        return BlockCodec(codec_named(self.codec), geometry)


@dataclass(frozen=True, slots=True)
class Block:
    """One full block of a prompt: its key, its parent's key and its token ids."""

    namespace: bytes  # (16,) digest of the Namespace it belongs to
    key: bytes  # (16,)
    parent: bytes  # (16,) the previous block's key, or the namespace digest for the first block
    tokens: tuple[int, ...]
    tenant: bytes = NO_TENANT  # (16,) the digest of the namespace's salt: who owns the block (Namespace.tenant)
    # how its layers are encoded in the store (the namespace's KVLayout.codec); None: raw, as the engine holds them
    codec: BlockCodec | None = None


class Namespace:
    """Everything that must match for two prefixes to share KV: model, layout, block size, tenant.

    The raw salt is folded into the digest and then dropped; it is never stored, logged or exposed.
    """

    __slots__ = ("model_id", "layout", "block_tokens", "digest", "tenant", "codec")

    def __init__(self, model_id: str, layout: KVLayout, block_tokens: int, salt: bytes | str = b"") -> None:
        salt_bytes = salt.encode() if isinstance(salt, str) else bytes(salt)
        # The salt enters only through its own digest, so the namespace digest reveals nothing of it. That
        # digest is the tenant: daemons scope tokens to it and keep it with every block.
        self._set(model_id, layout, block_tokens, tenant_of(salt_bytes))

    @classmethod
    def of_tenant(cls, model_id: str, layout: KVLayout, block_tokens: int, tenant: bytes) -> Namespace:
        """The namespace of the tenant whose salt's digest is `tenant` (`tenant_of`): the one made from the salt.
        A process that is sent the tenant, never the salt (a decode instance, the vision encoder), keys with
        this, so the salt never leaves the process that holds it."""
        if not isinstance(tenant, bytes | bytearray) or len(tenant) != KEY_BYTES:
            raise ValueError(f"a tenant is {KEY_BYTES} bytes (tenant_of(salt)), got {tenant!r:.40}")
        space = object.__new__(cls)
        space._set(model_id, layout, block_tokens, bytes(tenant))
        return space

    def _set(self, model_id: str, layout: KVLayout, block_tokens: int, tenant: bytes) -> None:
        if not model_id:
            raise ValueError("Namespace.model_id must be a non-empty model identity, e.g. 'Qwen/Qwen3-8B@rev'")
        if block_tokens < 1:
            raise ValueError(f"Namespace.block_tokens must be >= 1, got {block_tokens}")
        self.model_id = model_id
        self.layout = layout
        self.block_tokens = block_tokens
        self.tenant = tenant
        self.codec = layout.block_codec(block_tokens)
        fields: dict[str, int | str] = {
            "v": 1,
            "model": model_id,
            "layers": layout.num_layers,
            "kv_heads": layout.kv_heads,
            "head_dim": layout.head_dim,
            "dtype": layout.dtype,
            "kv_per_layer": layout.kv_per_layer,
            "block_tokens": block_tokens,
        }
        if layout.codec != RAW:  # named only when not raw, so the digests of raw namespaces stay as they were
            fields["codec"] = layout.codec
        identity = json.dumps(
            fields,
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        self.digest = xxhash.xxh3_128_digest(identity + b"\x00" + tenant)

    def with_model_id(self, model_id: str) -> Namespace:
        """The same tenant, layout and block size under another model identity: a chain of its own that
        no block of this one's ever hits (an engine keeps approximate KV apart from exact KV this way)."""
        if not model_id:
            raise ValueError("Namespace.model_id must be a non-empty model identity")
        other = object.__new__(Namespace)
        other._set(model_id, self.layout, self.block_tokens, self.tenant)
        return other

    @property
    def layer_bytes(self) -> int:
        return self.layout.layer_bytes(self.block_tokens)

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def block_bytes(self) -> int:
        return self.layer_bytes * self.layout.num_layers

    def blocks(self, tokens: Sequence[int] | np.ndarray) -> list[Block]:
        """The full blocks of `tokens`, in prefix order; a trailing partial block is not a block."""
        array = np.asarray(tokens, dtype=np.int64)
        full = len(array) // self.block_tokens
        out: list[Block] = []
        parent = self.digest
        for i in range(full):
            chunk = array[i * self.block_tokens : (i + 1) * self.block_tokens]
            key = chain_hash(parent, chunk, self.tenant)
            out.append(Block(self.digest, key, parent, tuple(int(t) for t in chunk), self.tenant, self.codec))
            parent = key
        return out

    def __repr__(self) -> str:
        return f"Namespace(model_id={self.model_id!r}, block_tokens={self.block_tokens}, digest={self.digest.hex()})"


def same_namespace(blocks: Sequence[Block]) -> bytes | None:
    """The namespace shared by `blocks`; raises NamespaceMismatch if they mix namespaces."""
    if not blocks:
        return None
    namespace = blocks[0].namespace
    for block in blocks:
        if block.namespace != namespace:
            raise NamespaceMismatch("one call mixes blocks of two namespaces; split it per namespace")
    return namespace
