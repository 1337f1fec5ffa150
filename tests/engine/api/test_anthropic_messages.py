"""Anthropic Messages shapes without a server or a model: requests parse into the expected Prompt or a 400 naming
the field, and replies render as bodies and event streams the official `anthropic` client accepts (through its
own parsing, over a mock HTTP transport)."""

from __future__ import annotations

import json

import pytest

from engine.api import anthropic_messages as am
from engine.api.conversation import LENGTH, STOP, TOOL_CALLS, Message, Reply, Tool, ToolCall
from engine.api.errors import ApiError

anthropic = pytest.importorskip("anthropic")
httpx2 = pytest.importorskip("httpx2")  # the transport the anthropic client is built on

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BODY = {
    "model": "gemma-3-270m", "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
    "stop_sequences": ["END"], "stream": True, "metadata": {"user_id": "u-1"}, "tool_choice": {"type": "auto"},
    "system": [{"type": "text", "text": "Be brief."},
               {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
    "tools": [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER,
               "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C, sunny"}]},
            {"type": "text", "text": "And should I take a coat?"}]},
    ],
}


def _with(**changes) -> dict:
    body = json.loads(json.dumps(BODY))
    for name, value in changes.items():
        if value is ...:
            del body[name]
        else:
            body[name] = value
    return body


def _refused(body, param: str) -> ApiError:
    with pytest.raises(ApiError) as caught:
        am.parse(body, [1])
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message
    return caught.value


def test_parse_a_tool_conversation():
    prompt = am.parse(BODY, [1, 106])
    assert prompt.model == "gemma-3-270m" and prompt.stream
    assert prompt.messages == [
        Message("system", "Be brief.\n\nUse tools."),
        Message("user", "Weather in Paris?"),
        Message("assistant", "Let me look.", tool_calls=(ToolCall("toolu_1", "get_weather", {"city": "Paris"}),)),
        Message("tool", "18C, sunny", tool_call_id="toolu_1"),
        Message("user", "And should I take a coat?"),
    ]
    assert prompt.tools == [Tool("get_weather", "The weather in a city.", WEATHER)]
    s = prompt.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens) == (0.5, 0.9, 40, None, 64)
    assert (s.stop_token_ids, s.stop) == ((1, 106), ("END",))


def test_parse_defaults_and_nulls():
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "system": None,
            "tools": None}  # null means absent
    prompt = am.parse(body, [])
    assert prompt.messages == [Message("user", "hi")] and prompt.tools == [] and not prompt.stream
    assert (prompt.sampling.temperature, prompt.sampling.top_p, prompt.sampling.top_k) == (1.0, 1.0, 0)


def test_tool_results_come_before_the_user_text_and_errors_say_so():
    body = _with(messages=[{"role": "user", "content": [
        {"type": "text", "text": "thanks"},
        {"type": "tool_result", "tool_use_id": "a", "content": "boom", "is_error": True},
        {"type": "tool_result", "tool_use_id": "b"}]}])
    assert am.parse(body, []).messages[1:] == [
        Message("tool", "Error: boom", tool_call_id="a"), Message("tool", "", tool_call_id="b"),
        Message("user", "thanks")]


@pytest.mark.parametrize("name, value", [("thinking", {"type": "enabled", "budget_tokens": 1024}),
                                         ("service_tier", "auto"), ("container", "c"), ("mcp_servers", []),
                                         ("output_config", {}), ("n", 1)])
def test_unsupported_fields_are_refused_by_name(name, value):
    assert name in _refused(_with(**{name: value}), name).message


@pytest.mark.parametrize("changes, param", [
    ({"model": ""}, "model"), ({"model": ...}, "model"),
    ({"max_tokens": ...}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"messages": []}, "messages"), ({"messages": ...}, "messages"),
    ({"temperature": 1.5}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"stop_sequences": "END"}, "stop_sequences"), ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stream": "yes"}, "stream"),
    ({"metadata": {"user_id": "u", "tier": 1}}, "metadata.tier"), ({"metadata": "u"}, "metadata"),
    ({"metadata": {"user_id": 7}}, "metadata.user_id"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"), ({"tool_choice": {"type": "none"}}, "tool_choice"),
    ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "tool_choice"),
    ({"tool_choice": {"type": "auto", "name": "get_weather"}}, "tool_choice.name"),
    ({"system": 3}, "system"), ({"system": [{"type": "image", "source": {}}]}, "system.0.type"),
    ({"system": [{"type": "text", "text": "x", "citations": [{}]}]}, "system.0.citations"),
    ({"tools": {}}, "tools"), ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [{"input_schema": WEATHER}]}, "tools.0.name"),
    ({"tools": [{"name": "f", "input_schema": WEATHER, "strict": True}]}, "tools.0.strict"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
])
def test_bad_values_are_refused_by_name(changes, param):
    _refused(_with(**changes), param)


