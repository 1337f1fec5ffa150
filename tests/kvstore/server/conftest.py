"""In-process BlockStore fixtures: real LMDB and segment files, an injected clock, no gRPC."""

import os

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.record import build_record, decode_header
from kvstore.server.config import ServerConfig
from kvstore.server.outcomes import PutResult
from kvstore.server.store import BlockStore

NS = Namespace("store-test", KVLayout(num_layers=4, kv_heads=1, head_dim=16, dtype="float16"), block_tokens=8)


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def records(n: int, traffic_class: str = "chat", seed: int = 0, namespace: Namespace = NS):
    """(block, header_bytes, header, payload) for the n blocks of one prompt."""
    out = []
    for block in namespace.blocks(range(seed * 100_000, seed * 100_000 + n * namespace.block_tokens)):
        header_bytes, payload = build_record(block, os.urandom(namespace.block_bytes), namespace.num_layers,
                                             traffic_class)
        out.append((block, header_bytes, decode_header(header_bytes), payload))
    return out


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
async def open_store(tmp_path, clock):
    """open_store(**config) -> an opened BlockStore on tmp_path/data; closed at the end."""
    stores = []

    async def make(**overrides) -> BlockStore:
        config = ServerConfig(data_dir=tmp_path / "data", **overrides)
        store = BlockStore(config, clock=clock)
        await store.open()
        stores.append(store)
        return store

    yield make
    for store in stores:
        if not store.closed:
            await store.close()


async def put_all(store: BlockStore, recs) -> list[PutResult]:
    return [await store.put(header, header_bytes, [payload]) for _, header_bytes, header, payload in recs]


async def read_all(store: BlockStore, key: bytes, begin: int = 0, end: int | None = None):
    """The verified payload of layers [begin, end) of `key`, or the Miss."""
    found = await store.open_block(key)
    if not hasattr(found, "header"):
        return found
    try:
        return await store.read_layers(found, begin, end or found.header.n_layers)
    finally:
        store.close_block(found)
