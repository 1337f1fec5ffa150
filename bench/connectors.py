"""The engine plug-ins' throughput against the plain client on the same bytes, in the same run.

    .venv/bin/python bench/connectors.py [--pages 32] [--repeats 5] [--json out.json]
    .venvs/<lock>/bin/python bench/connectors.py --backend sglang ...    # one backend, in its own venv

Each backend runs in its engine's venv (`make test-connectors` builds them), one after the other, each
with a daemon of its own on loopback. Per round, `--pages` fresh 4 MiB pages are set through the engine's
own call path into the plug-in (bench/connector_paths/) and got back; then the same number of pages of
the same size, in tensors as an engine holds them, through kvstore.client.KVClient put / get, with the
same (default) transport. Reported: GB/s of set and get, medians (min-max) over repeats, and the
plug-in's over the client's (aim >= 0.8). SGLang adds the hit rate of a multi-turn sliding-window
workload through its hybrid interface, beside SGLang's own HiCacheFile.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

BACKENDS = {"lmcache": "lmcache-0.5.6", "sglang": "sglang-0.5.23", "vllm-tier": "vllm-0.33.0",
            "vllm-connector": "vllm-0.33.0"}  # backend: the lock file of its venv (deploy/connectors/)


def client_round(client, first: int, pages: int, page_bytes: int) -> tuple[float, float]:
    import torch

    from kvstore.connectors.identity import EngineIdentity

    identity = EngineIdentity("bench-client", "bench", "raw", 64)
    tensors = [torch.full((page_bytes // 2,), float((first + i) % 7), dtype=torch.float16) for i in range(pages)]
    items = [(identity.block(str(first + i)), memoryview(t.numpy()).cast("B")) for i, t in enumerate(tensors)]
    started = time.perf_counter()
    client.put(items, 1)
    set_s = time.perf_counter() - started
    started = time.perf_counter()
    got = client.get([block for block, _ in items])
    get_s = time.perf_counter() - started
    assert len(got) == pages
    return set_s, get_s


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(backend: str, pages: int, repeats: int) -> dict:
    """One backend, in this (its engine's) venv."""
    from kvstore.client import ClientConfig, KVClient
    from kvstore.server.process import DaemonProcess

    module = importlib.import_module(f"connector_paths.{backend.replace('-', '_')}")
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-connectors-bench-"))
    daemon = DaemonProcess(workdir / "daemon", workdir, ["--hot-tier-bytes", "2GiB"]).start()
    rates = {"plugin": {"set": [], "get": []}, "client": {"set": [], "get": []}}
    result: dict = {}
    try:
        path = module.Path(daemon.address, pages)
        gb = pages * path.page_bytes / 1e9
        with KVClient(ClientConfig((daemon.address,))) as client:
            for repeat in range(repeats):  # the two ways interleaved, fresh keys each round
                first = (repeat + 1) * 1_000_000
                for way, (set_s, get_s) in (("plugin", path.round(first)),
                                            ("client", client_round(client, first, pages, path.page_bytes))):
                    rates[way]["set"].append(gb / set_s)
                    rates[way]["get"].append(gb / get_s)
                print(f"  {backend} repeat {repeat + 1}/{repeats}: plug-in set {rates['plugin']['set'][-1]:.2f} "
                      f"get {rates['plugin']['get'][-1]:.2f} GB/s; client set {rates['client']['set'][-1]:.2f} "
                      f"get {rates['client']['get'][-1]:.2f} GB/s", flush=True)
        path.close()
        result["page_bytes"] = path.page_bytes
        if hasattr(module, "swa_hit_rates"):
            result["swa_hit_rate"] = module.swa_hit_rates(daemon.address, str(workdir / "hicache-file"))
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    for op in ("set", "get"):
        result[op] = {"plugin_gbps": spread(rates["plugin"][op]), "client_gbps": spread(rates["client"][op]),
                      "plugin_over_client": spread([a / b for a, b in zip(rates["plugin"][op], rates["client"][op])])}
    return result


def in_its_venv(backend: str, args) -> dict | None:
    python = ROOT / ".venvs" / BACKENDS[backend] / "bin" / "python"
    if not python.exists():
        print(f"  {backend}: no venv at {python.parent.parent} (make test-connectors builds it); skipped")
        return None
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([str(python), __file__, "--backend", backend, "--pages", str(args.pages), "--repeats",
                        str(args.repeats), "--json", out.name], check=True)
        return json.loads(Path(out.name).read_text())[backend]


def report(results: dict, pages: int, repeats: int) -> None:
    print(f"\n{pages} pages of 4 MiB per round, one daemon on loopback; GB/s, medians (min-max) of {repeats}")
    cell = lambda s: f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"  # noqa: E731
    print(f"  {'backend':<15} {'op':<4} {'plug-in':<18} {'client':<18} plug-in/client (aim >= 0.8)")
    for backend, result in results.items():
        for op in ("set", "get"):
            r = result[op]
            print(f"  {backend:<15} {op:<4} {cell(r['plugin_gbps']):<18} {cell(r['client_gbps']):<18} "
                  f"{cell(r['plugin_over_client'])}")
        if "swa_hit_rate" in result:
            rates = result["swa_hit_rate"]
            print(f"  {backend:<15} multi-turn SWA hit rate (v2): kvstore {rates['kvstore']:.3f}, SGLang's "
                  f"HiCacheFile {rates['file']:.3f}, ratio {rates['kvstore'] / rates['file']:.2f} "
                  f"({rates['pages_asked']} pages asked)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=sorted(BACKENDS), help="one backend, in this venv (default: each "
                        "in its own venv)")
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.pages, args.repeats) < 1:
        parser.error("--pages and --repeats must be >= 1")
    if args.backend:
        results = {args.backend: measure(args.backend, args.pages, args.repeats)}
    else:
        results = {b: r for b in BACKENDS if (r := in_its_venv(b, args)) is not None}
    report(results, args.pages, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
