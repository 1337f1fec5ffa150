"""GET /metrics: a tenant's key reads its own counts, never another's; the operator's
metrics keys read every tenant's, labelled; no key, or a wrong one, reads nothing."""

from __future__ import annotations

import pytest

from tests.engine.api.scripted import MODEL, client

pytestmark = pytest.mark.unit
ALICE, BOB, OPERATOR = ({"Authorization": f"Bearer {key}"} for key in ("key-alice", "key-bob", "key-ops"))


def _sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def _ask(api, headers: dict, stream: bool) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    with api.stream("POST", "/v1/chat/completions", json=chat, headers=headers) as response:
        assert response.status_code == 200
        response.read()


def test_a_tenant_reads_only_its_own_counts():
    api = client(metrics_keys=("key-ops",))
    for stream in (False, True):
        _ask(api, ALICE, stream)
    _ask(api, BOB, False)
    alice = api.get("/metrics", headers=ALICE).text
    bob = api.get("/metrics", headers=BOB).text
    assert _sample(alice, 'kvstore_api_requests_total{api="chat",status="200"}') == 2
    assert _sample(alice, "kvstore_api_prompt_tokens_total") == 16, "streamed or not, counted for alice"
    assert _sample(bob, 'kvstore_api_requests_total{api="chat",status="200"}') == 1
    assert _sample(bob, "kvstore_api_prompt_tokens_total") == 8, "bob's scrape shows his own tokens only"
    assert "alice" not in bob and "tenant=" not in bob
    assert _sample(bob, 'kvstore_api_engine{what="running"}') is not None, "the server's gauges are shown"
    everyone = api.get("/metrics", headers=OPERATOR).text
    assert _sample(everyone, 'kvstore_api_prompt_tokens_total{tenant="alice"}') == 16
    assert _sample(everyone, 'kvstore_api_prompt_tokens_total{tenant="bob"}') == 8


def test_metrics_need_a_key():
    api = client(metrics_keys=("key-ops",))
    assert api.get("/metrics", headers={"Authorization": ""}).status_code == 401
    assert api.get("/metrics", headers={"Authorization": "Bearer key-mallory"}).status_code == 401
    with pytest.raises(ValueError, match="metrics_keys"):
        client(metrics_keys=("key-alice",))  # a tenant's key cannot be the operator's
