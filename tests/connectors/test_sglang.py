"""The SGLang HiCache backend through SGLang's own StorageBackendFactory and MHATokenToKVPoolHost on CPU,
over real daemons, beside SGLang's HiCacheFile as the reference (`make test-connectors`, in the SGLang
venv that deploy/connectors/venv.sh builds). GPU-only imports are stood in by sglang_harness."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:  # found, not imported: the stand-ins must come first
    pytest.skip("the SGLang venv: make test-connectors", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).parent))
import sglang_harness  # noqa: E402

sglang_harness.install()
import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MLABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvstore.connectors.sglang import KVStoreHiCache  # noqa: E402

pytestmark = pytest.mark.connectors

LAYERS, SWA_LAYERS, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS = 3, 2, 2, 8, 16, 1024
LAYOUTS = ("page_first", "page_first_direct", "layer_first")


def host_pool(layout: str, layers: int = LAYERS, label: str = "kv") -> MHATokenToKVPoolHost:
    return sglang_harness.mha_host_pool(layout, layers, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS, label)


def mla_pool(layout: str = "page_first") -> MLATokenToKVPoolHost:
    """An MLA model's host pool: one latent vector per token and layer, the same on every TP rank."""
    rank, rope = 32, 8
    buffers = tuple(torch.zeros(DEVICE_TOKENS, 1, rank + rope, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(buffers=buffers, data_ptrs=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64),
                         layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
                         kv_lora_rank=rank, qk_rope_head_dim=rope, kv_cache_dim=rank + rope, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS,
                                target_layer_num=LAYERS)


def storage_config(servers: str = "", model: str = "org/model", tp_rank: int = 0, tp_size: int = 1,
                   tenant: str = "", mla: bool = False, **extra) -> HiCacheStorageConfig:
    extra_config = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang",
                    "class_name": "KVStoreHiCache", "interface_v1": 1, "servers": servers, "tenant": tenant,
                    "timeout_s": 2.0, **({"model_id": model} if model else {}), **extra}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name=model, extra_config=extra_config)


