"""LMCache's remote storage plug-in: LMCache chunks stored in the daemons (LMCache 0.5.6).

In LMCache's configuration (YAML or LMCACHE_* variables):

    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: kvstore.connectors.lmcache
      remote_storage_plugin.kvstore.class_name: KVStoreConnectorAdapter
      remote_storage_plugin.kvstore.servers: "10.0.0.1:50051,10.0.0.2:50051"   # or $KVSTORE_SERVERS
      remote_storage_plugin.kvstore.tenant: "team-a"          # optional: the namespace salt
      remote_storage_plugin.kvstore.model_id: "gemma@1f2e"   # unless the model is a local folder (below)
      remote_storage_plugin.kvstore.traffic_class: "chat"     # optional: the retention class
      remote_storage_plugin.kvstore.timeout_s: 5              # optional: the deadline of each call
      remote_storage_plugin.kvstore.token_file: /run/secrets/kvstore-token     # optional: secured daemons
      remote_storage_plugin.kvstore.tls_ca: /etc/kvstore/ca.pem                # optional: and tls_cert,
                                                                               # tls_key, tls_server_name

The model is named by a digest of its folder's config and weights (`identity.checkpoint_identity`) where
LMCache's model name is a local folder, else by `model_id`, the operator's promise that every engine using
it serves the same weights. Each security setting falls back to its KVSTORE_* variable (KVSTORE_TOKEN,
KVSTORE_TLS_CA, ...; docs/operations.md); a token is read from a file, never written into a config.

Each chunk (a MemoryObj, KV_2LTD `[2, layers, tokens, hidden]`; the last one of a prompt may hold fewer
tokens) is one record of the chunk's bytes, under the block identity of its CacheEngineKey
(`kvstore.connectors.identity`): the key's string names model, world size, worker and dtype, and the
namespace adds the chunk's shape and the tenant. A dead or slow daemon is a miss (False, None, 0) within
the deadline, never an exception in LMCache. The coroutines run the blocking client in a thread, so they
never block LMCache's event loop; `exists_sync` is blocking, as LMCache calls it. The client connects on
the first call.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore.block import Block
from kvstore.client import StoreClient
from kvstore.connectors.identity import EngineIdentity, model_identity
from kvstore.connectors.store import LazyClient, client_config

PLUGIN = "kvstore"
log = logging.getLogger(__name__)


class KVStoreConnectorAdapter(ConnectorAdapter):
    """Builds the connector for `plugin://kvstore` (LMCache instantiates this class by name)."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN}")

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return KVStoreConnector(context.loop, context.local_cpu_backend, context.config, context.metadata)


