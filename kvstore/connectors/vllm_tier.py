"""vLLM's offloading tier in the daemons: a secondary tier below vLLM's CPU tier (vLLM 0.33.0).

vLLM's OffloadingConnector with its tiering spec keeps chunks in a CPU tier (the primary) and cascades
every chunk it stores there to its secondary tiers; a chunk missing from the CPU tier is looked up in
them and promoted back. This module is such a tier. In vLLM's `--kv-transfer-config`:

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{
            "type": "KVStoreTier", "module_path": "kvstore.connectors.vllm_tier",
            "servers": "10.0.0.1:50051,10.0.0.2:50051",   # or $KVSTORE_SERVERS
            "tenant": "team-a",        # optional: the namespace salt
            "model_id": "gemma@1f2e",  # unless vLLM's model is a local folder (below)
            "traffic_class": "chat",   # optional: the daemons' retention class
            "timeout_s": 5.0}]}}       # optional: the deadline of each call

A secured cluster's `token_file`, `tls_ca`, `tls_cert`, `tls_key` and `tls_server_name` settings are
optional, each over its KVSTORE_* variable (docs/operations.md); a token is read from a file, never put
in the JSON (which shows in `ps` and in vLLM's logs).

The tier runs in vLLM's scheduler process and sees only vLLM's OffloadKeys (a block hash chained over the
prefix, plus the KV cache group), never tokens. Each chunk, one row of the CPU tier's buffer (every
worker's bytes of that chunk), is one record under the block identity of its key
(`kvstore.connectors.identity`): the namespace names vLLM, the model (a digest of its folder's config and
weights, or `model_id`, the operator's promise), the KV dtype, the chunk's bytes,
tokens, groups and parallel layout, and the tenant. Such blocks are vLLM's own: they are not shared with
this project's engines (the KV connector, `kvstore.connectors.vllm_connector`, is the path that is).

vLLM calls the tier under its lock and wants every call to return at once:
* `lookup` answers from vLLM's own AsyncLookupManager: RETRY while a step's keys are being asked, then HIT
  or MISS. Its worker thread asks every daemon in one round per request (the client's `lookup` of the
  request's keys, whose answer is the leading run found: a key after a missing one is a MISS).
* `submit_store` / `submit_load` hand the job to one worker thread and return; the worker puts the rows
  straight from the CPU tier's memory, or gets the records straight into the slots vLLM allocated.
  `get_finished_jobs` reports what finished; a promotion reports the keys that arrived.
* A dead or slow daemon is a MISS or a failed job within the client's deadline, never an exception in
  vLLM's thread. The client connects on first use, so building the tier connects to nothing.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

import xxhash
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, ScheduleEndContext, SecondaryTierManager, TransferJob

from kvstore.block import Block
from kvstore.client import StoreClient
from kvstore.connectors.identity import EngineIdentity, model_identity
from kvstore.connectors.store import LazyClient, client_config

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)


def tier_identity(spec: OffloadingSpec, chunk_bytes: int, tenant: str = "",
                  model_id: str | None = None) -> EngineIdentity:
    """The identity of this vLLM's chunks: everything that decides a chunk's bytes for a given key."""
    config = spec.config
    p = config.parallel
    # layer names enter as a digest: they decide which layers a group's bytes hold, but are long
    groups = ",".join(f"{g.group_id}:{g.tokens_per_block}t:{len(g.layer_names)}L:"
                      f"{xxhash.xxh3_64_hexdigest(';'.join(g.layer_names).encode())}" for g in config.groups)
    layout = (f"offload-chunk:{config.model.dtype}:{chunk_bytes}B:groups={groups}:tp={p.tp_size}:pp={p.pp_size}:"
              f"pcp={p.pcp_size}:dcp={p.dcp_size}:canonical={config.canonical_layout}:"
              f"replicated={config.replicated_layout}")
    page_tokens = config.cache.tokens_per_hash * config.cache.blocks_per_chunk
    model = model_identity(config.model.name, model_id, "secondary_tiers[kvstore].model_id")
    return EngineIdentity("vllm-tier", model, layout, page_tokens, p.rank, p.world_size, tenant)


class _StoreLookup(AsyncLookupManager):
    """vLLM's per-step batched, non-blocking lookup, answered by the daemons."""

    def __init__(self, tier: KVStoreTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        found = self._tier.leading(keys)
        return [i < found for i in range(len(keys))]


class KVStoreTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 servers: str | None = None, tenant: str = "", traffic_class: str = "chat",
                 timeout_s: float = 5.0, locality: str | None = "REMOTE", model_id: str | None = None,
                 backpressure_detector: BackpressureDetector | None = None, **security: str) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.client_config = client_config({"servers": servers, "timeout_s": timeout_s, **security},
                                           "secondary_tiers[kvstore].")
        self.store = LazyClient(self.client_config)
        self.traffic_class = traffic_class
        self.identity = tier_identity(offloading_spec, self.block_size_bytes, tenant, model_id)
        self._view = primary_kv_view.cast("B")  # (num_chunks * block_size_bytes,): the rows, flat
        # one worker: jobs run in the order vLLM submitted them (a load after the store of the same key)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-vllm-tier")
        # (result, keys of a promotion that did not arrive), from the worker to vLLM's thread
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey]]] = queue.SimpleQueue()
        self._pending = 0  # jobs submitted and not yet reported; only vLLM's (locked) thread touches it
        self._lookups = _StoreLookup(self)

    # -- the store, from the worker threads ------------------------------------------------------

    @property
    def client(self) -> StoreClient:
        return self.store.get()

    def _row(self, chunk_id: int) -> memoryview:
        """One chunk of the CPU tier: (block_size_bytes,) bytes of its shared memory."""
        start = int(chunk_id) * self.block_size_bytes
        return self._view[start : start + self.block_size_bytes]

    def _blocks(self, keys: Iterable[OffloadKey]) -> list[Block]:
        return [self.identity.block(key) for key in keys]

    def leading(self, keys: list[OffloadKey]) -> int:
        try:
            return self.client.lookup(self._blocks(keys)) if keys else 0
        except Exception as exc:  # noqa: BLE001 - a store that fails is a miss
            log.warning("kvstore lookup failed: %s", exc)
            return 0

    def _store(self, job: TransferJob) -> tuple[JobResult, list[OffloadKey]]:
        items = [(block, self._row(cid)) for block, cid in zip(self._blocks(job.keys), job.chunk_ids, strict=True)]
        try:
            summary = self.client.put(items, 1, self.traffic_class)
            ok = summary.failed == 0
        except Exception as exc:  # noqa: BLE001 - a chunk not stored is simply not in this tier
            log.warning("kvstore put failed: %s", exc)
            ok = False
        return JobResult(job.job_id, ok, transfer_bytes=len(items) * self.block_size_bytes), []

    def _load(self, job: TransferJob) -> tuple[JobResult, list[OffloadKey]]:
        """The records straight into the CPU tier's slots; the result, and the keys that did not arrive."""
        keys = list(job.keys)
        blocks = self._blocks(keys)
        rows = [self._row(cid) for cid in job.chunk_ids]
        try:  # straight into the slots vLLM allocated: no copy here
            found = {d.block.key for d in self.client.get(blocks, into=rows) if len(d.payload) == self.block_size_bytes}
        except Exception as exc:  # noqa: BLE001
            log.warning("kvstore get failed: %s", exc)
            found = set()
        arrived = [key for key, block in zip(keys, blocks, strict=True) if block.key in found]
        missed = [key for key, block in zip(keys, blocks, strict=True) if block.key not in found]
        return JobResult(job.job_id, not missed, successful_keys=arrived or None,
                         transfer_bytes=len(arrived) * self.block_size_bytes), missed

    def _submit(self, work, job: TransferJob) -> None:
        def run() -> None:
            try:
                result = work(job)
            except Exception as exc:  # noqa: BLE001 - never lose a job: vLLM waits for every one
                log.warning("kvstore tier job %d failed: %s", job.job_id, exc)
                result = JobResult(job.job_id, False), list(job.keys) if job.is_promotion else []
            self._finished.put(result)

        self._pending += 1
        try:
            self._pool.submit(run)
        except RuntimeError:  # shut down: report the job failed rather than never
            self._finished.put((JobResult(job.job_id, False), list(job.keys) if job.is_promotion else []))

    # -- SecondaryTierManager ----------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        return LookupResult.RETRY if found is None else LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._load, job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done = []
        while True:
            try:
                result, missed = self._finished.get_nowait()
            except queue.Empty:
                break
            # here, on vLLM's thread (the lookup state is its): else it promotes the same doomed keys again
            self._lookups.mark_miss(missed)
            done.append(result)
        self._pending -= len(done)
        return done

    def has_pending_work(self) -> bool:
        return self._pending > 0

    def drain_jobs(self) -> None:
        self._pool.submit(lambda: None).result()  # one worker, in order: every earlier job has run

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()  # this step's lookups go to the daemons while the model runs

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self.store.close()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ()

    def __repr__(self) -> str:
        return f"<KVStoreTier {','.join(self.client_config.servers)}>"
