"""vLLM's two call paths into the store, one round each on fresh keys, for bench/connectors.py.

    .venvs/vllm-0.33.0/bin/python bench/vllm_paths.py [--pages 32] [--address HOST:PORT]

* The offloading tier (`kvstore.connectors.vllm_tier`), in vLLM's TieringOffloadingManager: set is
  `submit_store` of `pages` 4 MiB chunks of the CPU tier until `get_finished_jobs` reports the job; get is
  `submit_load` of them back into the CPU tier's slots, likewise.
* The KV connector (`kvstore.connectors.vllm_connector`), worker side: set is `save_kv_layer` of every layer
  and `wait_for_save` for a prompt of `pages` blocks of 4 MiB (8 layers of [2, 128, 8, 128] float16), until
  the write-behind has stored them; get is `start_load_kv` and `wait_for_layer_load` of every layer into
  another vLLM's pages, until `get_block_ids_with_load_errors` says nothing failed.

Without --address a daemon of its own is started on loopback; the plain client's put / get of the same
bytes, from tensors, is timed beside each.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path as _Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

PAGE_BYTES = 4 * 2**20
LAYERS, BLOCK, HEADS, HEAD_DIM = 8, 128, 8, 128  # a float16 page of a layer: 512 KiB; a block: 4 MiB


class TierPath:
    """vLLM's tiering manager with a CPU tier of `pages` chunks and this project's tier below it."""

    page_bytes = PAGE_BYTES

    def __init__(self, address: str, pages: int) -> None:
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        tier = {"type": "KVStoreTier", "module_path": "kvstore.connectors.vllm_tier", "servers": address}
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(BLOCK, ("model.layers.0.self_attn.attn",), 0),),
            worker_kv_bytes_per_block=PAGE_BYTES, enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": pages * PAGE_BYTES, "secondary_tiers": [tier],
                          "tier_poll_interval_s": 0},
            engine_id=f"kvstore-bench-{uuid.uuid4().hex[:12]}", model=OffloadingModelConfig("bench", "float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False))
        self.pages = pages
        self.manager = TieringOffloadingSpec(config).get_manager()
        self.tier = self.manager.secondary_tiers[0]
        rows = torch.frombuffer(self.manager.primary_tier.get_kv_memoryview().cast("B"), dtype=torch.uint8)
        rows[: pages * PAGE_BYTES].copy_(torch.randint(0, 256, (pages * PAGE_BYTES,), dtype=torch.uint8))
        self._job = 0

    def _run(self, keys, promotion: bool) -> float:
        import numpy as np
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob

        self._job += 1
        job = TransferJob(self._job, keys, np.arange(len(keys), dtype=np.int32), promotion, ReqContext("bench"))
        started = time.perf_counter()
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        done: list = []
        while not done:
            done = list(self.tier.get_finished_jobs())
            if not done:
                time.sleep(0.0005)
        elapsed = time.perf_counter() - started
        assert done[0].success, "a job of the bench failed"
        return elapsed

    def round(self, first: int) -> tuple[float, float]:
        from vllm.v1.kv_offload.base import make_offload_key

        keys = [make_offload_key((first + i).to_bytes(32, "little"), 0) for i in range(self.pages)]
        return self._run(keys, False), self._run(keys, True)

    def close(self) -> None:
        self.manager.shutdown()


class ConnectorPath:
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
        # per layer [num_blocks, 2, block_size, H, D]: the saver's hold random KV, the loader's get it
        self.saved = [torch.randn((pages + 1, 2, BLOCK, HEADS, HEAD_DIM)).half() for _ in self.names]
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
        transfer = Transfer("bench", "", tokens, 0, list(range(1, self.pages + 1)))
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


def tier_round(address: str, first: int, n: int) -> tuple[float, float]:
    """One round of `n` fresh 4 MiB chunks through the tier: (set seconds, get seconds)."""
    path = TierPath(address, n)
    try:
        return path.round(first)
    finally:
        path.close()


def connector_round(address: str, first: int, n: int) -> tuple[float, float]:
    """One round of a prompt of `n` fresh 4 MiB blocks through the connector: (set seconds, get seconds)."""
    path = ConnectorPath(address, n)
    try:
        return path.round(first)
    finally:
        path.close()


def main() -> None:
    import argparse
    import shutil
    import tempfile

    from kvstore.client import ClientConfig, KVClient
    from kvstore.connectors.identity import EngineIdentity
    from kvstore.server.process import DaemonProcess

    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--address")
    args = parser.parse_args()
    workdir = _Path(tempfile.mkdtemp(prefix="kvstore-vllm-bench-"))
    daemon = None if args.address else DaemonProcess(workdir / "d", workdir, ["--hot-tier-bytes", "2GiB"]).start()
    address = args.address or daemon.address
    gb = args.pages * PAGE_BYTES / 1e9
    try:
        paths = {"tier": TierPath(address, args.pages), "connector": ConnectorPath(address, args.pages)}
        with KVClient(ClientConfig((address,))) as client:
            identity = EngineIdentity("bench-client", "bench", "raw", 64)
            for repeat in range(args.repeats):
                first = (repeat + 1) * 1_000_000
                for name, path in paths.items():
                    set_s, get_s = path.round(first)
                    tensors = [torch.full((PAGE_BYTES // 2,), float(i % 7), dtype=torch.float16)
                               for i in range(args.pages)]
                    items = [(identity.block(f"{name}{first + i}"), memoryview(t.numpy()).cast("B"))
                             for i, t in enumerate(tensors)]
                    started = time.perf_counter()
                    client.put(items, 1)
                    put_s = time.perf_counter() - started
                    started = time.perf_counter()
                    assert len(client.get([b for b, _ in items])) == args.pages
                    got_s = time.perf_counter() - started
                    print(f"{name:9s} set {gb / set_s:5.2f} GB/s (client {gb / put_s:5.2f}, {put_s / set_s:.2f}x)  "
                          f"get {gb / get_s:5.2f} GB/s (client {gb / got_s:5.2f}, {got_s / get_s:.2f}x)", flush=True)
        for path in paths.values():
            path.close()
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
