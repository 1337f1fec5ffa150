"""What the vLLM tests share: vLLM's own offloading spec and manager, built on the CPU (no GPU, no model).

vLLM needs no stand-ins here: with VLLM_TARGET_DEVICE=cpu its config, scheduler-side and offloading
classes import and run on CPU torch; only `vllm._C` fails to load, which these paths do not use.
"""

from __future__ import annotations

import os
import time
import uuid

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks a platform

from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

TIER_MODULE = "kvstore.connectors.vllm_tier"


def tiering_spec(servers: str, chunk_bytes: int, chunks: int = 8, model: str = "org/model", rank: int = 0,
                 world: int = 1, tenant: str = "", timeout_s: float = 2.0) -> TieringOffloadingSpec:
    """vLLM's TieringOffloadingSpec with its CPU tier of `chunks` chunks and this project's tier below it,
    configured as a user's kv_connector_extra_config would."""
    tier = {"type": "KVStoreTier", "module_path": TIER_MODULE, "servers": servers, "tenant": tenant,
            "timeout_s": timeout_s}
    extra = {"cpu_bytes_to_use": chunks * chunk_bytes, "secondary_tiers": [tier], "tier_poll_interval_s": 0}
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.self_attn.attn",),
                                      group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes // world, enable_kv_cache_events=False, extra_config=extra,
        engine_id=f"kvstore-test-{uuid.uuid4().hex[:12]}", model=OffloadingModelConfig(model, "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=rank, world_size=world, tp_size=world, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))
    return TieringOffloadingSpec(config)


class Scheduler:
    """Drives vLLM's TieringOffloadingManager as the OffloadingConnector's scheduler side does: one
    request context, steps ending in on_schedule_end."""

    def __init__(self, spec: TieringOffloadingSpec) -> None:
        self.spec = spec
        self.manager = spec.get_manager()
        self.primary = self.manager.primary_tier.get_kv_memoryview().cast("B")  # the CPU tier's rows, flat
        self.chunk_bytes = self.manager.secondary_tiers[0].block_size_bytes
        self.tier = self.manager.secondary_tiers[0]

    def row(self, chunk_id: int) -> memoryview:
        return self.primary[int(chunk_id) * self.chunk_bytes : (int(chunk_id) + 1) * self.chunk_bytes]

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self, timeout_s: float = 30.0) -> None:
        """Steps until no tier job is in flight (vLLM keeps stepping while has_pending_work)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.step()
            if not self.manager.has_pending_work():
                return
            assert time.monotonic() < deadline, "tier jobs did not finish"
            time.sleep(0.005)

    def store(self, request: str, keys: list, payloads: list[bytes]) -> None:
        """GPU -> CPU tier (written here by hand, as vLLM's worker would), then the cascade to the tier."""
        context = ReqContext(request)
        with self.manager.lock:
            self.manager.on_new_request(context)
            prepared = self.manager.prepare_store(keys, context)
            assert prepared is not None and list(prepared.keys_to_store) == keys
            for chunk_id, payload in zip(prepared.store_spec.chunk_ids, payloads, strict=True):
                self.row(chunk_id)[:] = payload
            self.manager.complete_store(keys, context)
            self.manager.on_request_finished(context)
        self.settle()

    def lookup(self, request: str, keys: list, timeout_s: float = 30.0) -> list:
        """Look `keys` up step after step, as the scheduler does, until none is RETRY or HIT_PENDING; the
        final results. A HIT from the tier starts a promotion into the CPU tier."""
        from vllm.v1.kv_offload.base import LookupResult

        context = ReqContext(request)
        with self.manager.lock:
            self.manager.on_new_request(context)
        deadline = time.monotonic() + timeout_s
        while True:
            with self.manager.lock:
                results = [self.manager.lookup(key, context) for key in keys]
            if not any(r in (LookupResult.RETRY, LookupResult.HIT_PENDING) for r in results):
                break
            assert time.monotonic() < deadline, f"lookups still pending: {results}"
            self.step()
            time.sleep(0.005)
        with self.manager.lock:
            self.manager.on_request_finished(context)
        return results

    def read(self, keys: list) -> list[bytes]:
        """The CPU tier's bytes for `keys` (as a GPU load would read them)."""
        context = ReqContext("reader")
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, context)
            rows = [bytes(self.row(chunk_id)) for chunk_id in spec.chunk_ids]
            self.manager.complete_load(keys, context)
        return rows

    def shutdown(self) -> None:
        self.manager.shutdown()
