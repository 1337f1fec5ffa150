import copy
import dataclasses

import numpy as np
import pytest
import xxhash

from kvstore.block import (
    KEY_BYTES,
    MAX_TOKEN_ID,
    NO_TENANT,
    ImageSpan,
    KVLayout,
    Namespace,
    NamespaceMismatch,
    chain_hash,
    encode_tokens,
    same_namespace,
    tenant_of,
)
from kvstore.codec import LayerGeometry

pytestmark = pytest.mark.unit

LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=4, dtype="float16")


def golden_namespace() -> Namespace:
    return Namespace("golden-model", LAYOUT, block_tokens=4, salt=b"tenant-a")


def test_golden_vectors_pin_the_key_encoding():
    # Fixed inputs -> fixed keys: an accidental change of encoding (token width, byte order, digest
    # fields) breaks every stored block of every user, so it must break this test first.
    ns = golden_namespace()
    assert ns.digest.hex() == "4b3a4dee1da6f5df0579df78b7f5ff33"
    assert [b.key.hex() for b in ns.blocks(range(10))] == [
        "8a571204f67dfd103c5cdbe7ae0233d3",
        "1df3de49982cadd09288d26acfeefd89",
    ]
    assert ns.tenant.hex() == "ff509d1df406993e9a8306af64fe2634"
    assert chain_hash(bytes(16), [0, 1, 2, 3]).hex() == "361d40d624bc45847cb55c04878d9596"  # format 1: no tenant


def test_key_is_xxh3_128_of_tenant_parent_and_little_endian_u32_tokens():
    ns = golden_namespace()
    first, second = ns.blocks(range(8))
    assert ns.tenant == xxhash.xxh3_128_digest(b"salt\x00tenant-a")
    assert first.key == xxhash.xxh3_128_digest(ns.tenant + ns.digest + np.arange(4, dtype="<u4").tobytes())
    assert second.parent == first.key
    assert second.key == xxhash.xxh3_128_digest(ns.tenant + first.key + np.arange(4, 8, dtype="<u4").tobytes())


def test_only_full_blocks_and_prefix_property():
    ns = golden_namespace()
    assert len(ns.blocks(range(11))) == 2
    assert ns.blocks([]) == []
    long, short = ns.blocks(range(12)), ns.blocks(range(8))
    assert [b.key for b in long[:2]] == [b.key for b in short]
    diverged = ns.blocks([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11])
    assert diverged[0].key == long[0].key and diverged[1].key != long[1].key and diverged[2].key != long[2].key


@pytest.mark.parametrize("change", [
    dict(model_id="other-model"),
    dict(salt=b"tenant-b"),
    dict(block_tokens=8),
    dict(layout=KVLayout(2, 1, 4, "bfloat16")),
    dict(layout=KVLayout(3, 1, 4, "float16")),
])
def test_any_namespace_field_changes_every_key(change):
    base = dict(model_id="golden-model", layout=LAYOUT, block_tokens=4, salt=b"tenant-a")
    a, b = Namespace(**base), Namespace(**{**base, **change})
    assert a.digest != b.digest
    assert a.blocks(range(8))[0].key != b.blocks(range(8))[0].key


def test_raw_salt_is_not_recoverable_from_the_digest():
    salt = b"super-secret-salt"
    ns = Namespace("m", LAYOUT, 4, salt=salt)
    assert salt not in ns.digest and salt not in repr(ns).encode()
    assert not hasattr(ns, "salt")


def test_the_tenant_alone_makes_the_namespace_its_salt_makes():
    """A process sent only the tenant (a decode instance, the encoder) keys exactly as the salt's holder."""
    by_salt = Namespace("m", LAYOUT, 4, salt="tenant-a")
    by_tenant = Namespace.of_tenant("m", LAYOUT, 4, tenant_of("tenant-a"))
    assert by_tenant.digest == by_salt.digest and by_tenant.tenant == by_salt.tenant
    assert by_tenant.blocks(range(8)) == by_salt.blocks(range(8))
    with pytest.raises(ValueError, match="16 bytes"):
        Namespace.of_tenant("m", LAYOUT, 4, b"tenant-a")  # a salt is not a tenant


