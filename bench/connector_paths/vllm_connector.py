"""vLLM 0.33.0's KV connector, worker side: set is `save_kv_layer` of every layer and `wait_for_save` for a
prompt of the round's blocks of 4 MiB (8 layers of [8, 128, 2 * 128] float16, vLLM's CPU attention page),
until the write-behind has stored them; get is `start_load_kv` and `wait_for_layer_load` of every layer into
another vLLM worker's pages, until `get_block_ids_with_load_errors` says nothing failed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from connector_paths.vllm_shape import BLOCK, HEAD_DIM, HEADS, LAYERS, PAGE_BYTES


class Path:
    """Two vLLM workers' connectors (one saves, one loads) over CPU KV caches of `pages` + 1 blocks."""

    page_bytes = PAGE_BYTES

    def __init__(self, address: str, pages: int) -> None:
        from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        extra = {"servers": address, "model_id": "bench", "write_behind_bytes": 2 * pages * PAGE_BYTES}
        transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path=
                                    "kvstore.connectors.vllm_connector", kv_role="kv_both",
                                    kv_connector_extra_config=extra)
        config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=transfer)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
        kv_cache_config = KVCacheConfig(pages + 1, [], [KVCacheGroupSpec(self.names, spec)])
        self.saver, self.loader = (KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
                                   for _ in range(2))
        self.pages = pages
        # per layer [num_blocks, H, block_size, 2 * D]: the saver's hold random KV, the loader's get it
        self.saved = [torch.randn((pages + 1, HEADS, BLOCK, 2 * HEAD_DIM)).half() for _ in self.names]
        self.loaded = [torch.zeros_like(t) for t in self.saved]

    def _forward(self, connector, kv, meta) -> None:
        from vllm.forward_context import ForwardContext

        layers = {n: SimpleNamespace(kv_cache=t) for n, t in zip(self.names, kv, strict=True)}
        context = ForwardContext(no_compile_layers=layers, attn_metadata={n: object() for n in self.names},
                                 slot_mapping={})
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(context)
        for name, layer in zip(self.names, kv, strict=True):
            connector.wait_for_layer_load(name)
            connector.save_kv_layer(name, layer, None)
        connector.wait_for_save()
        assert not connector.get_block_ids_with_load_errors(), "a load of the bench failed"
        connector.clear_connector_metadata()

    def round(self, first: int) -> tuple[float, float]:
        from kvstore.connectors.vllm_connector import KVStoreConnectorMetadata, Transfer

        tokens = [(first + i) % 2**31 for i in range(self.pages * BLOCK)]  # fresh keys each round
        transfer = Transfer("bench", None, tokens, 0, [list(range(1, self.pages + 1))], self.pages)
        started = time.perf_counter()
        self._forward(self.saver, self.saved, KVStoreConnectorMetadata(saves=[transfer]))
        assert self.saver.flush(600) and not self.saver.client.write_behind.counters["dropped"]
        set_s = time.perf_counter() - started
        started = time.perf_counter()
        self._forward(self.loader, self.loaded, KVStoreConnectorMetadata(loads=[transfer]))
        get_s = time.perf_counter() - started
        return set_s, get_s

    def close(self) -> None:
        self.saver.shutdown()
        self.loader.shutdown()
