"""The HTTP server through the official clients, on the real Gemma 3 270M: Responses with a conversation the
server keeps, Anthropic Messages, a tool-call turn and its result, what the store is told, metrics, and a
client that goes away."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.engine.api.conftest import needs_server
from tests.waiting import wait_for

pytestmark = needs_server
MODEL = "gemma-3-270m"
GREEDY = {"temperature": 0}  # the Anthropic client no longer sends sampling fields; the API still takes them
QUESTION = "What does len() return?"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _stats(served):
    from kvstore.client import KVClient

    with KVClient([served.daemon.address]) as client:
        return client.server_stats()[served.daemon.address]


def _flush(served) -> None:
    served.service.runner.prefill.flush(30)  # blocks are saved behind a reply: stored before the next request


def test_responses_keep_the_conversation_and_its_prefix_stays_cached(served):
    from engine.text.real_text import system_prompt

    client = served.openai()
    first = client.responses.create(model=MODEL, instructions=system_prompt(), input=QUESTION, max_output_tokens=6,
                                    temperature=0)
    assert first.status == "incomplete" and first.output_text and first.usage.output_tokens == 6
    _flush(served)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, instructions=system_prompt(),
                                     input="And for a dict?", max_output_tokens=6, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + 6, "the earlier turns are in the prompt"
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 256 * 256 - 256
    assert client.responses.retrieve(second.id).output_text == second.output_text
    streamed = list(client.responses.create(model=MODEL, previous_response_id=first.id, instructions=system_prompt(),
                                            input="And for a dict?", max_output_tokens=6, temperature=0, stream=True))
    assert streamed[-1].response.output_text == second.output_text
    ended = _stats(served).value("kvstore_advised_blocks_total", continues="false")
    client.responses.delete(second.id)
    wait_for(lambda: _stats(served).value("kvstore_advised_blocks_total", continues="false") > ended,
             "the deleted conversation advised as ended")
    import openai

    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=second.id, input="more", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):  # another tenant never sees (or chains on) alice's responses
        served.openai("key-bob").responses.retrieve(first.id)


def test_anthropic_messages_match_the_chat_reply_streamed_or_not(served):
    import anthropic

    chat = served.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                   max_tokens=8, temperature=0)
    client = served.anthropic()
    message = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": QUESTION}])
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(model=MODEL, max_tokens=8, extra_body=GREEDY,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        assert "".join(stream.text_stream) == message.content[0].text
    stopped = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY,
                                     stop_sequences=[message.content[0].text[2:5]],
                                     messages=[{"role": "user", "content": QUESTION}])
    assert stopped.stop_reason == "stop_sequence" and stopped.content[0].text == message.content[0].text[:2]
    for error, request in [(anthropic.NotFoundError, dict(model="claude-9")),
                           (anthropic.BadRequestError, dict(model=MODEL, extra_body={"temperature": 1.5})),
                           (anthropic.BadRequestError,
                            dict(model=MODEL, thinking={"type": "enabled", "budget_tokens": 1024}))]:
        with pytest.raises(error):
            client.messages.create(**{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **request})
    with pytest.raises(anthropic.AuthenticationError):
        served.anthropic("key-mallory").messages.create(model=MODEL, max_tokens=2,
                                                        messages=[{"role": "user", "content": "hi"}])


def _call(i: int, city: str) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def _few_shot(city: str) -> list[dict]:
    """Two worked tool calls, then a third question: the base model copies the pattern (greedy)."""
    out = []
    for i, (town, weather) in enumerate([("Paris", "18 C and sunny"), ("Rome", "22 C and cloudy")]):
        out += [{"role": "user", "content": f"What is the weather in {town}?"},
                {"role": "assistant", "content": None, "tool_calls": [_call(i, town)]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": weather},
                {"role": "assistant", "content": f"It is {weather} in {town}."}]
    return out + [{"role": "user", "content": f"What is the weather in {city}?"}]


def test_a_tool_call_turn_then_its_result(served):
    client = served.openai("key-bob")
    going_on = _stats(served).value("kvstore_advised_blocks_total", continues="true")
    messages = _few_shot("Oslo")
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    assert reply.usage.completion_tokens < 60, "the reply ends at the end of the call"
    wait_for(lambda: _stats(served).value("kvstore_advised_blocks_total", continues="true") > going_on,
             "the tool call advised as going on")
    assert _stats(served).value("kvstore_blocks", traffic_class="agent") > 0, "a request with tools is agent traffic"
    _flush(served)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "3 C and snowing"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                            max_tokens=12)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    assert answer.usage.prompt_tokens_details.cached_tokens >= 256, "the turn before is cached"
    message = served.anthropic("key-bob").messages.create(  # the same turn through Anthropic's tool blocks
        model=MODEL, max_tokens=60, extra_body=GREEDY,
        tools=[{"name": "get_weather", "description": "The current weather in a city",
                "input_schema": WEATHER["function"]["parameters"]}],
        messages=_anthropic(_few_shot("Oslo")))
    assert message.stop_reason == "tool_use" and message.content[-1].input == {"city": "Oslo"}


def _anthropic(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages with tool calls as Anthropic's tool_use and tool_result blocks."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            uses = [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                     "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": uses})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                     "content": m["content"]}]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def test_a_client_that_goes_away_frees_its_generation_and_metrics_say_so(served):
    metrics = lambda: httpx.get(served.url + "/metrics", headers={"Authorization": "Bearer key-alice"}).text  # noqa: E731
    ok = 'kvstore_api_requests_total{api="chat",status="200"}'
    before = metrics()
    cancelled = _sample(before, "kvstore_api_cancelled_total")
    with httpx.stream("POST", served.url + "/v1/chat/completions", headers={"Authorization": "Bearer key-alice"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2000,
                            "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    wait_for(lambda: _sample(metrics(), "kvstore_api_cancelled_total") == cancelled + 1,
             "the stream whose client left counted as cancelled")
    wait_for(lambda: served.service.runner.load["running"] == 0, "the generation ending without its client")
    text = metrics()  # what this test did, whatever the worker's other tests asked before it
    assert _sample(text, ok) == _sample(before, ok) + 1, "the stream was answered 200 before its client left"
    assert _sample(text, 'kvstore_api_engine{what="running"}') == 0


def test_a_tenants_scrape_of_the_real_server_counts_its_own_requests_only(served):
    """The counts come from the real service (tests/engine/api/test_metrics_scope.py holds the scoping on a
    scripted one, whose counts the script makes itself). Deltas, as the server is shared by a worker's tests."""
    scrape = lambda key: httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text  # noqa: E731
    ok, prompt = 'kvstore_api_requests_total{api="chat",status="200"}', "kvstore_api_prompt_tokens_total"
    completion = "kvstore_api_completion_tokens_total"
    alice, bob = scrape("key-alice"), scrape("key-bob")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2, **GREEDY}
    answered = _post(served, "/v1/chat/completions", chat, key="key-bob")
    assert answered.status_code == 200
    usage = answered.json()["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    bob_after, alice_after = scrape("key-bob"), scrape("key-alice")
    assert _sample(bob_after, ok) == _sample(bob, ok) + 1
    assert _sample(bob_after, prompt) == _sample(bob, prompt) + usage["prompt_tokens"]
    assert _sample(bob_after, completion) == _sample(bob, completion) + usage["completion_tokens"]
    assert _sample(alice_after, ok) == _sample(alice, ok) and _sample(alice_after, prompt) == _sample(alice, prompt)
    assert "alice" not in bob_after and "tenant=" not in bob_after
    assert httpx.get(served.url + "/metrics", headers={"Authorization": "Bearer key-mallory"}).status_code == 401


def test_a_huge_prompt_is_encoded_beside_a_running_stream(served):
    client = served.openai()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=6, temperature=0, stream=True)
    huge = httpx.post(served.url + "/v1/chat/completions", headers={"Authorization": "Bearer key-alice"}, timeout=120,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 200_000}],
                            "max_tokens": 2})
    assert huge.status_code == 400 and "context" in huge.json()["error"]["message"]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _post(served, path: str, body: bytes | dict, key: str = "key-alice", **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(served.url + path, content=content, timeout=60, **kwargs,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def test_hostile_bodies_get_the_apis_error_objects(served):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        (413, b'{"model": "' + b"x" * (5 << 20) + b'"}'),  # past the body limit
        (400, b"[" * 100_000 + b"]" * 100_000),  # nesting past the parser's recursion
        (400, b'{"model": "gemma-3-270m", "temperature": NaN, "messages": []}'),
        (400, json.dumps({**chat, "messages": [{"role": "user", "content": "\ud800"}]}).encode()),  # lone surrogate
        (400, {**chat, "messages": [{"role": [], "content": "hi"}]}),  # unhashable where a name belongs
        (400, {**chat, "messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]}),
        (400, {**chat, "stop": ["s"] * 3 + ["x" * 1000]}),
        (400, {**chat, "max_tokens": None, "max_completion_tokens": 0}),
    ]
    for status, body in cases:
        response = _post(served, "/v1/chat/completions", body)
        assert response.status_code == status, (response.status_code, response.text[:200])
        assert response.json()["error"]["type"] in ("invalid_request_error",), response.text[:200]
    messages = _post(served, "/v1/messages",
                     {"model": MODEL, "max_tokens": 2, "messages": [{"role": {}, "content": "x"}]})
    assert messages.status_code == 400 and messages.json()["type"] == "error"
    unknown = _post(served, "/v1/messages/count_tokens", {})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert httpx.get(served.url + "/metrics").status_code == 401, "metrics are for key holders"
    assert httpx.get(served.url + "/docs").status_code == 404


def test_a_tenant_at_its_limit_is_told_to_come_back(served):
    service = served.service
    wait_for(lambda: sum(service.in_flight.values()) == 0, "every earlier request giving its slot back")
    service.in_flight["alice"] = service.max_in_flight_per_tenant  # as if alice had that many running
    try:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        refused = _post(served, "/v1/chat/completions", chat)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        refused = _post(served, "/v1/messages", chat)
        assert refused.status_code == 529 and refused.json()["error"]["type"] == "overloaded_error"
        assert _post(served, "/v1/chat/completions", chat, key="key-bob").status_code == 200, "bob has his own"
        # the reply can reach the client a moment before its request gives back its slot
        wait_for(lambda: service.in_flight["bob"] == 0, "bob's request giving its slot back")
        service.in_flight["bob"] = service.max_in_flight - service.max_in_flight_per_tenant
        assert _post(served, "/v1/chat/completions", chat, key="key-bob").status_code == 429, "the server is full"
    finally:
        service.in_flight.clear()


def test_a_non_streamed_request_whose_client_gives_up_is_cancelled(served):
    """The client goes away once its request is decoding (seen in the runner, not guessed from a timeout),
    asking for a greedy reply far longer than the moment that takes."""
    metrics = lambda: httpx.get(served.url + "/metrics", headers={"Authorization": "Bearer key-alice"}).text  # noqa: E731
    cancelled = _sample(metrics(), "kvstore_api_cancelled_total")
    body = json.dumps({"model": MODEL, "max_tokens": 2000, **GREEDY, "messages": [
        {"role": "user", "content": "Count from 1 to 1000, one number per line."}]}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-alice\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: served.service.runner.load["running"] == 1, "the request running")
    wait_for(lambda: _sample(metrics(), "kvstore_api_cancelled_total") == cancelled + 1,
             "the request whose client gave up counted as cancelled", timeout_s=30)
    wait_for(lambda: served.service.runner.load["running"] == 0, "the cancelled request ending")


def test_a_dead_tokenizer_worker_is_replaced(served):
    import os
    import signal

    encoder = served.service.encoder
    os.kill(next(iter(encoder.pool._processes)), signal.SIGKILL)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _post(served, "/v1/chat/completions", chat).status_code == 200
    assert encoder.restarts == 1


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_health_says_the_store_answers(served):
    """GET /health is 200 and names the store's state: reachable here (unreachable, with a 200 still, is
    tests/engine/api/test_store_state.py's)."""
    def health() -> dict:
        reply = httpx.get(served.url + "/health", timeout=30)
        assert reply.status_code == 200
        return reply.json()

    wait_for(lambda: health()["store"] != "unknown", "the store probed")
    assert health() == {"status": "ok", "store": "reachable", "daemons": {served.daemon.address: "answered"}}
