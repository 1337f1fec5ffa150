"""Tenants inside one store: scoped reads, writes that cannot cross, records from before tenants."""

import os
import struct

import xxhash

from kvstore.block import KVLayout, Namespace, chain_hash
from kvstore.record import NO_TENANT, build_record, decode_header
from kvstore.server.outcomes import PutResult

from .conftest import read_all

LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=16, dtype="float16")
ALICE = Namespace("tenants", LAYOUT, block_tokens=8, salt="alice")
BOB = Namespace("tenants", LAYOUT, block_tokens=8, salt="bob")


def record(block, payload=None):
    header_bytes, payload = build_record(block, payload or os.urandom(ALICE.block_bytes), LAYOUT.num_layers, "chat")
    return decode_header(header_bytes), header_bytes, payload


def format_1(header_bytes: bytes) -> bytes:
    """The same header as format 1 wrote it: no tenant field (nor format 4's codec), version 1."""
    fixed = 4 + 2 + 2 + 4 + 16 * 4 + 4 + 4 + 8
    body = bytearray(header_bytes[:fixed] + header_bytes[fixed + 16 + 4 : -8])
    struct.pack_into("<HHI", body, 4, 1, 0, len(body) + 8)
    return bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body)))


async def test_a_scope_sees_only_its_tenants_blocks(open_store):
    store = await open_store()
    alices = [record(b) for b in ALICE.blocks(range(24))]
    for header, header_bytes, payload in alices:
        assert await store.put(header, header_bytes, [payload]) == PutResult.STORED
    keys = [h.key for h, _, _ in alices]
    alice, bob = frozenset({ALICE.tenant}), frozenset({BOB.tenant})
    assert store.lookup(keys, alice) == 3 and store.lookup(keys, bob) == 0 and store.lookup(keys) == 3
    assert (await store.open_block(keys[0], bob)).cause == "missing"
    assert await store.touch(keys, scope=bob) == 0 and store.advise(keys, True, scope=bob) == 0
    assert await store.delete(keys, scope=bob) == 0
    assert bytes(await read_all(store, keys[0])) == alices[0][2]
    assert await store.delete(keys[:1], scope=alice) == 1


async def test_a_put_under_another_tenants_key_changes_nothing(open_store):
    store = await open_store()
    block = ALICE.blocks(range(8))[0]
    header, header_bytes, payload = record(block)
    assert await store.put(header, header_bytes, [payload]) == PutResult.STORED
    # What a crafted hash collision would give: Bob's tenant on Alice's key (parse_record_header refuses
    # it before the store sees it, as its key is not H(bob ‖ parent ‖ tokens); the store holds out too).
    forged = type(block)(block.namespace, block.key, block.parent, block.tokens, BOB.tenant)
    f_header, f_bytes, f_payload = record(forged)
    assert await store.put(f_header, f_bytes, [f_payload]) == PutResult.STORED  # the answer a new block gets
    assert store.lookup([block.key], frozenset({BOB.tenant})) == 0
    assert bytes(await read_all(store, block.key)) == payload
    assert store.lookup([block.key], frozenset({ALICE.tenant})) == 1


async def test_a_record_from_before_tenants_is_read_as_no_tenants(open_store):
    store = await open_store()
    block = type(ALICE.blocks(range(8))[0])(bytes(16), chain_hash(bytes(16), range(8)), bytes(16), tuple(range(8)))
    header, header_bytes, payload = record(block)
    old_bytes = format_1(header_bytes)
    old = decode_header(old_bytes)
    assert old.tenant == NO_TENANT and old.key == header.key and old.layer_sums == header.layer_sums
    old.check_identity()
    assert await store.put(old, old_bytes, [payload]) == PutResult.STORED
    assert store.lookup([block.key]) == 1 and store.lookup([block.key], frozenset({ALICE.tenant})) == 0
    assert bytes(await read_all(store, block.key)) == payload