class KVStoreConnector(RemoteConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend, config, metadata) -> None:
        super().__init__(config, metadata)
        self.loop, self.local_cpu_backend = loop, local_cpu_backend
        prefix = f"remote_storage_plugin.{PLUGIN}."
        settings = {k.removeprefix(prefix): v for k, v in (config.extra_config or {}).items() if k.startswith(prefix)}
        settings = {k: v for k, v in settings.items() if k not in ("module_path", "class_name")}
        self.client_config = client_config(settings, prefix)
        self.store = LazyClient(self.client_config)
        self.traffic_class = str(settings.get("traffic_class", "chat"))
        shapes = ";".join(f"{list(shape)}:{str(dtype).removeprefix('torch.')}"
                          for shape, dtype in zip(self.meta_shapes, self.meta_dtypes, strict=True))
        model = model_identity(metadata.model_name, settings.get("model_id"), f"{prefix}model_id")
        self.identity = EngineIdentity("lmcache", model, f"{self.meta_fmt.name}{shapes}",
                                       metadata.chunk_size, metadata.worker_id, metadata.world_size,
                                       str(settings.get("tenant", "")))

    @property
    def client(self) -> StoreClient:
        return self.store.get()

    def _block(self, key: CacheEngineKey) -> Block:
        return self.identity.block(key.to_string())

    # -- the calls, blocking: each is a miss on any failure of the store ------------------------------

    def _leading(self, keys: list[CacheEngineKey]) -> int:
        try:
            return self.client.lookup([self._block(key) for key in keys]) if keys else 0
        except Exception as exc:  # noqa: BLE001 - a store that fails is a miss
            log.warning("kvstore lookup failed: %s", exc)
            return 0

    def _read(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        blocks = [self._block(key) for key in keys]
        try:
            found = {data.block.key: data for data in self.client.get(blocks)}
        except Exception as exc:  # noqa: BLE001
            log.warning("kvstore get failed: %s", exc)
            return [None] * len(keys)
        out: list[MemoryObj | None] = []
        try:
            for block in blocks:
                out.append(self._memory_obj(found[block.key].payload) if block.key in found else None)
        except Exception as exc:  # noqa: BLE001 - what was allocated goes back; the rest is a miss
            log.warning("kvstore: a chunk could not be placed in LMCache's memory: %s", exc)
            for memory_obj in out:
                if memory_obj is not None:
                    memory_obj.ref_count_down()
            return [None] * len(keys)
        return out

    def _memory_obj(self, payload) -> MemoryObj | None:
        """A MemoryObj of LMCache's allocator holding the record's bytes: a chunk of `tokens` tokens, shaped
        so (LMCache's own reshape of a partial chunk leaves the object's shapes at a full chunk's)."""
        view = memoryview(payload).cast("B")
        if not 0 < len(view) <= self.full_chunk_size_bytes or len(view) % self.single_token_size:
            return None  # not a chunk of this layout: a miss
        shapes = self.meta_shapes
        if len(view) < self.full_chunk_size_bytes:
            if len(shapes) != 1:
                return None  # a partial chunk of several layer groups: not one this plug-in stored
            tokens, (shape,) = len(view) // self.single_token_size, shapes
            dim = 2 if len(shape) == 4 else 0  # KV_2LTD [2, layers, tokens, hidden]; MLA [tokens, ...]
            shapes = [torch.Size([*shape[:dim], tokens, *shape[dim + 1 :]])]
        # busy_loop off: with it LMCache waits until memory frees, which a batch whose own earlier chunks
        # hold it never lets happen
        memory_obj = self.local_cpu_backend.allocate(shapes, self.meta_dtypes, self.meta_fmt, busy_loop=False)
        if memory_obj is None:  # LMCache's CPU memory is full
            return None
        memoryview(memory_obj.byte_array).cast("B")[:] = view
        return memory_obj

    def _write(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        # the chunks' own memory: LMCache holds each until this returns
        items = [(self._block(key), memoryview(obj.byte_array).cast("B")) for key, obj in zip(keys, memory_objs,
                                                                                             strict=True)]
        try:
            self.client.put(items, 1, self.traffic_class)
        except Exception as exc:  # noqa: BLE001 - a chunk that is not stored is simply not cached
            log.warning("kvstore put failed: %s", exc)

    async def _in_thread(self, function, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

    # -- RemoteConnector ---------------------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._in_thread(self._leading, [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._leading([key]) == 1

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self._in_thread(self._read, [key]))[0]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self._in_thread(self._write, [key], [memory_obj])

    # LMCache names a method `list`: below it, `builtins.list` is the type
    async def list(self) -> list[str]:
        return []  # the daemons index keys, not LMCache's strings: there is nothing to list them from

    async def close(self) -> None:
        await self._in_thread(self.store.close)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: builtins.list[CacheEngineKey]) -> builtins.list[MemoryObj | None]:
        return await self._in_thread(self._read, list(keys))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: builtins.list[CacheEngineKey],
                          memory_objs: builtins.list[MemoryObj]) -> None:
        await self._in_thread(self._write, list(keys), list(memory_objs))

    async def batched_async_contains(self, lookup_id: str, keys: builtins.list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return await self._in_thread(self._leading, list(keys))

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: builtins.list[CacheEngineKey]) -> builtins.list[MemoryObj]:
        """The leading run of chunks that were found; any found after a miss are given back."""
        leading, missed = [], False
        for memory_obj in await self._in_thread(self._read, list(keys)):
            if memory_obj is None:
                missed = True
            elif missed:
                memory_obj.ref_count_down()
            else:
                leading.append(memory_obj)
        return leading

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: builtins.list[CacheEngineKey]) -> int:
        return self._leading(list(keys))

    def __repr__(self) -> str:
        return f"<KVStoreConnector {','.join(self.client_config.servers)}>"
