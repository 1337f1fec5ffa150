"""vLLM's KV connector on the store's own chained block keys (vLLM 0.33.0).

    vllm serve MODEL --block-size 16 --kv-transfer-config '{
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "servers": "10.0.0.1:50051,10.0.0.2:50051",   # or $KVSTORE_SERVERS
            "model_id": "gemma-3-270m@1f2e...",  # optional: the namespace's model identity (default: the model)
            "tenant": "team-a",         # optional: the namespace salt of requests without a cache_salt
            "traffic_class": "chat",    # optional: the daemons' retention class
            "timeout_s": 5.0,           # optional: the deadline of each call
            "write_behind_bytes": 268435456}}'  # optional: saves queued beyond this are dropped (counted)

A secured cluster's `token_file`, `tls_ca`, `tls_cert`, `tls_key` and `tls_server_name` settings are
optional, each over its KVSTORE_* variable (docs/operations.md); a token is read from a file, never put
in the JSON (which shows in `ps` and in vLLM's logs).

This path sees the prompt's token ids, so a request's blocks are the store's own:
`Namespace(model_id, KVLayout(layers, kv_heads, head_dim, dtype), block_size, salt).blocks(prompt)`, the
salt being the request's `cache_salt`, else the configured tenant. A stored block's payload is layer-major:
per attention layer (in model order), that layer's page `[2, block_size, kv_heads, head_dim]`, K then V,
which is exactly vLLM's `kv_cache[block_id]` of the layer's `[num_blocks, 2, block_size, H, D]` view, and
exactly what this project's prefill engine writes and loads (`engine/model/kv.py`: a page is
`(2, block_tokens, kv_heads, head_dim)`, `PrefillEngine._payload`: full layers, layer-major).

**The layouts agree, and vLLM and `engine/prefill` hit each other's blocks**, where all of these hold:
the same model identity (`model_id` here, `PrefillConfig.model_id` there), every layer full attention
(Qwen2/Qwen3/Llama-style: the engine's full layers are then all the layers), the same KV dtype (vLLM's
kv-cache dtype "auto" is the model's; fp8 KV caches are another layout), vLLM's `--block-size` equal to
`PrefillConfig.block_tokens`, tensor parallel size 1 (a rank of TP=n holds 1/n of the heads: its blocks
live under `model_id#tp<r>/<n>`, its own), and the same salt. Models with sliding-window, chunked-local or
MLA layers (several KV cache groups), pipeline parallelism, and multimodal, LoRA or prompt-embedding
requests are refused (the first three at start-up, the last three are simply never loaded or saved): their
KV is not a function of the token ids in this layout.

Scheduler side: `get_num_new_matched_tokens` asks every daemon in one round for the leading run of the
prompt's full blocks (never the last token, which vLLM must compute) and offers what lies beyond vLLM's
own prefix cache; `build_connector_meta` names the blocks to load and those that become full this step
to save. Worker side: `start_load_kv` starts the client's layer-pipelined load straight into vLLM's pages
(`kvstore.client.torch_kv.PagedKV`: in place on the CPU, pinned staging and a copy stream on CUDA);
`wait_for_layer_load(layer)` returns once that layer of every loaded block is in place;
`save_kv_layer` copies the layer's new pages out; `wait_for_save` queues the blocks on the client's
write-behind, so no forward pass waits on the store. A dead or slow daemon is a miss: a lookup of 0, or,
mid-load, the blocks that did not arrive reported through `get_block_ids_with_load_errors` (vLLM's
`kv_load_failure_policy` "recompute" recomputes them); never an exception in vLLM. The client connects on
first use.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvstore.block import Block, KVLayout, Namespace
from kvstore.client import KVClient
from kvstore.client.loading import LoadCancelled, LoadHandle
from kvstore.client.torch_kv import PagedKV
from kvstore.connectors.store import SETTINGS, LazyClient, client_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
          torch.float8_e4m3fn: "float8_e4m3fn", torch.int8: "int8"}


@dataclass
class Transfer:
    """Blocks [first, first + len(block_ids)) of a request's prompt, in vLLM's blocks `block_ids`."""

    req_id: str
    salt: str
    tokens: list[int]  # the prompt up to the transfer's last block: each worker keys its own rank's blocks
    first: int
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request whose prompt blocks are still being computed (scheduler side)."""

    request: Request
    salt: str
    saved: int  # prompt blocks [0, saved) are in the store or queued to be saved
    block_ids: list[int] = field(default_factory=list)


