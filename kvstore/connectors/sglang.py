"""SGLang HiCache's storage backend (the L3 tier below its host memory): pages stored in the daemons
(SGLang 0.5.23).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCache", "interface_v1": 1,
            "servers": "10.0.0.1:50051,10.0.0.2:50051", "tenant": "team-a", "traffic_class": "chat"}'

`servers` falls back to $KVSTORE_SERVERS; `timeout_s` (the deadline of each call), `token_file` and
`tls_ca`, `tls_cert`, `tls_key`, `tls_server_name` are optional, each over its KVSTORE_* variable. The
model is named by a digest of its folder's config and weights (`identity.checkpoint_identity`; SGLang's
`model_name` must then be the model's local folder), or by `model_id`, the operator's promise that every
server using it serves the same weights.

A page is one record under the block identity of SGLang's key for it (a SHA-256 chain string, the same on
every tensor-parallel rank; `kvstore.connectors.identity`), in a namespace naming the model, the host
pool (KV, SWA, ...), its layout (`page_first`, `page_first_direct`, `layer_first`, ...), dtype and
geometry, the page size and the rank (an MLA model's KV is the same on every rank, so it is stored once).
The record's bytes are SGLang's flat data page (`get_data_page(index, flat=True)`), and its layers are
the page's pieces in host memory (`get_page_buffer_meta`: K and V, or K and V of each layer), so:

  - the zero-copy interface (`interface_v1`: `batch_get_v1`, `batch_set_v1` over `host_indices`) reads
    each piece straight out of and into SGLang's host pool, with no staging copy (MHA pools; others,
    such as MLA's, through their flat data pages);
  - the generic interface (`get`, `set`, `batch_get`, `batch_set`, `exists`) stores the same bytes, so
    pages written one way are read the other;
  - the hybrid interface (`register_mem_host_pool_v2`, `batch_exists_v2`, `batch_get_v2`,
    `batch_set_v2`) keeps each extra pool's pages (an SWA model's window, a Mamba state) the same way,
    with SGLang's hit policies: ALL_PAGES (every page of the hit) and TRAILING_PAGES (the last N pages
    before each restorable prefix length). Without it a sliding-window model gets no storage hits.

Every call is a miss (False, 0, None) when the store fails or a deadline passes, never an exception in
SGLang's controller threads; a batch of up to 128 pages is one round to all daemons. The client connects
on the first call.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from kvstore.block import Block
from kvstore.client import StoreClient
from kvstore.client.loading import LayerViews
from kvstore.connectors.identity import KEY_TOKENS, EngineIdentity, model_identity
from kvstore.connectors.store import SETTINGS, LazyClient, client_config

log = logging.getLogger(__name__)
_logged: set[str] = set()  # refusals that come from configuration repeat on every prefetch: logged once each


def _once(cause: str, message: str) -> None:
    if cause not in _logged and len(_logged) < 256:
        _logged.add(cause)
        log.error("%s (logged once)", message)
# MHA host layouts whose pages lie in host memory as equal K and V pieces (get_page_buffer_meta); other
# pools (MLA, Mamba, DSA, ...) are stored through their flat data pages, a copy each way
ZERO_COPY_LAYOUTS = ("page_first", "page_first_direct", "layer_first", "page_head")


class HostPages:
    """One of SGLang's host pools as the store sees it: its block identity and each page's pieces."""

    def __init__(self, name: str, host_pool: Any, config: HiCacheStorageConfig, tenant: str, model: str) -> None:
        self.name, self.host = str(name), host_pool
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        self.zero_copy = isinstance(host_pool, MHATokenToKVPoolHost) and host_pool.layout in ZERO_COPY_LAYOUTS
        geometry = ",".join(f"{field}={getattr(host_pool, field)}" for field in
                            ("layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "size_per_token")
                            if getattr(host_pool, field, None) is not None)
        dtype = str(getattr(host_pool, "dtype", "?")).removeprefix("torch.")
        shard = f",pp={config.pp_rank}/{config.pp_size}" + (
            f",cp={config.attn_cp_rank}/{config.attn_cp_size}" if config.attn_cp_size > 1 else "")
        layout = (f"{self.name}:{type(host_pool).__name__}:{getattr(host_pool, 'layout', '?')}:{dtype}:{geometry}"
                  f"{shard}:{'pieces' if self.zero_copy else 'flat'}")
        # an MLA model's latent KV is the same on every TP rank: one copy serves all (a Mamba state is not)
        replicated = config.is_mla_model and self.name != PoolName.MAMBA
        self.identity = EngineIdentity("sglang", model, layout, self.page_size,
                                       0 if replicated else config.tp_rank, 1 if replicated else config.tp_size,
                                       tenant)
        first = (self.pieces(self._first_page())[0] if self.zero_copy
                 else [_bytes_of(host_pool.get_dummy_flat_data_page())])
        if len({len(piece) for piece in first}) != 1:
            raise ValueError(f"SGLang's {self.name} host pool has pieces of unequal sizes; pass it as flat pages")
        self.pieces_per_page, self.piece_bytes = len(first), len(first[0])
        self.page_bytes = sum(len(piece) for piece in first)

    def _first_page(self) -> torch.Tensor:
        return torch.arange(self.page_size, dtype=torch.int64)  # pieces' count and size are the same for all

    def blocks(self, keys: Sequence[str]) -> list[Block]:
        return self.identity.blocks(keys)

    def page_starts(self, host_indices: torch.Tensor) -> list[int]:
        """The first slot of each page of `host_indices`, after checking that every page is whole: page_size
        consecutive slots from an aligned start, inside the pool. SGLang addresses a page by its first index
        alone (its meta and its flat pages), so a page whose other indices differ would put KV in slots its
        radix tree does not point at, and a start outside the pool would be a pointer outside its buffer."""
        size = self.page_size
        if host_indices.dim() != 1 or host_indices.numel() % size:
            raise IndexError(f"{host_indices.numel()} host indices are not whole pages of {size} slots")
        pages = host_indices.to(torch.int64).view(-1, size)
        firsts = pages[:, 0]
        if pages.numel() and (bool((firsts % size).any()) or int(firsts.min()) < 0
                              or int(firsts.max()) + size > self.host.size
                              or not torch.equal(pages - firsts[:, None], torch.arange(size).expand_as(pages))):
            raise IndexError(f"host indices outside the {self.name} pool's {self.host.size} slots, not "
                             "page-aligned, or not consecutive within a page")
        return firsts.tolist()

    def pieces(self, host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Per page of `host_indices` (page_size indices each), its pieces in host memory, in the order of
        the flat data page: K before V (for layer_first, K of every layer, then V of every layer)."""
        pages = len(self.page_starts(host_indices))  # raw pointers must stay inside SGLang's buffer
        pointers, sizes = self.host.get_page_buffer_meta(host_indices)
        per_page = len(pointers) // pages
        out = []
        for page in range(pages):
            span = range(page * per_page, (page + 1) * per_page)
            order = [*span[0::2], *span[1::2]]  # the meta interleaves K and V pieces
            out.append([memoryview((ctypes.c_char * sizes[i]).from_address(pointers[i])).cast("B") for i in order])
        return out


