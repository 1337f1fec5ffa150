"""vLLM's KV connector on the store's own chained block keys (vLLM 0.32 CPU build, 0.33).

    python -m vllm.entrypoints.openai.api_server --model DIR --kv-transfer-config '{
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "servers": "10.0.0.1:50051,10.0.0.2:50051",   # or $KVSTORE_SERVERS
            "model_id": "gemma-3-270m@1f2e...",  # optional: the operator's promise of the model's identity
            "tenant": "team-a",         # optional: the namespace salt, whose blocks these are
            "traffic_class": "chat",    # optional: the daemons' retention class
            "codec": "zstd",            # optional: how blocks are stored (kvstore/codec.py), default raw
            "timeout_s": 5.0,           # optional: the deadline of each call
            "write_behind_bytes": 268435456}}'  # optional: saves queued beyond this are dropped (counted)

A secured cluster's `token_file`, `tls_ca`, `tls_cert`, `tls_key` and `tls_server_name` settings are
optional, each over its KVSTORE_* variable (docs/operations.md); a token is read from a file, never put
in the JSON (which shows in `ps` and in vLLM's logs).

**Model identity.** Without `model_id`, the namespace names the checkpoint itself: the model folder's
name and a digest of its config and weights (`identity.checkpoint_identity`), so another checkpoint served
under the same name or path never hits. A model vLLM names but that is no local folder (a hub name) needs
`model_id`, which is then the operator's promise that every server using it serves the same weights.

**Tenants.** The configured `tenant` is the namespace's salt: the blocks' owner, what a store token is
scoped to. A request's `cache_salt` keys its blocks apart inside that tenant (a digest of it enters the
model identity), so no caller's salt can name another deployment's tenant, and a token scoped to the
tenant reaches its salted requests too.

**What is stored** (`vllm_groups`): every prompt block's full-attention layers, and, for a sliding-window
hybrid such as Gemma 3 under vLLM's hybrid KV-cache manager (this connector is `SupportsHMA`), the
window layers of the last blocks of each prompt, exactly what a resume at its end reads. With the hybrid
manager off (`--disable-hybrid-kv-cache-manager`) every layer is stored whole, for every block. A
block's payload is layer-major, each layer's page as the attention backend keeps it; the page layout is
part of the namespace. Tensor parallel rank r of n keeps its own blocks (qualifier `tp`: `vllm_groups.namespaces`).
Pipeline parallelism, multimodal, LoRA and prompt-embedding requests are refused (the first at start-up,
the others are never loaded or saved): their KV is not a function of the token ids in this layout.

Scheduler side: `get_num_new_matched_tokens` asks every daemon in one round for the leading run of the
prompt's full blocks (never the last token, which vLLM must compute) and, for a hybrid, which window
blocks are present, and offers the longest resume beyond vLLM's own prefix cache whose window is stored;
`build_connector_meta` names the blocks to load and those that become full this step to save. Worker
side: loads go straight into vLLM's pages (`kvstore.client.torch_kv.PagedKV`). With one KV cache group
the load is layer-pipelined inside the step: `wait_for_layer_load(layer)` returns once that layer of
every loaded block is in place, and blocks that did not arrive are reported through
`get_block_ids_with_load_errors` (vLLM recomputes them). With several groups vLLM takes no block-level
errors (block ids are per group), so the load runs asynchronously: the request waits in
WAITING_FOR_REMOTE_KVS until the load is whole, and a load that fails is reported as `failed_recving`,
after which vLLM recomputes the prompt. `save_kv_layer` copies the layer's new pages out; `wait_for_save`
queues the blocks on the client's write-behind, so no forward pass waits on the store. A dead or slow
daemon is a miss; never an exception in vLLM. The client connects on first use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.model_executor.models.utils import extract_layer_index

from kvstore.client import StoreClient
from kvstore.client.loading import LoadCancelled, LoadHandle
from kvstore.client.torch_kv import PagedKV
from kvstore.codec import RAW
from kvstore.connectors.identity import model_identity
from kvstore.connectors.store import SETTINGS, LazyClient, client_config
from kvstore.connectors.vllm_groups import (
    PAGE_CPU,
    PAGE_NHD,
    Namespaces,
    StoredGroups,
    namespaces,
    pages_of,
)
from kvstore.connectors.vllm_groups import stored_groups as _stored_groups

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
MAX_NAMESPACES = 4096  # (cache_salt, rank) namespaces kept made; more are made again as they come


@dataclass
class Transfer:
    """Prompt blocks [first, first + n) of a request, in vLLM's blocks `block_ids[group][i]`; the window
    layers move for blocks [window_first, first + n) only."""

    req_id: str
    cache_salt: str | None
    tokens: list[int]  # the prompt up to the transfer's last block: each worker keys its own rank's blocks
    first: int
    block_ids: list[list[int]]  # per KV cache group
    window_first: int

    @property
    def end(self) -> int:
        return self.first + len(self.block_ids[0])


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request whose prompt blocks are still being computed (scheduler side)."""

    request: Request
    cache_salt: str | None
    saved: int  # prompt blocks [0, saved) are in the store or queued to be saved
    block_ids: list[list[int]] = field(default_factory=list)  # per group, per prompt block


