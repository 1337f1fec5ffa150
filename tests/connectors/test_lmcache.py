"""The LMCache plug-in through LMCache's own RemoteBackend and LocalCPUBackend, over a real daemon
(`make test-connectors`, in the LMCache venv that deploy/connectors/venv.sh builds)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

lmcache = pytest.importorskip("lmcache", reason="the LMCache venv: make test-connectors")
torch = pytest.importorskip("torch")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

pytestmark = pytest.mark.connectors

CHUNK, LAYERS, HEADS, HEAD_DIM = 256, 2, 2, 8
MISS_DEADLINE_S = 30.0  # a hang guard on waits that a dead daemon ends: the client's own deadlines end them first


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _backend(loop, servers: str, model: str = "m", worker: int = 0, tenant: str = ""):
    extra = {"remote_storage_plugin.kvstore.module_path": "kvstore.connectors.lmcache",
             "remote_storage_plugin.kvstore.class_name": "KVStoreConnectorAdapter",
             "remote_storage_plugin.kvstore.servers": servers,
             "remote_storage_plugin.kvstore.timeout_s": 2.0,
             "remote_storage_plugin.kvstore.tenant": tenant,
             "remote_storage_plugin.kvstore.model_id": model}  # "m" is no model folder: the operator's promise
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05,
                                               remote_storage_plugins=["kvstore"], extra_config=extra)
    metadata = LMCacheMetadata(model_name=model, world_size=2, local_world_size=2, worker_id=worker,
                               local_worker_id=worker, kv_dtype=torch.float16,
                               kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM))
    local = LocalCPUBackend(config, metadata)
    remote = RemoteBackend(config, metadata, loop, local, dst_device="cpu", plugin_name="kvstore")
    assert remote.connection is not None, "the plug-in was not loaded"
    return local, remote, metadata


def _key(metadata, chunk_hash: int) -> CacheEngineKey:
    return CacheEngineKey(metadata.model_name, metadata.world_size, metadata.worker_id, chunk_hash, torch.float16)


def _chunk(local, metadata, seed: int, tokens: int = CHUNK):
    obj = local.allocate(metadata.get_shapes(), metadata.get_dtypes(), MemoryFormat.KV_2LTD)
    values = torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed)).to(torch.float16)
    obj.tensor.copy_(values)
    if tokens < CHUNK:  # the last chunk of a prompt: fewer tokens, as LMCache hands it over
        obj = local.allocate([torch.Size([2, LAYERS, tokens, HEADS * HEAD_DIM])], metadata.get_dtypes(),
                             MemoryFormat.KV_2LTD)
        obj.tensor.copy_(values[:, :, :tokens])
    return obj


def _stored(remote, keys, objs) -> None:
    """Put through LMCache's batched path, and wait until the put is done: LMCache holds an extra reference
    on each chunk until then (a batched put is not in `put_tasks`). A reference leaked never comes back."""
    before = [obj.get_ref_count() for obj in objs]
    remote.batched_submit_put_task(keys, objs)
    deadline = time.monotonic() + 30
    while [obj.get_ref_count() for obj in objs] != before:
        assert time.monotonic() < deadline, f"a put leaked a reference: {[o.get_ref_count() for o in objs]}"
        time.sleep(0.01)


def test_chunks_round_trip_whole_and_partial_with_no_reference_leaked(loop, daemons):
    (daemon,) = daemons(1)
    local, remote, metadata = _backend(loop, daemon.address)
    keys = [_key(metadata, h) for h in (11, 12, 13)]
    objs = [_chunk(local, metadata, 1), _chunk(local, metadata, 2), _chunk(local, metadata, 3, tokens=100)]
    _stored(remote, keys, objs)
    assert remote.batched_contains(keys) == 3
    for key, obj in zip(keys, objs):
        got = remote.get_blocking(key)
        assert got is not None and got.get_shapes() == obj.get_shapes()
        assert bytes(got.byte_array) == bytes(obj.byte_array), "the bytes LMCache gets are the bytes it put"
        got.ref_count_down()
    for obj in objs:
        obj.ref_count_down()
    remote.close()


def test_a_miss_in_a_batch_ends_the_leading_run_and_gives_back_what_followed(loop, daemons):
    (daemon,) = daemons(1)
    local, remote, metadata = _backend(loop, daemon.address)
    keys = [_key(metadata, h) for h in (21, 22, 23, 24)]
    objs = [_chunk(local, metadata, seed) for seed in range(4)]
    _stored(remote, [keys[0], keys[1], keys[3]], [objs[0], objs[1], objs[3]])  # 23 is missing
    connection = remote.connection
    assert remote.batched_contains(keys) == 2
    assert asyncio.run_coroutine_threadsafe(connection.batched_async_contains("l", keys), loop).result() == 2
    got = asyncio.run_coroutine_threadsafe(connection.batched_get_non_blocking("l", keys), loop).result()
    assert [bytes(g.byte_array) for g in got] == [bytes(o.byte_array) for o in objs[:2]]
    for obj in got + objs:
        obj.ref_count_down()
    remote.close()


def test_identities_keep_models_ranks_and_tenants_apart(loop, daemons):
    (daemon,) = daemons(1)
    local, remote, metadata = _backend(loop, daemon.address)
    key = _key(metadata, 31)
    _stored(remote, [key], [_chunk(local, metadata, 5)])
    for model, worker, tenant in [("other", 0, ""), ("m", 1, ""), ("m", 0, "team-b")]:
        _, other, other_metadata = _backend(loop, daemon.address, model, worker, tenant)
        same_hash = _key(other_metadata, 31)
        assert not other.contains(same_hash) and other.get_blocking(same_hash) is None
        other.close()
    assert remote.contains(key)
    remote.close()


@pytest.mark.kills_daemons  # left dead on purpose: a dead daemon is what it tests
def test_a_dead_daemon_is_a_miss_within_the_deadline(loop, daemons):
    (daemon,) = daemons(1)
    local, remote, metadata = _backend(loop, daemon.address)
    key = _key(metadata, 41)
    _stored(remote, [key], [_chunk(local, metadata, 6)])
    daemon.kill()
    assert not remote.contains(key)
    assert remote.get_blocking(key) is None
    assert remote.batched_contains([key]) == 0
    remote.batched_submit_put_task([_key(metadata, 42)], [_chunk(local, metadata, 7)])  # no exception either
    remote.close()


def test_a_get_with_lmcaches_memory_full_is_a_miss_and_then_a_hit_once_it_frees(loop, daemons):
    """LMCache's allocator waits for memory by default; a batch holding that memory itself would wait forever."""
    (daemon,) = daemons(1)
    local, remote, metadata = _backend(loop, daemon.address)
    keys = [_key(metadata, h) for h in (31, 32)]
    objs = [_chunk(local, metadata, seed) for seed in (31, 32)]
    _stored(remote, keys, objs)
    held = []
    while (obj := local.allocate(metadata.get_shapes(), metadata.get_dtypes(), MemoryFormat.KV_2LTD,
                                 busy_loop=False)) is not None:
        held.append(obj)
    answers: list = []
    reader = threading.Thread(target=lambda: answers.append(remote.batched_get_blocking(keys)), daemon=True)
    reader.start()
    reader.join(MISS_DEADLINE_S)  # a hang guard: the answer comes at once
    assert answers == [[None, None]], "memory full: a miss"
    for obj in held + objs:
        obj.ref_count_down()
    got = remote.batched_get_blocking(keys)
    assert [g is not None for g in got] == [True, True]
    for obj in got:
        obj.ref_count_down()
    remote.close()