def test_bad_input_raises_with_a_message():
    with pytest.raises(ValueError, match="model_id"):
        Namespace("", LAYOUT, 4)
    with pytest.raises(ValueError, match="block_tokens"):
        Namespace("m", LAYOUT, 0)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(2, 1, 4, "float64")
    with pytest.raises(ValueError, match="token ids"):
        golden_namespace().blocks([-1, 0, 1, 2])
    with pytest.raises(ValueError, match="token ids"):
        golden_namespace().blocks([2**32, 0, 1, 2])


def test_mixing_namespaces_in_one_call_is_an_error():
    a = golden_namespace().blocks(range(4))
    b = Namespace("golden-model", LAYOUT, 4, salt=b"tenant-b").blocks(range(4))
    with pytest.raises(NamespaceMismatch):
        same_namespace(a + b)
    assert same_namespace(a) == a[0].namespace


def test_layer_bytes_follow_the_layout():
    assert LAYOUT.layer_bytes(4) == 2 * 4 * 1 * 4 * 2  # (K/V, tokens, heads, head_dim) * fp16
    assert KVLayout(2, 1, 4, "float16", kv_per_layer=1).layer_bytes(4) == 4 * 4 * 2


# Each bound and product below was found unpinned by `make mutate`: moving it left every test above passing.

def test_the_largest_token_id_and_one_token_blocks_are_accepted():
    assert encode_tokens([0, MAX_TOKEN_ID]) == bytes(4) + b"\xff" * 4
    assert len(Namespace("m", LAYOUT, 1).blocks(range(3))) == 3


@pytest.mark.parametrize(("dtype", "size"), [("float32", 4), ("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1),
                                             ("int8", 1)])
def test_layer_bytes_count_each_dtypes_width(dtype, size):
    assert KVLayout(1, 1, 1, dtype, kv_per_layer=1).layer_bytes(1) == size


@pytest.mark.parametrize("field", ["num_layers", "kv_heads", "head_dim", "kv_per_layer"])
def test_every_layout_dimension_must_be_at_least_one(field):
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        KVLayout(**{"num_layers": 2, "kv_heads": 1, "head_dim": 4, field: 0})


def test_layer_and_block_bytes_multiply_every_dimension():
    layout = KVLayout(num_layers=3, kv_heads=2, head_dim=8, dtype="float32", kv_per_layer=2)
    assert layout.layer_bytes(4) == 2 * 4 * 2 * 8 * 4
    assert Namespace("m", layout, 4).block_bytes == 3 * 2 * 4 * 2 * 8 * 4


def test_a_codec_layout_binds_its_codec_and_a_raw_one_none():
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype="bfloat16", codec="zstd")
    bound = layout.block_codec(4)
    assert bound is not None and bound.code == 1
    assert bound.geometry == LayerGeometry(kv_per_layer=2, tokens=4, channels=16, dtype="bfloat16")
    assert Namespace("m", layout, 4).blocks(range(4))[0].codec == bound
    assert LAYOUT.block_codec(4) is None and golden_namespace().blocks(range(4))[0].codec is None


def test_another_model_id_keeps_the_tenant_and_needs_a_name():
    ns = golden_namespace()
    other = ns.with_model_id("other-model")
    assert other.tenant == ns.tenant and other.digest == Namespace("other-model", LAYOUT, 4, b"tenant-a").digest
    with pytest.raises(ValueError, match="model_id"):
        ns.with_model_id("")


def test_keys_are_key_bytes_long_and_a_zero_tenant_is_no_tenant():
    """The daemon checks a key's length against KEY_BYTES; a tenant of 16 zero bytes is format 1's none."""
    assert {len(block.key) for block in golden_namespace().blocks(range(12))} == {KEY_BYTES}
    assert NO_TENANT == bytes(16)
    assert chain_hash(bytes(16), [0, 1, 2, 3], bytes(16)) == chain_hash(bytes(16), [0, 1, 2, 3])


def test_blocks_and_layouts_are_immutable_and_hashable():
    """Blocks and layouts are dict keys and set members across the client; a field changed in place would
    move a key under its owner."""
    block = golden_namespace().blocks(range(4))[0]
    for value, field in ((block, "key"), (LAYOUT, "num_layers"), (ImageSpan(0, 5, bytes(16)), "start")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, 1)
        assert hash(value) == hash(copy.copy(value))
