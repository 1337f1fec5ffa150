"""LMCache 0.5.6's RemoteBackend (batched_submit_put_task, batched_get_blocking) and its LocalCPUBackend
allocator, the path LMCache itself takes, into the plug-in; chunks of [2, 8, 256, 512] float16 (4 MiB)."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

CHUNK, LAYERS, HEADS, HEAD_DIM = 256, 8, 4, 128


class Path:
    page_bytes = 2 * LAYERS * CHUNK * HEADS * HEAD_DIM * 2

    def __init__(self, address: str, pages: int) -> None:
        self.pages = pages
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        extra = {"remote_storage_plugin.kvstore.module_path": "kvstore.connectors.lmcache",
                 "remote_storage_plugin.kvstore.class_name": "KVStoreConnectorAdapter",
                 "remote_storage_plugin.kvstore.servers": address}
        cpu_gb = 3 * pages * self.page_bytes / 2**30 + 0.1  # the chunks set, those got, and room
        config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=cpu_gb,
                                                   remote_storage_plugins=["kvstore"], extra_config=extra)
        self.metadata = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0,
                                        local_worker_id=0, kv_dtype=torch.float16,
                                        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM))
        self.local = LocalCPUBackend(config, self.metadata)
        self.remote = RemoteBackend(config, self.metadata, self.loop, self.local, dst_device="cpu",
                                    plugin_name="kvstore")

    def round(self, first: int) -> tuple[float, float]:
        keys = [CacheEngineKey("bench", 1, 0, first + i, torch.float16) for i in range(self.pages)]
        objs = []
        for i in range(self.pages):
            obj = self.local.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes(), MemoryFormat.KV_2LTD)
            obj.tensor.fill_(float(first + i) % 7)
            objs.append(obj)
        started = time.perf_counter()
        self.remote.batched_submit_put_task(keys, objs)
        while any(obj.get_ref_count() > 1 for obj in objs):  # LMCache holds a reference until the put is done
            time.sleep(0.0005)
        set_s = time.perf_counter() - started
        started = time.perf_counter()
        got = self.remote.batched_get_blocking(keys)
        get_s = time.perf_counter() - started
        assert all(g is not None for g in got), "a chunk just set was not found"
        assert bytes(got[-1].byte_array[:64]) == bytes(objs[-1].byte_array[:64])
        for obj in objs + got:
            obj.ref_count_down()
        return set_s, get_s

    def close(self) -> None:
        self.remote.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