def kvstore_backend(servers: str, pool, **config) -> KVStoreHiCache:
    """Made by SGLang's factory from the `dynamic` flag, and registered as SGLang's controller does."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(servers, **config), pool)
    assert isinstance(backend, KVStoreHiCache)
    backend.register_mem_pool_host(pool)
    return backend


def file_backend(path: Path, pool) -> HiCacheFile:
    config = storage_config()
    config.extra_config = {"file_storage_path": str(path)}
    backend = StorageBackendFactory.create_backend("file", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def keys_of(name: str, pages: int) -> list[str]:
    import hashlib
    return [hashlib.sha256(f"{name}/{i}".encode()).hexdigest() for i in range(pages)]


def fill(pool, pages: int, seed: int) -> torch.Tensor:
    """Random pages written into freshly allocated host slots; their host indices."""
    indices = pool.alloc(pages * PAGE)
    generator = torch.Generator().manual_seed(seed)
    for page in range(pages):
        flat = pool.get_dummy_flat_data_page()
        flat.copy_(torch.randn(flat.shape, generator=generator).to(flat.dtype))
        pool.set_from_flat_data_page(int(indices[page * PAGE]), flat)
    return indices


def page_bytes(pool, indices: torch.Tensor, pages: int) -> list[bytes]:
    return [bytes(pool.get_data_page(int(indices[p * PAGE]), flat=True).contiguous().view(torch.uint8).numpy())
            for p in range(pages)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_copy_pages_round_trip_as_hicache_file_does(layout, daemons, tmp_path):
    (daemon,) = daemons(1)
    pool = host_pool(layout)
    ours, reference = kvstore_backend(daemon.address, pool), file_backend(tmp_path / "file", pool)
    keys = keys_of(layout, 20)
    stored = fill(pool, 12, seed=1)  # the first 12 of the 20 pages were computed and backed up
    want = page_bytes(pool, stored, 12)
    assert all(ours.batch_set_v1(keys[:12], stored))
    assert reference.batch_set(keys[:12], [pool.get_data_page(int(stored[p * PAGE])) for p in range(12)])
    assert ours.batch_exists(keys) == reference.batch_exists(keys) == 12

    into = pool.alloc(20 * PAGE)  # a prefetch of all 20 into other host slots
    got = ours.batch_get_v1(keys, into)
    assert got == [True] * 12 + [False] * 8
    assert page_bytes(pool, into, 12) == want, "the pages SGLang gets are the pages it set"
    theirs = reference.batch_get(keys[:12], [pool.get_dummy_flat_data_page() for _ in range(12)])
    assert [bytes(t.view(torch.uint8).numpy()) for t in theirs] == want
    ours.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_the_generic_and_zero_copy_paths_read_each_other(layout, daemons):
    (daemon,) = daemons(1)
    pool = host_pool(layout)
    backend = kvstore_backend(daemon.address, pool)
    keys = keys_of("generic" + layout, 4)
    indices = fill(pool, 4, seed=2)
    want = page_bytes(pool, indices, 4)
    assert backend.batch_set(keys[:2], [pool.get_data_page(int(indices[p * PAGE])) for p in range(2)])  # generic
    assert all(backend.batch_set_v1(keys[2:], indices[2 * PAGE :]))  # zero-copy
    assert backend.exists(keys[0]) and backend.batch_exists(keys) == 4
    into = pool.alloc(4 * PAGE)
    assert backend.batch_get_v1(keys, into) == [True] * 4
    assert page_bytes(pool, into, 4) == want
    flat = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert [bytes(t.view(torch.uint8).numpy()) for t in flat] == want
    assert not backend.set(keys_of("short", 1)[0], torch.zeros(3, dtype=torch.bfloat16)), "a wrong-sized page"
    outside = torch.arange(pool.size, pool.size + PAGE)  # never read or written through raw pointers
    assert backend.batch_set_v1(keys_of("outside", 1), outside) == [False]
    assert backend.batch_get_v1(keys[:1], outside) == [False]
    assert backend.batch_get_v1(keys[:1], into[1 : PAGE + 1]) == [False], "not page-aligned"
    torn = into[:PAGE].clone()
    torn[1:] += PAGE  # an aligned first index, the rest another page's slots: KV where the tree does not point
    before = page_bytes(pool, into, 2)
    assert backend.batch_set_v1(keys_of("torn", 1), torn) == [False]
    assert backend.batch_get_v1(keys[:1], torn) == [False] and page_bytes(pool, into, 2) == before
    backend.close()


def test_a_model_is_named_by_its_checkpoint_or_an_explicit_model_id_never_by_a_bare_name(daemons, tmp_path):
    (daemon,) = daemons(1)
    pool = host_pool("page_first")
    with pytest.raises(ValueError, match="model_id"):  # no model name, no model_id: no namespace shared as "?"
        kvstore_backend(daemon.address, pool, model="")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(bytes(64))
    named = kvstore_backend(daemon.address, pool, model=str(folder), model_id="")
    assert named.model.startswith("model@"), "a local folder is named by its checkpoint's digest"
    named.close()


def test_models_ranks_tenants_and_layouts_never_see_each_others_pages(daemons):
    (daemon,) = daemons(1)
    pool = host_pool("page_first")
    owner = kvstore_backend(daemon.address, pool)
    keys = keys_of("identity", 3)
    assert all(owner.batch_set_v1(keys, fill(pool, 3, seed=3)))
    assert owner.batch_exists(keys) == 3
    for other_pool, config in [(pool, {"model": "org/other"}), (pool, {"tp_rank": 1, "tp_size": 2}),
                               (pool, {"tenant": "team-b"}), (host_pool("layer_first"), {}),
                               (host_pool("page_first", layers=LAYERS + 1), {})]:
        other = kvstore_backend(daemon.address, other_pool, **config)
        assert other.batch_exists(keys) == 0, config
        assert other.batch_get_v1(keys, other_pool.alloc(3 * PAGE)) == [False] * 3
        other.close()
    owner.close()


def test_an_mla_models_pages_go_flat_and_serve_every_rank(daemons):
    """MLA pools are stored through their flat data pages (a copy), once for all tensor-parallel ranks."""
    (daemon,) = daemons(1)
    writer_pool, reader_pool = mla_pool(), mla_pool()
    writer = kvstore_backend(daemon.address, writer_pool, mla=True, tp_rank=0, tp_size=2)
    reader = kvstore_backend(daemon.address, reader_pool, mla=True, tp_rank=1, tp_size=2)
    assert not writer.kv.zero_copy
    keys = keys_of("mla", 3)
    indices = fill(writer_pool, 3, seed=7)
    assert all(writer.batch_set_v1(keys, indices))
    into = reader_pool.alloc(3 * PAGE)
    assert reader.batch_exists(keys) == 3 and reader.batch_get_v1(keys, into) == [True] * 3
    assert page_bytes(reader_pool, into, 3) == page_bytes(writer_pool, indices, 3)
    torn = into[:PAGE].clone()
    torn[1:] += PAGE
    assert reader.batch_get_v1(keys[:1], torn) == [False], "flat pages are checked whole too"
    assert reader.batch_get_v1(keys[:1], torch.arange(-PAGE, 0)) == [False], "a start outside the pool"
    mha = kvstore_backend(daemon.address, host_pool("page_first"), tp_rank=1, tp_size=2)
    assert mha.batch_exists(keys) == 0, "an MHA rank's pages are its own"
    for backend in (writer, reader, mha):
        backend.close()


def swa_transfer(keys: list[str], indices: torch.Tensor | None = None) -> PoolTransfer:
    return PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=indices, hit_policy=PoolHitPolicy.TRAILING_PAGES)


def test_v2_keeps_the_sliding_window_and_hits_where_hicache_file_hits(daemons, tmp_path):
    """A sliding-window model: KV pages of the global layers, and the window's pages (the SWA pool) only at
    the end of each turn. The next turn hits as far as a window was kept, as with SGLang's HiCacheFile."""
    (daemon,) = daemons(1)
    kv, swa = host_pool("page_first"), host_pool("page_first", layers=SWA_LAYERS, label="swa")
    ours, reference = kvstore_backend(daemon.address, kv), file_backend(tmp_path / "file", kv)
    for backend in (ours, reference):
        backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    window, keys = 2, keys_of("swa", 10)
    kv_indices = fill(kv, 10, seed=4)
    swa_pages = {}
    for end in (4, 7):  # two turns ended at pages 4 and 7: their last `window` pages of window state
        trailing = keys[end - window : end]
        indices = fill(swa, window, seed=end)
        swa_pages[end] = page_bytes(swa, indices, window)
        for backend in (ours, reference):
            assert backend.batch_set_v2([swa_transfer(trailing, indices)]) == {PoolName.SWA: [True] * window}
    assert all(ours.batch_set_v1(keys[:8], kv_indices[: 8 * PAGE]))
    assert reference.batch_set(keys[:8], [kv.get_data_page(int(kv_indices[p * PAGE])) for p in range(8)])

    for query in (keys, keys[:5], keys[:3]):
        transfer = [swa_transfer(query[-window:])]
        mine, theirs = ours.batch_exists_v2(query, transfer), reference.batch_exists_v2(query, transfer)
        assert (mine.kv_hit_pages, mine.extra_pool_hit_pages, mine.restorable_prefix_pages) == (
            theirs.kv_hit_pages, theirs.extra_pool_hit_pages, theirs.restorable_prefix_pages)
    result = ours.batch_exists_v2(keys, [swa_transfer(keys[-window:])])
    assert result.kv_hit_pages == 7 and result.restorable_prefix_pages == [4, 7]
    assert ours.batch_exists_v2(keys[:3], [swa_transfer(keys[1:3])]).kv_hit_pages == 0, "no window: no hit"

    into = swa.alloc(window * PAGE)  # the prefetch of the hit's window
    assert ours.batch_get_v2([swa_transfer(keys[5:7], into)]) == {PoolName.SWA: [True, True]}
    assert page_bytes(swa, into, window) == swa_pages[7]
    assert ours.batch_get_v2([swa_transfer(keys[5:7], into[:PAGE])]) == {PoolName.SWA: [False, False]}
    ours.close()


