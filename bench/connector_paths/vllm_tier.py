"""vLLM 0.33.0's offloading tier in its TieringOffloadingManager: set is `submit_store` of the round's 4 MiB
chunks of the CPU tier until `get_finished_jobs` reports the job; get is `submit_load` of them back into
the CPU tier's slots, likewise."""

from __future__ import annotations

import time
import uuid

import torch
from connector_paths.vllm_shape import BLOCK, PAGE_BYTES


class Path:
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