def kv_layout(kv_cache_config: KVCacheConfig) -> tuple[list[str], KVLayout, int]:
    """Attention layer names in model order, the stored layout and the block size, or ValueError where
    the model's KV is not this connector's layout (one group of plain full-attention layers)."""
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if (not isinstance(spec, FullAttentionSpec) or spec.sliding_window or spec.attention_chunk_size
            or spec.head_size_v != spec.head_size or spec.dtype not in DTYPES
            or str(getattr(spec.kv_quant_mode, "name", "NONE")) != "NONE"):
        raise ValueError(f"KVStoreConnector stores one group of full-attention layers with K and V of one "
                         f"head size, got {[type(g.kv_cache_spec).__name__ for g in groups]}: {spec}")
    names = sorted(groups[0].layer_names, key=extract_layer_index)
    return names, KVLayout(len(names), spec.num_kv_heads, spec.head_size, DTYPES[spec.dtype]), spec.block_size


class KVStoreConnector(KVConnectorBase_V1):
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
        self.model_id = str(extra.get("model_id") or (model.model if model is not None else ""))
        if not self.model_id:
            raise ValueError("KVStoreConnector needs kv_connector_extra_config.model_id or a model")
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ValueError("KVStoreConnector: pipeline parallelism splits a block's layers; not supported")
        self.world = parallel.tensor_parallel_size
        self.layer_names, self.layout, self.block_tokens = kv_layout(kv_cache_config)
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self._namespaces: dict[tuple[str, int], Namespace] = {}
        # scheduler side
        self._hits: dict[str, int] = {}  # request -> leading prompt blocks in the store
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[Transfer] = []
        # worker side
        self._loading: list[tuple[Transfer, LoadHandle | None]] = []
        self._saving: dict[int, tuple[Transfer, torch.Tensor, set[int]]] = {}  # id -> (transfer, host pages, layers)
        self._load_errors: set[int] = set()

    # -- the store ---------------------------------------------------------------------------------

    @property
    def client(self) -> KVClient:
        return self.store.get()

    def namespace(self, salt: str, rank: int = 0) -> Namespace:
        space = self._namespaces.get((salt, rank))
        if space is None:
            model_id = self.model_id if self.world == 1 else f"{self.model_id}#tp{rank}/{self.world}"
            space = self._namespaces[(salt, rank)] = Namespace(model_id, self.layout, self.block_tokens, salt)
        return space

    def _rank(self) -> int:
        if self.world == 1:
            return 0
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def _blocks(self, transfer: Transfer) -> list[Block]:
        return self.namespace(transfer.salt, self._rank()).blocks(transfer.tokens)[transfer.first :]

    # -- scheduler side ----------------------------------------------------------------------------

    def _salt(self, request: Request) -> str | None:
        """The namespace salt of a request whose KV is a function of its token ids; None for any other."""
        if request.prompt_token_ids is None or request.mm_features or request.lora_request is not None \
                or getattr(request, "prompt_embeds", None) is not None:
            return None
        return request.cache_salt or self.tenant

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        salt = self._salt(request)
        usable = (len(request.prompt_token_ids or ()) - 1) // self.block_tokens  # vLLM computes the last token
        if salt is None or usable * self.block_tokens <= num_computed_tokens:
            self._hits[request.request_id] = 0
            return 0, False
        tokens = request.prompt_token_ids[: usable * self.block_tokens]
        try:  # every rank's blocks must be there; each lookup asks every daemon in one round
            hit = min(self.client.lookup(self.namespace(salt, rank).blocks(tokens)) for rank in range(self.world))
        except Exception as exc:  # noqa: BLE001 - a store that fails is a miss
            log.warning("kvstore lookup failed: %s", exc)
            hit = 0
        self._hits[request.request_id] = hit
        return max(0, hit * self.block_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        salt = self._salt(request)
        if salt is None:
            return
        hit = self._hits.get(request.request_id, 0)
        if num_external_tokens > 0:
            loaded = num_external_tokens // self.block_tokens
            block_ids = list(blocks.get_block_ids()[0])
            tokens = list(request.prompt_token_ids[: hit * self.block_tokens])
            self._loads.append(Transfer(request.request_id, salt, tokens, hit - loaded, block_ids[hit - loaded : hit]))
        if request.request_id not in self._tracked:
            self._tracked[request.request_id] = _Tracked(request, salt, saved=hit)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self._loads)
        self._loads = []
        computed: dict[str, int] = {}  # request -> tokens whose KV is in its pages once this step ran
        for new in scheduler_output.scheduled_new_reqs:
            if (tracked := self._tracked.get(new.req_id)) is not None:
                tracked.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (tracked := self._tracked.get(req_id)) is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after a preemption: all of its blocks anew
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
        for req_id, tokens in computed.items():
            tracked = self._tracked[req_id]
            prompt = tracked.request.prompt_token_ids
            full = min(tokens, len(prompt), len(tracked.block_ids) * self.block_tokens) // self.block_tokens
            if full > tracked.saved:
                meta.saves.append(Transfer(req_id, tracked.salt, list(prompt[: full * self.block_tokens]),
                                           tracked.saved, tracked.block_ids[tracked.saved : full]))
                tracked.saved = full
            if tracked.saved == len(prompt) // self.block_tokens:
                del self._tracked[req_id]  # every full prompt block is saved: nothing more to follow
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._hits.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)
        return False, None  # saves copy the pages out in the forward pass: the blocks may be freed now

    # -- worker side -------------------------------------------------------------------------------

    def _layers(self, forward_context: ForwardContext) -> list[torch.Tensor]:
        """Each attention layer's KV cache, [num_blocks, 2, block_size, H, D], in model order."""
        layers = []
        for name in self.layer_names:
            kv = forward_context.no_compile_layers[name].kv_cache
            layers.append(kv[0] if isinstance(kv, (list, tuple)) else kv)
        return layers

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        layers = self._layers(forward_context)
        for transfer in meta.loads:
            try:
                destination = _destination(layers, transfer.block_ids)
                if destination.layer_bytes != self.layout.layer_bytes(self.block_tokens):
                    raise ValueError(f"a page of {destination.layer_bytes} bytes is not a stored block's layer")
                handle = self.client.load(self._blocks(transfer), destination, hit_blocks=len(transfer.block_ids))
            except Exception as exc:  # noqa: BLE001 - not loaded: vLLM recomputes these blocks
                log.warning("kvstore load failed: %s", exc)
                handle = None
            self._loading.append((transfer, handle))

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for i, (transfer, handle) in enumerate(self._loading):
            if handle is None:
                continue
            try:
                handle.wait_layer(layer, self.client_config.timeout_s)
            except (TimeoutError, LoadCancelled) as exc:  # a stalled load: what has not arrived is recomputed
                log.warning("kvstore load of layer %d stalled: %s", layer, exc)
                handle.cancel()
                self._load_errors.update(transfer.block_ids)
                self._loading[i] = (transfer, None)

    def _finish_loads(self) -> None:
        for transfer, handle in self._loading:
            if handle is None:
                self._load_errors.update(transfer.block_ids)
                continue
            try:
                hit = handle.wait(self.client_config.timeout_s) // self.block_tokens
            except (TimeoutError, LoadCancelled):
                handle.cancel()
                hit = 0
            self._load_errors.update(transfer.block_ids[hit:])  # the hit shrank: a daemon died mid-load
        self._loading = []

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata):
            return
        for transfer in meta.saves:
            entry = self._saving.get(id(transfer))
            if entry is None:  # (blocks, layers, 2, block_size, H, D): each block's payload, layer-major
                pages = torch.empty((len(transfer.block_ids), self.layout.num_layers, *kv_layer.shape[1:]),
                                    dtype=kv_layer.dtype)
                entry = self._saving[id(transfer)] = (transfer, pages, set())
            ids = torch.tensor(transfer.block_ids, dtype=torch.long, device=kv_layer.device)
            entry[1][:, layer].copy_(kv_layer[ids])  # a copy: the blocks may be reused once the step is over
            entry[2].add(layer)

    def wait_for_save(self) -> None:
        self._finish_loads()
        saving, self._saving = self._saving, {}
        for transfer, pages, layers in saving.values():
            if len(layers) != self.layout.num_layers:
                continue  # a layer was not seen this step: not a whole block
            if pages[0].numel() * pages.element_size() != self.layout.layer_bytes(self.block_tokens) * len(layers):
                log.warning("kvstore save skipped: pages of shape %s are not this layout", tuple(pages.shape[2:]))
                continue
            data = memoryview(pages.view(-1).view(torch.uint8).numpy()).cast("B")
            size = len(data) // len(transfer.block_ids)
            items = [(block, data[i * size : (i + 1) * size]) for i, block in enumerate(self._blocks(transfer))]
            try:
                self.client.save(items, self.layout.num_layers, self.traffic_class)  # write-behind: never waits
            except Exception as exc:  # noqa: BLE001 - a block not saved is simply not cached
                log.warning("kvstore save failed: %s", exc)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued save is stored (tests, benchmarks, shutdown)."""
        client = self.store.existing
        return client is None or client.write_behind.flush(timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads finish within the step, saves need no blocks kept

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.store.close()  # flushes the write-behind queue


def _destination(layers: Sequence[torch.Tensor], block_ids: list[int]):
    """Where a load lands: vLLM's pages themselves (PagedKV) where each layer's tensor is contiguous
    [num_blocks, 2, block_size, H, D]; else host staging copied into the (strided) pages."""
    if all(t.is_contiguous() for t in layers):
        return PagedKV(layers, block_ids)
    return _StagedPages(layers, block_ids)


class _StagedPages:
    """A load destination over pages that are not contiguous (e.g. vLLM's HND layout under the NHD view):
    host staging of the whole load, each (layer, block) copied into its page once verified."""

    host_resident = True

    def __init__(self, layers: Sequence[torch.Tensor], block_ids: list[int]) -> None:
        self.layers, self.block_ids, self.num_layers = list(layers), list(block_ids), len(layers)
        page = layers[0][0]
        self.layer_bytes = page.numel() * page.element_size()
        # (layers, blocks, layer_bytes) uint8
        self._staging = torch.empty((self.num_layers, len(block_ids), self.layer_bytes), dtype=torch.uint8)
        self._view = memoryview(self._staging.numpy()).cast("B")

    def layer_view(self, layer: int, block: int) -> memoryview:
        start = (layer * len(self.block_ids) + block) * self.layer_bytes
        return self._view[start : start + self.layer_bytes]

    def layer_written(self, layer: int, block: int) -> None:
        page = self.layers[layer][self.block_ids[block]]  # (2, block_size, H, D), strided
        page.copy_(self._staging[layer, block].view(page.dtype).view(page.shape))

    def layer_complete(self, layer: int) -> None:
        pass

    def wait_layer(self, layer: int) -> None:
        pass