class KVStoreHiCache(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        settings = {name: extra[name] for name in SETTINGS if name in extra}
        self.client_config = client_config(settings, "--hicache-storage-backend-extra-config ")
        self.store = LazyClient(self.client_config)
        self.storage_config = storage_config
        self.tenant = str(settings.get("tenant", ""))
        self.model = model_identity(storage_config.model_name, settings.get("model_id"),
                                    "--hicache-storage-backend-extra-config model_id")
        self.traffic_class = str(settings.get("traffic_class", "chat"))
        self.pools: dict[str, HostPages] = {}
        # a page that waits longer than this for the daemons is a miss (the client's own deadlines end
        # every call well before; this bounds a load that somehow did not)
        self.load_deadline_s = 2 * self.client_config.timeout_s + 1.0

    @property
    def client(self) -> StoreClient:
        return self.store.get()

    # -- registration -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.pools[PoolName.KV] = HostPages(PoolName.KV, mem_pool_host, self.storage_config, self.tenant, self.model)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.pools[str(host_pool_name)] = HostPages(host_pool_name, host_pool, self.storage_config, self.tenant,
                                                    self.model)

    @property
    def kv(self) -> HostPages:
        if PoolName.KV not in self.pools:
            raise RuntimeError("KVStoreHiCache: SGLang has not registered its host KV pool yet")
        return self.pools[PoolName.KV]

    # -- the store's calls, each a miss on any failure --------------------------------------------

    def _leading(self, pool: HostPages, keys: Sequence[str]) -> int:
        try:
            return self.client.lookup(pool.blocks(keys)) if keys else 0
        except Exception as exc:  # noqa: BLE001 - a store that fails is a miss
            log.warning("kvstore lookup failed: %s", exc)
            return 0

    def _present(self, pool: HostPages, keys: Sequence[str]) -> list[bool]:
        try:
            return self.client.present(pool.blocks(keys)) if keys else []
        except Exception as exc:  # noqa: BLE001
            log.warning("kvstore lookup failed: %s", exc)
            return [False] * len(keys)

    def _load(self, pool: HostPages, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Pages `keys` into the pool at `host_indices`: the leading run found is True."""
        if not keys:
            return []
        if host_indices is None or host_indices.numel() != len(keys) * pool.page_size:
            _once(f"indices {pool.name}", f"kvstore: {0 if host_indices is None else host_indices.numel()} host "
                  f"indices for {len(keys)} pages of {pool.page_size} tokens")
            return [False] * len(keys)
        if not pool.zero_copy:
            return self._load_flat(pool, keys, host_indices)
        try:
            # record layer l of block b lands in piece l of page b, in SGLang's host memory
            pieces = LayerViews(pool.pieces(host_indices), pool.pieces_per_page, pool.piece_bytes)
            handle = self.client.load(pool.blocks(keys), pieces, hit_blocks=len(keys))
        except Exception as exc:  # noqa: BLE001
            log.warning("kvstore load failed: %s", exc)
            return [False] * len(keys)
        try:
            hit = handle.wait(self.load_deadline_s) // KEY_TOKENS
        except TimeoutError:
            handle.cancel()  # after this no byte lands in SGLang's memory
            log.warning("kvstore load of %d pages passed its deadline", len(keys))
            hit = 0
        return [i < hit for i in range(len(keys))]

    def _load_flat(self, pool: HostPages, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        try:
            starts = pool.page_starts(host_indices)
        except IndexError as exc:
            log.error("kvstore: cannot load into the %s host pool: %s", pool.name, exc)
            return [False] * len(keys)
        pages = [pool.host.get_dummy_flat_data_page() for _ in keys]
        found = [page is not None for page in self._read_into(pool, keys, pages)]
        hit = found.index(False) if False in found else len(found)
        for done, (start, page) in enumerate(zip(starts[:hit], pages, strict=True)):
            try:
                pool.host.set_from_flat_data_page(start, page)
            except Exception as exc:  # noqa: BLE001 - a page SGLang's pool refuses is a miss, never a crash
                log.error("kvstore: the %s host pool refused page %d: %s", pool.name, done, exc)
                hit = done
                break
        return [i < hit for i in range(len(keys))]

    def _read_into(self, pool: HostPages, keys: Sequence[str], targets: Sequence[torch.Tensor | None]
                   ) -> list[torch.Tensor | None]:
        """The generic path: each key's bytes copied into its target tensor (None where missed)."""
        blocks = pool.blocks(keys)
        try:
            found = {data.block.key: data.payload for data in self.client.get(blocks)}
        except Exception as exc:  # noqa: BLE001
            log.warning("kvstore get failed: %s", exc)
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for block, target in zip(blocks, targets, strict=True):
            payload = found.get(block.key)
            if payload is None or target is None or len(payload) != target.numel() * target.element_size():
                out.append(None)
                continue
            target.view(torch.uint8).copy_(torch.frombuffer(payload, dtype=torch.uint8))
            out.append(target)
        return out

    def _save(self, pool: HostPages, keys: Sequence[str], pages: Sequence[Sequence[memoryview]]) -> list[bool]:
        if not keys:
            return []
        items = [(block, list(page)) for block, page in zip(pool.blocks(keys), pages, strict=True)]
        try:
            summary = self.client.put(items, pool.pieces_per_page, self.traffic_class)
        except Exception as exc:  # noqa: BLE001 - a page that is not stored is simply not cached
            log.warning("kvstore put failed: %s", exc)
            return [False] * len(keys)
        return [summary.failed == 0] * len(keys)

    def _store(self, pool: HostPages, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys or host_indices is None or host_indices.numel() != len(keys) * pool.page_size:
            return [False] * len(keys)
        try:
            if pool.zero_copy:
                pages = pool.pieces(host_indices)
            else:
                pages = [[_bytes_of(pool.host.get_data_page(start, flat=True))]
                         for start in pool.page_starts(host_indices)]
        except Exception as exc:  # noqa: BLE001 - indices outside the pool: nothing stored, nothing raised
            log.error("kvstore: cannot read %d pages of the %s host pool: %s", len(keys), pool.name, exc)
            return [False] * len(keys)
        return self._save(pool, keys, pages)

    # -- the zero-copy interface --------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._leading(self.kv, keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._load(self.kv, keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._store(self.kv, keys, host_indices)

    # -- the generic interface (deprecated by SGLang, still its default) ----------------------------

    def exists(self, key: str) -> bool:
        return self._leading(self.kv, [key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
                  ) -> list[torch.Tensor | None]:
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        targets = [t if t is not None else self.kv.host.get_dummy_flat_data_page() for t in targets]
        return self._read_into(self.kv, keys, targets)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            return False
        pool, pages = self.kv, [_bytes_of(value) for value in values]
        if any(len(page) != pool.page_bytes for page in pages):
            log.error("kvstore: a page to set is not %d bytes, a flat page of the host pool", pool.page_bytes)
            return False
        return all(self._save(pool, keys, [_split(page, pool.pieces_per_page) for page in pages]))

    # -- the hybrid interface ---------------------------------------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The longest usable prefix: KV pages from the start, and every extra pool by its hit policy
        (the same verdicts as SGLang's HiCacheFile)."""
        kv_pages = self._leading(self.kv, keys)
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            pool = self.pools.get(str(transfer.name))
            present = self._present(pool, keys[:kv_pages]) if pool is not None else [False] * kv_pages
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                usable = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                usable = {end for end in range(1, kv_pages + 1) if all(present[max(0, end - window) : end])}
                boundary = max(usable, default=0)
            else:  # a policy this backend does not know: no verdict for the pool, so no hit that needs it
                _once(f"policy {transfer.hit_policy} {transfer.name}",
                      f"kvstore: hit policy {transfer.hit_policy} of pool {transfer.name} is not supported")
                usable, boundary = set(), 0
            if boundary:
                hits[str(transfer.name)] = boundary
            restorable = [end for end in restorable if end in usable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _each_transfer(self, transfers: list[PoolTransfer], call) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            pool = self.pools.get(str(transfer.name))
            results[transfer.name] = (call(pool, keys, transfer.host_indices) if pool is not None
                                      else [False] * len(keys))
        return results

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[str, list[bool]]:
        return self._each_transfer(transfers, self._load)

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[str, list[bool]]:
        return self._each_transfer(transfers, self._store)

    # -- the rest ---------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Nothing: the store is shared by every engine and kept by its own retention and eviction."""

    def close(self) -> None:
        self.store.close()

    def __repr__(self) -> str:
        return f"<KVStoreHiCache {','.join(self.client_config.servers)}>"


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data.cast("B")


def _split(view: memoryview, parts: int) -> list[memoryview]:
    size = len(view) // parts
    return [view[i * size : (i + 1) * size] for i in range(parts)]
