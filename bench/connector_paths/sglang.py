"""SGLang 0.5.23's zero-copy path (batch_set_v1, batch_get_v1 over host indices of a page_first
MHATokenToKVPoolHost on CPU) into the backend, made by SGLang's own factory; pages of 64 tokens x 16
layers x 8 heads x 128 bfloat16 (4 MiB). Also the hit rate of a multi-turn sliding-window workload through
the hybrid (v2) interface, beside SGLang's own HiCacheFile on the same calls."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path as FilePath

sys.path.insert(0, str(FilePath(__file__).resolve().parents[2] / "tests" / "connectors"))
import sglang_harness  # noqa: E402  - stand-ins for triton and torchvision, which SGLang imports on CPU too

sglang_harness.install()
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

PAGE, LAYERS, HEADS, HEAD_DIM = 64, 16, 8, 128


def host_pool(pages: int, layers: int = LAYERS, page: int = PAGE, label: str = "kv") -> MHATokenToKVPoolHost:
    """A page_first host pool of `pages` pages."""
    return sglang_harness.mha_host_pool("page_first", layers, HEADS, HEAD_DIM, page, pages * page // 2, label)


def backend(name: str, address: str, pool, **extra):
    extra_config = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang",
                    "class_name": "KVStoreHiCache", "interface_v1": 1, "servers": address, **extra}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="bench", extra_config=extra_config)
    made = StorageBackendFactory.create_backend(name, config, pool)
    made.register_mem_pool_host(pool)
    return made


class Path:
    page_bytes = 2 * PAGE * LAYERS * HEADS * HEAD_DIM * 2

    def __init__(self, address: str, pages: int) -> None:
        self.pages = pages
        self.pool = host_pool(2 * pages + 1)
        self.backend = backend("dynamic", address, self.pool)
        self.source = self.pool.alloc(pages * PAGE)
        self.target = self.pool.alloc(pages * PAGE)
        self.pool.kv_buffer.fill_(1)  # touched once, as a serving engine's host pool is

    def round(self, first: int) -> tuple[float, float]:
        keys = [f"{first + i:064x}" for i in range(self.pages)]
        self.pool.kv_buffer[0, int(self.source[0])].fill_(float(first % 7))
        started = time.perf_counter()
        assert all(self.backend.batch_set_v1(keys, self.source)), "a set failed"
        set_s = time.perf_counter() - started
        started = time.perf_counter()
        assert all(self.backend.batch_get_v1(keys, self.target)), "a page just set was not found"
        get_s = time.perf_counter() - started
        assert torch.equal(self.pool.kv_buffer[0, int(self.target[0])], self.pool.kv_buffer[0, int(self.source[0])])
        return set_s, get_s

    def close(self) -> None:
        self.backend.close()


def swa_hit_rates(address: str, file_dir: str, sessions: int = 12, turns: int = 5, seed: int = 0) -> dict:
    """Multi-turn chat on a sliding-window model, as SGLang's hybrid controller drives storage: at the end
    of each turn the KV pages of the whole sequence and the window's pages (the SWA pool's last `window`
    pages) are written; each later turn asks for its prompt's pages with the window as TRAILING_PAGES.
    Sessions share a system prompt. Small pages (16 tokens, 2 layers) keep it quick; bytes do not matter
    here, only which pages each backend reports usable."""
    page, window = 16, 4
    rng = random.Random(seed)
    most = 128  # pages a call carries (SGLang's STORAGE_BATCH_SIZE)
    kv, swa = host_pool(most + 2, layers=2, page=page), host_pool(16, layers=1, page=page, label="swa")
    kv_slots, swa_slots = kv.alloc(most * page), swa.alloc(window * page)
    ours = backend("dynamic", address, kv)
    reference = backend("file", address, kv, file_storage_path=file_dir)
    for made in (ours, reference):
        made.register_mem_host_pool_v2(swa, PoolName.SWA)
    system = [rng.randrange(256_000) for _ in range(40 * page // 4)]
    asked = {"kvstore": 0, "file": 0}
    hit = {"kvstore": 0, "file": 0}
    for _ in range(sessions):
        sequence = list(system)
        for _ in range(turns):
            sequence += [rng.randrange(256_000) for _ in range(rng.randrange(20, 120))]  # the user's turn
            keys = get_hash_str(sequence[: len(sequence) // page * page], None, page_size=page)[:most]
            for name, made in (("kvstore", ours), ("file", reference)):
                result = made.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=keys[-window:],
                                                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)])
                asked[name] += len(keys)
                hit[name] += result.kv_hit_pages
            sequence += [rng.randrange(256_000) for _ in range(rng.randrange(40, 200))]  # the reply
            keys = get_hash_str(sequence[: len(sequence) // page * page], None, page_size=page)[:most]
            ours.batch_set_v1(keys, kv_slots[: len(keys) * page])  # the turn's end: its pages, its window
            reference.batch_set(keys, [kv.get_data_page(int(kv_slots[i * page])) for i in range(len(keys))])
            for made in (ours, reference):
                made.batch_set_v2([PoolTransfer(name=PoolName.SWA, keys=keys[-window:],
                                                host_indices=swa_slots[: min(window, len(keys)) * page],
                                                hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    ours.close()
    return {name: hit[name] / asked[name] for name in asked} | {"pages_asked": asked["kvstore"]}
