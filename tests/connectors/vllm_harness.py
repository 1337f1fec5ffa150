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
    tier = {"type": "KVStoreTier", "module_path": TIER_MODULE, "servers": servers, "tenant": tenant, "model_id": model,
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


# -- the KV connector -----------------------------------------------------------------------------------

CONNECTOR_MODULE = "kvstore.connectors.vllm_connector"


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def connector_pair(servers: str, model_id: str, layers: int = 2, heads: int = 2, head_dim: int = 8,
                   block_size: int = 16, dtype=None, tenant: str = "", timeout_s: float = 2.0,
                   window_layers: tuple[int, ...] = (), sliding_window: int = 0):
    """vLLM's scheduler-side and worker-side connectors, built by vLLM's own factory from the
    --kv-transfer-config a user gives; a model of `layers` attention layers, full attention but for
    `window_layers`, which make a sliding-window group of their own (vLLM's hybrid KV-cache manager)."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    extra = {"servers": servers, "model_id": model_id, "tenant": tenant, "timeout_s": timeout_s}
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path=CONNECTOR_MODULE,
                                kv_role="kv_both", kv_connector_extra_config=extra)
    config = VllmConfig(cache_config=CacheConfig(block_size=block_size), kv_transfer_config=transfer)
    geometry = {"block_size": block_size, "num_kv_heads": heads, "head_size": head_dim, "dtype": dtype or torch.float16}
    groups = [KVCacheGroupSpec([layer_name(i) for i in range(layers) if i not in window_layers],
                               FullAttentionSpec(**geometry))]
    if window_layers:
        groups.append(KVCacheGroupSpec([layer_name(i) for i in window_layers],
                                       SlidingWindowSpec(**geometry, sliding_window=sliding_window)))
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return (KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config),
            KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config))


class Engine:
    """One vLLM instance's connector pair and CPU KV cache: per layer [num_blocks, H, block_size, 2 * D], the
    layout of vLLM's CPU attention. With `window_layers`, two KV cache groups, each with block ids of its own."""

    def __init__(self, servers: str, model_id: str, num_blocks: int = 64, layers: int = 2, heads: int = 2,
                 head_dim: int = 8, block_size: int = 16, dtype=None, window_layers: tuple[int, ...] = (),
                 **extra) -> None:
        import torch

        self.dtype = dtype or torch.float16
        self.scheduler, self.worker = connector_pair(servers, model_id, layers, heads, head_dim, block_size,
                                                     self.dtype, window_layers=window_layers, **extra)
        self.block_size = block_size
        self.names = [layer_name(i) for i in range(layers)]
        self.window_layers = tuple(window_layers)
        self.kv = [torch.zeros((num_blocks, heads, block_size, 2 * head_dim), dtype=self.dtype) for _ in self.names]
        self.worker.register_kv_caches(dict(zip(self.names, self.kv, strict=True)))
        self._next_block = 1  # block 0 is vLLM's null block

    def allocate(self, n: int) -> list[int]:
        ids = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        return ids

    def group_of(self, layer: int) -> int:
        return 1 if layer in self.window_layers else 0

    def schedule(self, request, block_ids: list[int] | list[list[int]], num_computed_tokens: int = 0,
                 chunk: int | None = None):
        """The scheduler side of one request's first step, as vLLM's scheduler calls it: the match, the
        allocation (`block_ids`, per group where there are several), then this step's metadata for the
        rest of the prompt, or its first `chunk` tokens (chunked prefill). (external tokens, metadata)."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

        groups = block_ids if block_ids and isinstance(block_ids[0], list) else [block_ids]
        external, asynchronous = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        blocks = KVCacheBlocks(tuple(tuple(KVCacheBlock(i) for i in group) for group in groups))
        self.scheduler.update_state_after_alloc(request, blocks, external)
        request.num_computed_tokens = num_computed_tokens + external
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = [NewRequestData.from_request(request, tuple(list(g) for g in groups))]
        scheduled = len(request.prompt_token_ids) - request.num_computed_tokens
        scheduled = scheduled if chunk is None else min(chunk, scheduled)
        output.num_scheduled_tokens = {request.request_id: scheduled}
        output.total_num_scheduled_tokens = scheduled
        self.asynchronous = asynchronous
        return external, self.scheduler.build_connector_meta(output)

    def forward(self, meta, compute=None) -> set[int]:
        """The worker side of one step, as vLLM's model runner and attention layers call it; `compute(layer)`
        stands for the attention layer writing its new KV. The block ids that failed to load."""
        from types import SimpleNamespace

        from vllm.forward_context import ForwardContext

        layers = {n: SimpleNamespace(kv_cache=t) for n, t in zip(self.names, self.kv, strict=True)}  # attention layers
        context = ForwardContext(no_compile_layers=layers, attn_metadata={n: object() for n in self.names},
                                 slot_mapping={})
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(context)
        for i, name in enumerate(self.names):
            self.worker.wait_for_layer_load(name)
            if compute is not None:
                compute(i)
            self.worker.save_kv_layer(name, self.kv[i], context.attn_metadata[name])
        self.worker.wait_for_save()
        failed = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        return failed

    def receive(self, timeout_s: float = 30.0):
        """Steps without a forward pass until the asynchronous loads are over: (finished, failed) requests."""
        from vllm.v1.core.sched.output import SchedulerOutput

        deadline = time.monotonic() + timeout_s
        while True:
            self.worker.bind_connector_metadata(self.scheduler.build_connector_meta(SchedulerOutput.make_empty()))
            results = self.worker.get_transfer_results(set())
            self.worker.clear_connector_metadata()
            if results.finished_recving:
                return results.finished_recving, results.failed_recving
            assert time.monotonic() < deadline, "an asynchronous load did not finish"
            time.sleep(0.01)

    def pages(self, block_ids: list[int], layers: list[int] | None = None) -> list[bytes]:
        """Each block's KV as stored: layer-major, each layer's page as the CPU backend keeps it."""
        import torch

        chosen = [self.kv[i] for i in (range(len(self.kv)) if layers is None else layers)]
        return [b"".join(t[i].contiguous().view(torch.uint8).numpy().tobytes() for t in chosen) for i in block_ids]

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def vllm_request(request_id: str, tokens: list[int], cache_salt: str | None = None):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, list(tokens), SamplingParams(max_tokens=1), None, cache_salt=cache_salt)