@pytest.mark.parametrize("message, param", [
    ("hi", "messages.0"), ({"role": "system", "content": "x"}, "messages.0.role"),
    ({"role": "user", "content": 3}, "messages.0.content"),
    ({"role": "user", "content": "x", "name": "bob"}, "messages.0.name"),
    ({"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]},
     "messages.0.content.0.source.data"),
    ({"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x"}}]},
     "messages.0.content.0.source"),
    ({"role": "assistant", "content": [{"type": "image", "source": {"type": "base64"}}]},
     "messages.0.content.0.type"),
    ({"role": "user", "content": [{"type": "document", "source": {}}]}, "messages.0.content.0.type"),
    ({"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": ""}]},
     "messages.0.content.0.type"),
    ({"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
     "messages.0.content.0.type"),
    ({"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}, "messages.0.content.0.type"),
    ({"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "{}"}]},
     "messages.0.content.0.input"),
    ({"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}, "messages.0.content.0.id"),
    ({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "is_error": "no"}]},
     "messages.0.content.0.is_error"),
    ({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}]},
     "messages.0.content.0.content.0.type"),
    ({"role": "user", "content": [{"type": "text", "text": 3}]}, "messages.0.content.0.text"),
])
def test_bad_messages_and_blocks_are_refused_by_name(message, param):
    assert _refused(_with(messages=[message]), param).message.startswith(param + ":")


@pytest.mark.parametrize("kind", ["document", "search_result", "server_tool_use", "redacted_thinking"])
def test_refused_blocks_are_named(kind):
    message = {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": kind}]}
    assert repr(kind) in _refused(_with(messages=[message]), "messages.0.content.1.type").message


def test_a_body_that_is_not_an_object_is_refused():
    _refused([BODY], None)


TEXT_REPLY = Reply("Take a coat.", [], STOP, prompt_tokens=120, completion_tokens=5, cached_tokens=100)
TOOL_REPLY = Reply("Checking.", [ToolCall("call_1", "get_weather", {"city": "Paris"}),
                                 ToolCall("call_2", "get_weather", {"city": "Lyon"})], TOOL_CALLS, 120, 30, 64)
BARE_TOOL_REPLY = Reply("", [ToolCall("call_3", "get_weather", {"city": "Nice"})], TOOL_CALLS, 10, 12, 0)
EMPTY_REPLY = Reply("", [], LENGTH, 10, 1, 0)
REPLIES = [TEXT_REPLY, TOOL_REPLY, BARE_TOOL_REPLY, EMPTY_REPLY]


def test_message_validates_with_usage_and_stop_reasons():
    body = am.message(TEXT_REPLY, "msg_1", "gemma")
    parsed = anthropic.types.Message.model_validate(body)
    assert parsed.content[0].text == "Take a coat." and len(parsed.content) == 1
    assert (parsed.stop_reason, parsed.stop_sequence) == ("end_turn", None)
    assert (parsed.usage.input_tokens, parsed.usage.cache_read_input_tokens, parsed.usage.cache_creation_input_tokens,
            parsed.usage.output_tokens) == (20, 100, 0, 5)
    stopped = anthropic.types.Message.model_validate(am.message(TEXT_REPLY, "msg_1", "gemma", stop_sequence="END"))
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")
    assert am.message(EMPTY_REPLY, "msg_2", "gemma")["stop_reason"] == "max_tokens"
    # the reply may carry its stop string itself
    carried = am.message(Reply("Take a coat.", [], STOP, 120, 5, 100, stop_sequence="END"), "msg_3", "gemma")
    assert (carried["stop_reason"], carried["stop_sequence"]) == ("stop_sequence", "END")


def test_message_with_tool_calls():
    parsed = anthropic.types.Message.model_validate(am.message(TOOL_REPLY, "msg_1", "gemma"))
    assert [block.type for block in parsed.content] == ["text", "tool_use", "tool_use"]
    assert [(b.id, b.name, b.input) for b in parsed.content[1:]] == [
        ("call_1", "get_weather", {"city": "Paris"}), ("call_2", "get_weather", {"city": "Lyon"})]
    assert parsed.stop_reason == "tool_use"
    # a tool call stopped by a stop string is still a tool use, which is what a client acts on
    assert am.message(TOOL_REPLY, "m", "g", stop_sequence="END")["stop_sequence"] is None
    assert [b["type"] for b in am.message(BARE_TOOL_REPLY, "m", "g")["content"]] == ["tool_use"]


def _stream(reply: Reply, pieces: list[str], stop_sequence: str | None = None) -> bytes:
    stream = am.MessageStream("msg_1", "gemma")
    out = stream.start(reply.prompt_tokens, reply.cached_tokens) + b"".join(stream.text(p) for p in pieces)
    return out + stream.finish(reply, stop_sequence=stop_sequence)


def _events(raw: bytes) -> list[dict]:
    assert raw.endswith(b"\n\n")
    events = []
    for chunk in raw.decode().split("\n\n")[:-1]:
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[len("data: "):]))
        assert events[-1]["type"] == name[len("event: "):]
    return events