@dataclass
class _Load:
    """A load on the worker: its transfer and one handle per chain (full, window); None: failed to start."""

    transfer: Transfer
    handles: list[tuple[LoadHandle, int]] | None  # (handle, blocks it must deliver)
    started: float = field(default_factory=time.monotonic)


def stored_groups(kv_cache_config: KVCacheConfig, page: str = PAGE_NHD) -> StoredGroups:
    return _stored_groups(kv_cache_config, page, extract_layer_index)


def _page_format() -> str:
    from vllm.platforms import current_platform

    return PAGE_CPU if current_platform.is_cpu() else PAGE_NHD


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.client_config = client_config({name: extra[name] for name in SETTINGS if name in extra},
                                           "kv_connector_extra_config.",
                                           write_behind_bytes=int(extra.get("write_behind_bytes", 256 * 2**20)))
        self.store = LazyClient(self.client_config)
        self.traffic_class = str(extra.get("traffic_class", "chat"))
        self.tenant = str(extra.get("tenant", ""))
        model = vllm_config.model_config
        self.model_id = model_identity(model.model if model is not None else None, extra.get("model_id"),
                                       "kv_connector_extra_config.model_id")
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ValueError("KVStoreConnector: pipeline parallelism splits a block's layers; not supported")
        self.world = parallel.tensor_parallel_size
        self.groups = stored_groups(kv_cache_config, _page_format())
        try:
            self.codec = self.groups.check_codec(str(extra.get("codec", RAW)))
        except ValueError as exc:
            raise ValueError(f"KVStoreConnector: kv_connector_extra_config.codec: {exc}") from None
        self.block_tokens = self.groups.block_tokens
        self.asynchronous = len(kv_cache_config.kv_cache_groups) > 1  # see the module docstring
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning("KVStoreConnector: kv_load_failure_policy is %r: a load that fails (a daemon dying under "
                        "it) fails its request; \"recompute\" recomputes it instead",
                        policy)
        self._full_index = {name: i for i, name in enumerate(self.groups.full_layers)}
        self._window_index = {name: i for i, name in enumerate(self.groups.window_layers)}
        self._window_group_ids = sorted({self.groups.group_of[name] for name in self.groups.window_layers})
        self._namespaces: dict[tuple[str | None, int], Namespaces] = {}
        # scheduler side
        self._hits: dict[str, int] = {}  # request -> leading prompt blocks a load brings (with vLLM's own)
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[Transfer] = []
        # worker side
        self._kv: dict[str, torch.Tensor] = {}  # layer -> [num_blocks, *page], from register_kv_caches
        self._loading: list[_Load] = []  # this step's layer-pipelined loads (one group)
        self._receiving: dict[str, _Load] = {}  # asynchronous loads by request (several groups)
        self._saving: dict[int, tuple[Transfer, torch.Tensor, torch.Tensor | None, set[str]]] = {}
        self._save_failed = 0  # layers whose pages could not be copied (their steps' saves skipped)
        self._load_errors: set[int] = set()

    # -- the store ---------------------------------------------------------------------------------

    @property
    def client(self) -> StoreClient:
        return self.store.get()

    def namespaces(self, cache_salt: str | None, rank: int = 0) -> Namespaces:
        spaces = self._namespaces.get((cache_salt, rank))
        if spaces is None:
            if len(self._namespaces) >= MAX_NAMESPACES:  # callers choose salts: a bound, not one entry each
                self._namespaces.clear()
            spaces = namespaces(self.groups, self.model_id, self.tenant, cache_salt, rank, self.world, self.codec)
            self._namespaces[(cache_salt, rank)] = spaces
        return spaces

    def _rank(self) -> int:
        if self.world == 1:
            return 0
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    # -- scheduler side ----------------------------------------------------------------------------

    @staticmethod
    def _cacheable(request: Request) -> bool:
        """Whether the request's KV is a function of its token ids."""
        return not (request.prompt_token_ids is None or request.mm_features or request.lora_request is not None
                    or getattr(request, "prompt_embeds", None) is not None)

    def _resume(self, tokens: list[int], cache_salt: str | None, local: int) -> int:
        """The longest resume in blocks, over every rank, that the store can bring beyond `local`."""
        best = None
        for rank in range(self.world):
            spaces = self.namespaces(cache_salt, rank)
            # the workers load the hit once the scheduler has pages for it, steps later where it waits for
            # them: the daemons start bringing it from SSD into DRAM meanwhile, behind their reads
            full_hit = self.client.lookup(spaces.full.blocks(tokens), promote=True)
            if spaces.window is None or full_hit <= local:
                rank_best = max(full_hit, local)
            else:
                present = self.client.present(spaces.window.blocks(tokens[: full_hit * self.block_tokens])[local:])
                rank_best = self.groups.best_resume(full_hit, local,
                                                    lambda begin, end: all(present[begin - local : end - local]))
            best = rank_best if best is None else min(best, rank_best)
        return best or 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        usable = (len(request.prompt_token_ids or ()) - 1) // self.block_tokens  # vLLM computes the last token
        local = num_computed_tokens // self.block_tokens
        if not self._cacheable(request) or usable * self.block_tokens <= num_computed_tokens:
            self._hits[request.request_id] = 0
            return 0, False
        try:  # each lookup asks every daemon in one round
            hit = self._resume(list(request.prompt_token_ids[: usable * self.block_tokens]), request.cache_salt,
                               local)
        except Exception as exc:  # noqa: BLE001 - a store that fails is a miss
            log.warning("kvstore lookup failed: %s", exc)
            hit = 0
        self._hits[request.request_id] = hit
        external = max(0, hit * self.block_tokens - num_computed_tokens)
        return external, self.asynchronous and external > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if not self._cacheable(request):
            return
        hit = self._hits.get(request.request_id, 0)
        if num_external_tokens > 0:
            first = hit - num_external_tokens // self.block_tokens
            ids = [list(group[first:hit]) for group in blocks.get_block_ids()]
            tokens = list(request.prompt_token_ids[: hit * self.block_tokens])
            window_first = max(first, hit - self.groups.window_blocks) if self.groups.hybrid else hit
            self._loads.append(Transfer(request.request_id, request.cache_salt, tokens, first, ids, window_first))
        if request.request_id not in self._tracked:
            self._tracked[request.request_id] = _Tracked(request, request.cache_salt, saved=hit)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self._loads)
        self._loads = []
        computed: dict[str, int] = {}  # request -> tokens whose KV is in its pages once this step ran
        for new in scheduler_output.scheduled_new_reqs:
            if (tracked := self._tracked.get(new.req_id)) is not None:
                tracked.block_ids = [list(group) for group in new.block_ids]
                computed[new.req_id] = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (tracked := self._tracked.get(req_id)) is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after a preemption: all of its blocks anew
                tracked.block_ids = [list(group) for group in new_ids] if new_ids else []
            elif new_ids is not None:
                for group, more in zip(tracked.block_ids, new_ids, strict=True):
                    group.extend(more)
            computed[req_id] = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
        for req_id, tokens in computed.items():
            tracked = self._tracked[req_id]
            prompt = tracked.request.prompt_token_ids
            allocated = min((len(group) for group in tracked.block_ids), default=0)
            full = min(tokens, len(prompt), allocated * self.block_tokens) // self.block_tokens
            if full > tracked.saved:
                last = len(prompt) // self.block_tokens
                window = self.groups.window_range(last)
                # a chunk of a long prompt may end before its last window begins: then no window blocks yet
                window_first = min(full, max(tracked.saved, window.start)) if window else full
                if any(tracked.block_ids[g][i] == 0 for g in self._window_group_ids for i in range(window_first, full)):
                    window_first = full  # a window block vLLM already let go (null): not the prompt's window
                meta.saves.append(Transfer(req_id, tracked.cache_salt, list(prompt[: full * self.block_tokens]),
                                           tracked.saved, [group[tracked.saved : full] for group in tracked.block_ids],
                                           window_first))
                tracked.saved = full
            if tracked.saved == len(prompt) // self.block_tokens:
                del self._tracked[req_id]  # every full prompt block is saved: nothing more to follow
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._hits.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)
        return False, None  # saves copy the pages out in the forward pass: the blocks may be freed now

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # -- worker side -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's KV cache tensors, one per attention layer; refused where a page is not the namespace's."""
        for name in (*self.groups.full_layers, *self.groups.window_layers):
            kv = kv_caches[name]
            tensor = kv[0] if isinstance(kv, (list, tuple)) else kv
            if tuple(tensor.shape[1:]) != self.groups.page_shape():
                raise ValueError(f"KVStoreConnector: layer {name}'s KV cache is {tuple(tensor.shape)}, not pages of "
                                 f"{self.groups.page_shape()} ({self.groups.page} layout)")
            self._kv[name] = tensor

    def _layer(self, name: str, forward_context: ForwardContext) -> torch.Tensor:
        """A layer's KV cache, [num_blocks, *page]: registered, else the attention layer's own."""
        if name in self._kv:
            return self._kv[name]
        kv = forward_context.no_compile_layers[name].kv_cache
        return kv[0] if isinstance(kv, (list, tuple)) else kv

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        for transfer in meta.loads:
            try:
                handles = self._start_load(transfer, forward_context)
            except Exception as exc:  # noqa: BLE001 - not loaded: vLLM recomputes these blocks
                log.warning("kvstore load failed: %s", exc)
                handles = None
            if self.asynchronous:
                self._receiving[transfer.req_id] = _Load(transfer, handles)
            else:
                self._loading.append(_Load(transfer, handles))

    def _start_load(self, transfer: Transfer, forward_context: ForwardContext) -> list[tuple[LoadHandle, int]]:
        spaces = self.namespaces(transfer.cache_salt, self._rank())
        handles = []
        chains = [(spaces.full, self.groups.full_layers, transfer.first)]
        if spaces.window is not None and transfer.window_first < transfer.end:
            chains.append((spaces.window, self.groups.window_layers, transfer.window_first))
        for space, names, first in chains:
            tables = pages_of(transfer.block_ids, self.groups, names, first - transfer.first,
                              transfer.end - transfer.first)
            if any(page == 0 for table in tables for page in table):
                raise ValueError("a block to load is vLLM's null block")
            destination = _destination([self._layer(name, forward_context) for name in names], tables)
            if destination.layer_bytes != space.layer_bytes:
                raise ValueError(f"a page of {destination.layer_bytes} bytes is not a stored block's layer")
            blocks = space.blocks(transfer.tokens)[first : transfer.end]
            handles.append((self.client.load(blocks, destination, hit_blocks=len(blocks)), len(blocks)))
        return handles

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._full_index.get(layer_name)
        if layer is None or self.asynchronous:
            return
        for load in self._loading:
            if load.handles is None:
                continue
            handle = load.handles[0][0]
            try:
                handle.wait_layer(layer, self.client_config.timeout_s)
            except (TimeoutError, LoadCancelled) as exc:  # a stalled load: what has not arrived is recomputed
                log.warning("kvstore load of layer %d stalled: %s", layer, exc)
                handle.cancel()
                load.handles = None
                self._load_errors.update(load.transfer.block_ids[0])

    def _finish_loads(self) -> None:
        for load in self._loading:
            delivered = _delivered(load, self.client_config.timeout_s, self.block_tokens)
            self._load_errors.update(load.transfer.block_ids[0][delivered:])  # the hit shrank: a daemon died
        self._loading = []

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Copy this layer's pages of this step's saves. vLLM's attention calls this without a guard, so a
        fault here would end the engine: it skips the step's saves instead (blocks not saved are not cached)."""
        try:
            self._save_layer(layer_name, kv_layer)
        except Exception as exc:  # noqa: BLE001
            if not self._save_failed:
                log.error("kvstore: saving this step's blocks failed, they are not cached: %s", exc)
            self._save_failed += 1
            self._saving = {}

    def _save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        full, window = self._full_index.get(layer_name), self._window_index.get(layer_name)
        if (full is None and window is None) or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata):
            return
        group = self.groups.group_of[layer_name]
        for transfer in meta.saves:
            entry = self._saving.get(id(transfer))
            if entry is None:  # (blocks, layers, *page): each block's payload, layer-major
                blocks = len(transfer.block_ids[0])
                full_pages = torch.empty((blocks, len(self.groups.full_layers), *kv_layer.shape[1:]),
                                         dtype=kv_layer.dtype)
                window_blocks = transfer.end - transfer.window_first
                window_pages = torch.empty((window_blocks, len(self.groups.window_layers), *kv_layer.shape[1:]),
                                           dtype=kv_layer.dtype) if window_blocks and self.groups.hybrid else None
                entry = self._saving[id(transfer)] = (transfer, full_pages, window_pages, set())
            ids = transfer.block_ids[group]
            pages: torch.Tensor | None = None
            if full is not None:
                pages, index, begin = entry[1], full, 0
            elif window is not None:  # (one of the two is this layer's index: checked above)
                pages, index, begin = entry[2], window, transfer.window_first - transfer.first
            if pages is not None:  # a copy: the blocks may be reused once the step is over
                pages[:, index].copy_(kv_layer[torch.tensor(ids[begin:], dtype=torch.long, device=kv_layer.device)])
            entry[3].add(layer_name)

    def wait_for_save(self) -> None:
        if not self.asynchronous:
            self._finish_loads()
        saving, self._saving = self._saving, {}
        layers = len(self.groups.full_layers) + len(self.groups.window_layers)
        for transfer, full_pages, window_pages, seen in saving.values():
            if len(seen) != layers:
                continue  # a layer was not seen this step: not a whole block
            spaces = self.namespaces(transfer.cache_salt, self._rank())
            chains = [(spaces.full, full_pages, transfer.first)]
            if spaces.window is not None and window_pages is not None:
                chains.append((spaces.window, window_pages, transfer.window_first))
            for space, pages, first in chains:
                data = pages.reshape(-1).view(torch.uint8).numpy().data.cast("B")
                size = len(data) // pages.shape[0]
                blocks = space.blocks(transfer.tokens)[first : transfer.end]
                items = [(block, data[i * size : (i + 1) * size]) for i, block in enumerate(blocks)]
                try:
                    self.client.save(items, space.num_layers, self.traffic_class)  # write-behind: never waits
                except Exception as exc:  # noqa: BLE001 - a block not saved is simply not cached
                    log.warning("kvstore save failed: %s", exc)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued save is stored (tests, benchmarks, shutdown)."""
        client = self.store.existing
        return client is None or client.write_behind.flush(timeout_s)

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Asynchronous loads that are whole (finished) or short (finished and failed: vLLM recomputes)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        finished, failed = set(), set()
        now = time.monotonic()
        for req_id, load in list(self._receiving.items()):
            pending = load.handles is not None and not all(handle.done for handle, _ in load.handles)
            if pending and now - load.started < 2 * self.client_config.timeout_s:
                continue
            delivered = _delivered(load, 0.0 if pending else None, self.block_tokens)
            finished.add(req_id)
            if delivered < len(load.transfer.block_ids[0]):
                log.warning("kvstore load of %d blocks delivered %d: recomputed", len(load.transfer.block_ids[0]),
                            delivered)
                failed.add(req_id)
            del self._receiving[req_id]
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self.asynchronous:
            self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for load in self._receiving.values():
            for handle, _ in load.handles or ():
                handle.cancel()
        self.store.close()  # flushes the write-behind queue


def _delivered(load: _Load, timeout_s: float | None, block_tokens: int) -> int:
    """Leading blocks of the transfer whose every chain arrived; a load not done by `timeout_s` is
    cancelled and counts as none."""
    if load.handles is None:
        return 0
    transfer = load.transfer
    delivered = len(transfer.block_ids[0])
    for i, (handle, blocks) in enumerate(load.handles):
        try:
            hit = handle.wait(timeout_s) // block_tokens
        except (TimeoutError, LoadCancelled):
            handle.cancel()
            hit = 0
        if hit < blocks:  # the full chain short at hit; a short window chain leaves no usable resume
            delivered = min(delivered, hit if i == 0 else transfer.window_first - transfer.first)
    return delivered


def _destination(layers: Sequence[torch.Tensor], tables: Sequence[Sequence[int]]):
    """Where a load lands: vLLM's pages themselves (PagedKV) where each layer's tensor is contiguous; else
    host staging copied into the (strided) pages."""
    if all(t.is_contiguous() for t in layers):
        return PagedKV(layers, tables)
    return _StagedPages(layers, tables)


class _StagedPages:
    """A load destination over pages that are not contiguous (e.g. vLLM's HND layout under the NHD view):
    host staging of the whole load, each (layer, block) copied into its page once verified."""

    host_resident = True

    def __init__(self, layers: Sequence[torch.Tensor], tables: Sequence[Sequence[int]]) -> None:
        self.layers, self.tables, self.num_layers = list(layers), [list(t) for t in tables], len(layers)
        page = layers[0][0]
        self.layer_bytes = page.numel() * page.element_size()
        blocks = len(self.tables[0])
        # (layers, blocks, layer_bytes) uint8
        self._staging = torch.empty((self.num_layers, blocks, self.layer_bytes), dtype=torch.uint8)
        self._view = self._staging.numpy().data.cast("B")
        self._blocks = blocks

    def layer_view(self, layer: int, block: int) -> memoryview:
        start = (layer * self._blocks + block) * self.layer_bytes
        return self._view[start : start + self.layer_bytes]

    def layer_written(self, layer: int, block: int) -> None:
        page = self.layers[layer][self.tables[layer][block]]  # one block's page, strided
        page.copy_(self._staging[layer, block].view(page.dtype).view(page.shape))

    def layer_complete(self, layer: int) -> None:
        pass

    def wait_layer(self, layer: int) -> None:
        pass