@pytest.mark.kills_daemons  # left dead on purpose: a dead daemon is what it tests
def test_a_daemon_dying_mid_batch_is_a_miss_from_there_on(daemons):
    first, second = daemons(2)
    pool = host_pool("page_first")
    backend = kvstore_backend(f"{first.address},{second.address}", pool)
    keys = keys_of("dead", 32)
    indices = fill(pool, 32, seed=5)
    want = page_bytes(pool, indices, 32)
    assert all(backend.batch_set_v1(keys, indices))
    assert backend.batch_exists(keys) == 32
    second.kill()
    hit = backend.batch_exists(keys)
    assert 0 <= hit < 32, "pages on the dead daemon are misses"
    into = pool.alloc(32 * PAGE)
    got = backend.batch_get_v1(keys, into)
    assert got == [True] * got.count(True) + [False] * got.count(False) and got.count(True) <= hit
    assert page_bytes(pool, into, got.count(True)) == want[: got.count(True)]
    assert backend.batch_set_v1(keys_of("after", 4), fill(pool, 4, seed=6)) in ([True] * 4, [False] * 4)
    assert backend.batch_exists_v2(keys, []).kv_hit_pages == hit
    first.kill()
    assert backend.batch_exists(keys) == 0 and backend.batch_get_v1(keys[:2], into[: 2 * PAGE]) == [False] * 2
    backend.close()


def test_concurrent_controller_threads_each_get_their_own_pages(daemons):
    (daemon,) = daemons(1)
    pool = host_pool("page_first")
    backend = kvstore_backend(daemon.address, pool)
    failures: list[str] = []

    def worker(n: int) -> None:
        keys = keys_of(f"thread{n}", 8)
        indices = fill(pool, 8, seed=100 + n)
        want = page_bytes(pool, indices, 8)
        for _ in range(3):
            if not all(backend.batch_set_v1(keys, indices)):
                failures.append(f"{n}: set")
            into = pool.alloc(8 * PAGE)
            if backend.batch_get_v1(keys, into) != [True] * 8 or page_bytes(pool, into, 8) != want:
                failures.append(f"{n}: get")
            pool.free(into)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures
    backend.close()