def test_text_stream_events_validate_in_order():
    from pydantic import TypeAdapter

    events = _events(_stream(TEXT_REPLY, ["Take", "", " a coat."]))
    for event in events:
        TypeAdapter(anthropic.types.RawMessageStreamEvent).validate_python(event)
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta",
                                           "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] == 20
    assert events[-2]["usage"] == {"input_tokens": 20, "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 100, "output_tokens": 5}


def test_tool_stream_events_validate_in_order():
    from pydantic import TypeAdapter

    events = _events(_stream(TOOL_REPLY, ["Checking."]))
    for event in events:
        TypeAdapter(anthropic.types.RawMessageStreamEvent).validate_python(event)
    blocks = [(e["type"], e.get("index")) for e in events[1:-2]]
    assert blocks == [("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0)] + [
        (kind, i) for i in (1, 2) for kind in ("content_block_start", "content_block_delta", "content_block_stop")]
    assert events[4]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert json.loads(events[5]["delta"]["partial_json"]) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def _client(status: int, content: bytes, content_type: str):
    """The official client, its requests answered with `content` (no network)."""
    transport = httpx2.MockTransport(lambda request: httpx2.Response(status, content=content,
                                                                     headers={"content-type": content_type}))
    return anthropic.Anthropic(api_key="k", base_url="http://test", max_retries=0,
                               http_client=httpx2.Client(transport=transport))


REQUEST = {"model": "gemma", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("reply", REPLIES)
@pytest.mark.parametrize("stop_sequence", [None, "END"])
def test_the_client_accumulates_the_stream_into_the_message(reply, stop_sequence):
    body = am.message(reply, "msg_1", "gemma", stop_sequence=stop_sequence)
    expected = _client(200, json.dumps(body).encode(), "application/json").messages.create(**REQUEST)
    text = [reply.text[:3], reply.text[3:]] if reply.text else []
    with _client(200, _stream(reply, text, stop_sequence), "text/event-stream").messages.stream(**REQUEST) as events:
        streamed = events.get_final_message()
    # the stream sets some fields the body leaves out (stop_details) to null: the same to a client
    dicts = [m.to_dict(exclude_none=True) for m in (streamed, expected, anthropic.types.Message.model_validate(body))]
    assert dicts[0] == dicts[1] == dicts[2]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (body["stop_reason"], reply.completion_tokens)


def test_error_body_kinds():
    assert am.error_body(ApiError(400, "bad", "x")) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                                 "message": "bad"}}
    assert am.error_body(ApiError(401, "key", kind="authentication_error"))["error"]["type"] == "authentication_error"
    assert am.error_body(ApiError(404, "no", "model", "not_found_error"))["error"]["type"] == "not_found_error"
    assert am.error_body(ApiError(500, "oops", kind="server_error"))["error"]["type"] == "api_error"


@pytest.mark.parametrize("status, kind, exception", [(400, "invalid_request_error", "BadRequestError"),
                                                     (401, "authentication_error", "AuthenticationError"),
                                                     (404, "not_found_error", "NotFoundError"),
                                                     (500, "server_error", "InternalServerError")])
def test_the_client_reads_error_bodies(status, kind, exception):
    body = json.dumps(am.error_body(ApiError(status, "it went wrong", kind=kind))).encode()
    with pytest.raises(getattr(anthropic, exception)) as caught:
        _client(status, body, "application/json").messages.create(**REQUEST)
    assert caught.value.body["error"]["message"] == "it went wrong"


def test_the_client_raises_a_streamed_error():
    stream = am.MessageStream("msg_1", "gemma")
    raw = stream.start(10, 0) + stream.text("Hel") + stream.error(ApiError(500, "decode failed", kind="server_error"))
    assert _events(raw)[-1] == {"type": "error", "error": {"type": "api_error", "message": "decode failed"}}
    with pytest.raises(anthropic.APIStatusError) as caught:
        with _client(200, raw, "text/event-stream").messages.stream(**REQUEST) as events:
            events.get_final_message()
    assert caught.value.body["error"]["message"] == "decode failed"


def test_message_ids_are_unique():
    ids = {am.message_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("msg_") for i in ids)
