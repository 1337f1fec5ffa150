"""The backends under the real servers, on a CUDA machine: a repeated prompt is served from the store.

    python deploy/connectors/gpu_check.py sglang [--model DIR]    # python -m sglang.launch_server
    python deploy/connectors/gpu_check.py vllm [--model DIR]      # vllm serve, the tier below its CPU tier
    python deploy/connectors/gpu_check.py vllm-connector [--model DIR]   # vllm serve, the KV connector

It needs a GPU and the engine's CUDA build installed beside this project (`pip install -e .`); it cannot run
on the CPU-only CI machines, whose tests drive the same backends through the engines' own classes instead
(tests/connectors/). The model defaults to this project's Gemma 3 270M folder (`python -m
engine.checkpoints`, converted once from the packaged GGUF, nothing downloaded): a sliding-window model,
so SGLang must use the hybrid (v2) interface to get any storage hit.

The check: start a kvstore-server; start the engine with the backend; send a long prompt; stop the engine
(its GPU and host caches die with it); start it again and send the same prompt. The second answer must
report cached tokens (`meta_info.cached_tokens` from SGLang, `usage.prompt_tokens_details.cached_tokens`
from vLLM): they can only have come from the store. Exit status 0 when they did.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPT = " ".join(["The store keeps what the engine computed once, so the next engine need not."] * 60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sglang_command(model: str, port: int, store: str) -> list[str]:
    extra = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCache",
             "interface_v1": 1, "servers": store}
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
            "--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra), "--hicache-storage-prefetch-policy",
            "wait_complete", "--mem-fraction-static", "0.3"]


def vllm_command(model: str, port: int, store: str, connector: bool = False) -> list[str]:
    if connector:  # the KV connector, the hybrid KV-cache manager on (Gemma 3's sliding window included)
        transfer = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.connectors.vllm_connector",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"servers": store}}
    else:  # the tier below vLLM's CPU offloading tier
        tier = {"type": "KVStoreTier", "module_path": "kvstore.connectors.vllm_tier", "servers": store}
        transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2**30,
                                                  "secondary_tiers": [tier]}}
    return ["vllm", "serve", model, "--served-model-name", "m", "--port", str(port), "--kv-transfer-config",
            json.dumps(transfer), "--enable-prompt-tokens-details", "--gpu-memory-utilization", "0.3",
            "--max-model-len", "4096"]


def ask(engine: str, port: int) -> int:
    """The cached tokens the engine reports for PROMPT."""
    if engine == "sglang":
        url, body = "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    else:
        url, body = "/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{url}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    if engine == "sglang":
        return int(answer["meta_info"].get("cached_tokens", 0))
    return int(((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def wait_ready(process: subprocess.Popen, port: int, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the engine exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"the engine was not ready within {timeout_s:.0f} s")


def serve_once(engine: str, model: str, store: str) -> int:
    port = free_port()
    command = (sglang_command(model, port, store) if engine == "sglang"
               else vllm_command(model, port, store, connector=engine == "vllm-connector"))
    process = subprocess.Popen(command, start_new_session=True)
    try:
        wait_ready(process, port)
        return ask(engine, port)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", choices=["sglang", "vllm", "vllm-connector"])
    parser.add_argument("--model", help="a model folder (default: this project's Gemma 3 270M)")
    args = parser.parse_args()
    if args.model is None:
        from engine.checkpoints.real_model import converted_real_model
        args.model = str(converted_real_model())
    from kvstore.server.process import DaemonProcess

    workdir = Path(tempfile.mkdtemp(prefix="kvstore-gpu-check-"))
    daemon = DaemonProcess(workdir / "data", workdir).start()
    try:
        first = serve_once(args.engine, args.model, daemon.address)
        second = serve_once(args.engine, args.model, daemon.address)  # a fresh engine: only the store remains
    finally:
        daemon.stop()
    print(f"{args.engine}: cached tokens {first} on the first engine, {second} on the second (from the store)")
    sys.exit(0 if second > 0 else 1)


if __name__ == "__main__":
    main()
