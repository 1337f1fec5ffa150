"""A model's reply never crashes its request: a fenced tool call whose name is not a string,
whose arguments hold NaN or an infinite number, or nest too deep, is text, not a call, in every API, streamed or
not; and a stream that fails after it began ends with the API's error event."""

from __future__ import annotations

import json

import pytest

from engine.api.conversation import CALL_FENCE, Tool, split_tool_calls
from tests.engine.api.scripted import MODEL, ScriptedService, client

pytestmark = pytest.mark.unit
TOOLS = [Tool("get_weather", "The weather", {"type": "object"})]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]
BAD_CALLS = [
    '{"name": ["get_weather"], "arguments": {}}',  # a name that is a list: unhashable
    '{"name": {"get_weather": 1}, "arguments": {}}',
    '{"name": 7, "arguments": {}}',
    '{"name": "get_weather", "arguments": {"x": NaN}}',
    '{"name": "get_weather", "arguments": {"x": Infinity}}',
    '{"name": "get_weather", "arguments": {"x": -Infinity}}',
    '{"name": "get_weather", "arguments": {"x": 1e999}}',  # a float past the largest: inf
    '{"name": "get_weather", "arguments": {"x": ' + "[" * 500 + "]" * 500 + "}}",
    '{"name": "get_weather", "arguments": {"x": ' + "[" * 5000 + "]" * 5000 + "}}",  # past the parser's limit
]


def _reply(call: str) -> str:
    return f"Let me look.\n{CALL_FENCE}{call}\n```"


@pytest.mark.parametrize("call", BAD_CALLS)
def test_a_malformed_call_is_text(call):
    text = _reply(call)
    assert split_tool_calls(text, TOOLS) == (text, [])


def test_a_good_call_beside_a_bad_one_is_still_a_call():
    text = _reply(BAD_CALLS[0]) + "\n" + _reply('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    content, calls = split_tool_calls(text, TOOLS)
    assert content == "Let me look." and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]


def _requests(stream: bool) -> list[tuple[str, dict]]:
    user = [{"role": "user", "content": "Weather in Oslo?"}]
    return [("/v1/chat/completions", {"model": MODEL, "messages": user, "tools": CHAT_TOOLS, "stream": stream}),
            ("/v1/responses", {"model": MODEL, "input": user, "tools": RESPONSES_TOOLS, "stream": stream}),
            ("/v1/messages", {"model": MODEL, "max_tokens": 50, "messages": user, "tools": ANTHROPIC_TOOLS,
                              "stream": stream})]


def _text_only(path: str, answer: dict) -> str:
    """The answer's text, checking it holds no tool call."""
    if path == "/v1/chat/completions":
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        return choice["message"]["content"]
    if path == "/v1/responses":
        assert [item["type"] for item in answer["output"]] == ["message"]
        return answer["output"][0]["content"][0]["text"]
    assert answer["stop_reason"] == "end_turn" and [block["type"] for block in answer["content"]] == ["text"]
    return answer["content"][0]["text"]


def _events(text: str) -> list[dict | str]:
    """A stream's data payloads, JSON-decoded (a payload that is not JSON fails the test)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data, parse_constant=_not_json))
    return out


def _not_json(name: str):
    raise AssertionError(f"{name} in a stream: not JSON")


@pytest.mark.parametrize("call", [BAD_CALLS[0], BAD_CALLS[1], BAD_CALLS[3], BAD_CALLS[6], BAD_CALLS[7]])
def test_every_api_answers_a_malformed_call_as_text(call):
    api = client(ScriptedService(_reply(call)))
    for path, body in _requests(stream=False):
        response = api.post(path, json=body)
        assert response.status_code == 200, (path, response.text[:300])
        answer = json.loads(response.text, parse_constant=_not_json)
        assert _text_only(path, answer).startswith("Let me look.\n```tool_call"), (path, answer)
    for path, body in _requests(stream=True):
        with api.stream("POST", path, json=body) as response:
            assert response.status_code == 200, path
            events = _events(response.read().decode())
        assert events, path
        if path == "/v1/chat/completions":
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
        else:
            assert events[-1]["type"] in ("response.completed", "message_stop"), (path, events[-1])


def test_a_stream_that_fails_after_it_began_ends_with_the_apis_error_event():
    api = client(ScriptedService("Some text first.", fault=RuntimeError("a bug")))
    for path, body in _requests(stream=True):
        with api.stream("POST", path, json=body) as response:
            assert response.status_code == 200, path
            events = _events(response.read().decode())
        if path == "/v1/chat/completions":
            assert "error" in events[-2] and events[-1] == "[DONE]", events[-2:]
        else:
            assert events[-1]["type"] == "error", (path, events[-1])
