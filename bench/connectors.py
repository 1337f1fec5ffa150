"""The engine plug-ins' throughput against the plain client, on the same bytes, in one run.

    .venvs/lmcache-0.5.6/bin/python bench/connectors.py [--chunks 32] [--repeats 5] [--json out.json]

(run in the engine's venv: `make test-connectors` builds it). One daemon on loopback. Per round, `--chunks`
fresh 4 MiB chunks are set and then got:

    lmcache   through LMCache 0.5.6's RemoteBackend (batched_submit_put_task, batched_get_blocking) and
              its LocalCPUBackend allocator, the path LMCache itself takes, into this project's plug-in
    client    the same bytes, in tensors as an engine holds them, through kvstore.client.KVClient put / get,
              with the same (default) transport

Reported: GB/s of set and of get, medians (min-max) over repeats, and the plug-in's over the client's
(aim >= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstore.client import ClientConfig, KVClient  # noqa: E402
from kvstore.connectors.identity import EngineIdentity  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402

CHUNK, LAYERS, HEADS, HEAD_DIM = 256, 8, 4, 128  # [2, 8, 256, 512] float16: 4 MiB


def lmcache_backend(address: str, loop, cpu_gb: float):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    extra = {"remote_storage_plugin.kvstore.module_path": "kvstore.connectors.lmcache",
             "remote_storage_plugin.kvstore.class_name": "KVStoreConnectorAdapter",
             "remote_storage_plugin.kvstore.servers": address}
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=cpu_gb,
                                               remote_storage_plugins=["kvstore"], extra_config=extra)
    metadata = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.float16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM))
    local = LocalCPUBackend(config, metadata)
    return local, RemoteBackend(config, metadata, loop, local, dst_device="cpu", plugin_name="kvstore"), metadata


def lmcache_round(local, remote, metadata, first: int, n: int) -> tuple[float, float, bytes]:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    keys = [CacheEngineKey("bench", 1, 0, first + i, torch.float16) for i in range(n)]
    objs = []
    for i in range(n):
        obj = local.allocate(metadata.get_shapes(), metadata.get_dtypes(), MemoryFormat.KV_2LTD)
        obj.tensor.fill_(float(first + i) % 7)
        objs.append(obj)
    started = time.perf_counter()
    remote.batched_submit_put_task(keys, objs)
    while any(obj.get_ref_count() > 1 for obj in objs):  # LMCache holds a reference until the put is done
        time.sleep(0.0005)
    set_s = time.perf_counter() - started
    started = time.perf_counter()
    got = remote.batched_get_blocking(keys)
    get_s = time.perf_counter() - started
    assert all(g is not None for g in got), "a chunk just set was not found"
    sample = bytes(got[-1].byte_array[:64])
    for obj in objs + got:
        obj.ref_count_down()
    return set_s, get_s, sample


def client_round(client: KVClient, first: int, n: int, nbytes: int) -> tuple[float, float]:
    identity = EngineIdentity("bench-client", "bench", "raw", CHUNK)
    # the chunks in tensors, as an engine holds them (the client copies them into its records, as it does
    # for the plug-in)
    tensors = [torch.full((nbytes // 2,), float((first + i) % 7), dtype=torch.float16) for i in range(n)]
    items = [(identity.block(str(first + i)), memoryview(t.numpy()).cast("B")) for i, t in enumerate(tensors)]
    started = time.perf_counter()
    client.put(items, 1)
    set_s = time.perf_counter() - started
    started = time.perf_counter()
    got = client.get([block for block, _ in items])
    get_s = time.perf_counter() - started
    assert len(got) == n
    return set_s, get_s


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.chunks, args.repeats) < 1:
        parser.error("--chunks and --repeats must be >= 1")
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-connectors-bench-"))
    daemon = DaemonProcess(workdir / "daemon", workdir, ["--hot-tier-bytes", "2GiB"]).start()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    rates = {"lmcache": {"set": [], "get": []}, "client": {"set": [], "get": []}}
    try:
        local, remote, metadata = lmcache_backend(daemon.address, loop, cpu_gb=3 * args.chunks * 4 / 1024 + 0.1)
        nbytes = 2 * LAYERS * CHUNK * HEADS * HEAD_DIM * 2  # the chunk, float16
        gb = args.chunks * nbytes / 1e9
        with KVClient(ClientConfig((daemon.address,))) as client:
            for repeat in range(args.repeats):  # the two ways interleaved, fresh keys each round
                first = (repeat + 1) * 1_000_000
                set_s, get_s, _ = lmcache_round(local, remote, metadata, first, args.chunks)
                rates["lmcache"]["set"].append(gb / set_s)
                rates["lmcache"]["get"].append(gb / get_s)
                set_s, get_s = client_round(client, first, args.chunks, nbytes)
                rates["client"]["set"].append(gb / set_s)
                rates["client"]["get"].append(gb / get_s)
                print(f"  repeat {repeat + 1}/{args.repeats}: lmcache set {rates['lmcache']['set'][-1]:.2f} get "
                      f"{rates['lmcache']['get'][-1]:.2f} GB/s; client set {rates['client']['set'][-1]:.2f} get "
                      f"{rates['client']['get'][-1]:.2f} GB/s", flush=True)
        remote.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    summary = {"chunk_bytes": nbytes, "chunks": args.chunks, "repeats": args.repeats}
    print(f"\n{args.chunks} chunks of {nbytes / 2**20:.0f} MiB per round, one daemon on loopback; GB/s, "
          f"medians (min-max) of {args.repeats}")
    for op in ("set", "get"):
        ours, plain = _spread(rates["lmcache"][op]), _spread(rates["client"][op])
        ratio = _spread([a / b for a, b in zip(rates["lmcache"][op], rates["client"][op])])
        summary[op] = {"lmcache_gbps": ours, "client_gbps": plain, "lmcache_over_client": ratio}
        print(f"  {op}: lmcache {ours['median']:.2f} ({ours['min']:.2f}-{ours['max']:.2f})   client "
              f"{plain['median']:.2f} ({plain['min']:.2f}-{plain['max']:.2f})   lmcache_over_client "
              f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})  (aim >= 0.8)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
