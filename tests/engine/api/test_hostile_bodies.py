"""Bodies a hostile tenant sends: a 400 (or 404, 429) in the API's own shape, never
a 500; refused on what costs least before the body is parsed; and the parse linear in the body.

On the scripted app (tests/engine/api/scripted.py), but for the last test, which stalls a real server's loop."""

from __future__ import annotations

import dataclasses
import json
import threading

import httpx
import pytest

from engine.api import openai_responses
from engine.api.conversation import Message, Prompt, chat_messages
from engine.decode import SamplingParams
from tests.engine.api.conftest import needs_server
from tests.engine.api.scripted import MODEL, client

USER = [{"role": "user", "content": "hi"}]


def _bodies(schema: str) -> list[tuple[str, bytes]]:
    """A body for each API whose one tool has `schema` (JSON text, perhaps not what json.dumps would write)."""
    hole = "@schema@"
    function = {"type": "function", "function": {"name": "f", "parameters": hole}}
    bodies = [("/v1/chat/completions", {"model": MODEL, "messages": USER, "tools": [function]}),
              ("/v1/responses", {"model": MODEL, "input": "hi",
                                 "tools": [{"type": "function", "name": "f", "parameters": hole}]}),
              ("/v1/messages", {"model": MODEL, "max_tokens": 3, "messages": USER,
                                "tools": [{"name": "f", "input_schema": hole}]})]
    return [(path, json.dumps(body).replace(f'"{hole}"', schema).encode()) for path, body in bodies]


def _error(path: str, response: httpx.Response) -> dict:
    """The API's error object (asserting the shape): {type, message[, param]}."""
    body = response.json()
    if path == "/v1/messages":
        assert body["type"] == "error", body
    return body["error"]


def _nested(levels: int) -> str:
    return '{"x": ' * (levels - 1) + "{}" + "}" * (levels - 1)


@pytest.mark.unit
def test_a_number_too_large_for_a_float_is_refused_not_rendered_as_infinity():
    api = client()
    for number in ("1e999", "-1e999", "1E400", "123456789e99999"):
        for path, raw in _bodies(f'{{"type": "object", "default": {number}}}'):
            response = api.post(path, content=raw)
            assert response.status_code == 400, (path, number, response.text[:200])
            assert _error(path, response)["type"] == "invalid_request_error"
    assert api.service.generated == 0, "refused before any generation"


@pytest.mark.unit
def test_schemas_nested_near_the_recursion_limit_get_a_400_naming_the_field():
    api = client()
    for levels in range(900, 1001):  # the parser takes up to about 990: past 950, rendering did not
        for path, raw in _bodies(_nested(levels)):
            response = api.post(path, content=raw)
            assert response.status_code == 400, (path, levels, response.text[:200])
    response = api.post("/v1/responses", content=_bodies(_nested(200))[1][1])
    error = _error("/v1/responses", response)
    assert "64 levels" in error["message"] and error["param"].startswith("tools[0].parameters.x.x")
    response = api.post("/v1/messages", content=_bodies(_nested(200))[2][1])
    assert _error("/v1/messages", response)["message"].startswith("the request body nests deeper than 64 levels at "
                                                                  "tools.0.input_schema.x.x")
    for path, raw in _bodies(_nested(55)):  # a deep schema within the limit is served
        assert api.post(path, content=raw).status_code == 200, path


@pytest.mark.unit
def test_the_depth_and_item_limits_are_config():
    api = client(max_json_depth=128, max_array_items=10)
    assert api.post(_bodies(_nested(100))[0][0], content=_bodies(_nested(100))[0][1]).status_code == 200
    response = api.post("/v1/chat/completions", json={"model": MODEL, "messages": USER * 11})
    assert response.status_code == 400 and _error("", response)["param"] == "messages"
    assert api.post("/v1/chat/completions", json={"model": MODEL, "messages": USER * 10}).status_code == 200
    with pytest.raises(ValueError, match="max_json_depth"):
        client(max_json_depth=5000)


@pytest.mark.unit
def test_a_role_or_type_that_is_a_list_or_an_object_gets_a_400_naming_the_field():
    """Such a value cannot be a key of the tables of roles and kinds: it is refused like any unknown one, not
    as a 'malformed request' that names no field."""
    api = client()
    for bad in ([], {}, ["user"]):
        cases = [("/v1/chat/completions", {"model": MODEL, "messages": [{"role": bad, "content": "hi"}]},
                  "messages[0].role"),
                 ("/v1/responses", {"model": MODEL, "input": [{"role": bad, "content": "hi"}]}, "input[0].role"),
                 ("/v1/responses", {"model": MODEL, "input": [{"type": bad, "content": "hi"}]}, "input[0].type"),
                 ("/v1/messages", {"model": MODEL, "max_tokens": 3, "messages": [{"role": bad, "content": "hi"}]},
                  "messages.0.role"),
                 ("/v1/messages", {"model": MODEL, "max_tokens": 3,
                                   "messages": [{"role": "user", "content": [{"type": bad}]}]},
                  "messages.0.content.0.type")]
        for path, body, field in cases:
            response = api.post(path, json=body)
            assert response.status_code == 400, (path, bad, response.text[:200])
            assert _error(path, response)["message"].startswith(field), (path, bad, response.text[:200])
    assert api.service.generated == 0


def _function_calls(n: int, model: str = MODEL) -> dict:
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    return {"model": model, "input": [{"role": "user", "content": "x"}] + [call] * n}


def _compact(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


@pytest.mark.unit
def test_every_array_is_capped_and_the_cap_names_the_field():
    api = client()
    body = _compact(_function_calls(56_000))
    assert len(body) < 4 << 20, "a body within the size limit"
    response = api.post("/v1/responses", content=body)
    assert response.status_code == 400 and _error("", response)["param"] == "input", response.text[:300]
    assert "56001 items; at most 4096" in _error("", response)["message"]
    chat = {"model": MODEL, "messages": USER * 135_000}
    response = api.post("/v1/chat/completions", json=chat)
    assert response.status_code == 400 and _error("", response)["param"] == "messages"
    parts = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]
                                                            * 5000}]}
    response = api.post("/v1/messages", json=parts)
    assert response.status_code == 400 and "messages.0.content holds 5000 items" in _error("/v1/messages",
                                                                                            response)["message"]
    assert api.service.generated == 0


@pytest.mark.unit
def test_the_model_and_the_limits_are_checked_before_the_body_is_parsed(monkeypatch):
    parsed = []
    real = openai_responses.parse
    monkeypatch.setattr(openai_responses, "parse", lambda *a: parsed.append(1) or real(*a))
    api = client()
    response = api.post("/v1/responses", content=_compact(_function_calls(56_000, "no-such-model")))
    assert response.status_code == 404 and _error("", response)["param"] == "model", response.text[:300]
    assert api.post("/v1/messages", json={"model": "claude-9", "max_tokens": 2, "messages": USER}
                    ).json()["error"]["type"] == "not_found_error"
    api.service.in_flight["alice"] = api.service.max_in_flight_per_tenant  # alice at her limit
    response = api.post("/v1/responses", content=b"{not even json")
    assert response.status_code == 429 and _error("", response)["type"] == "rate_limit_error"
    response = api.post("/v1/messages", content=b"{not even json")
    assert response.status_code == 529 and _error("/v1/messages", response)["type"] == "overloaded_error"
    bob = api.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers={"Authorization": "Bearer key-bob"})
    assert bob.status_code == 200, "bob has his own limit"
    api.service.in_flight["bob"] = api.service.max_in_flight - api.service.max_in_flight_per_tenant
    carol = api.post("/v1/responses", content=b"{", headers={"Authorization": "Bearer key-bob"})
    assert carol.status_code == 429, "the server is full"
    assert parsed == [1], "only bob's request was parsed"


@dataclasses.dataclass(frozen=True)
class _CountedMessage(Message):
    built = [0]  # tool calls held by every message made: linear work makes each call's message once

    def __post_init__(self) -> None:
        _CountedMessage.built[0] += len(self.tool_calls)


@pytest.mark.unit
def test_consecutive_function_calls_are_gathered_in_linear_work(monkeypatch):
    monkeypatch.setattr(openai_responses, "Message", _CountedMessage)
    n = 20_000
    request = openai_responses.parse(_function_calls(n), (1,))
    (user, assistant) = request.prompt.messages
    assert len(assistant.tool_calls) == n
    assert _CountedMessage.built[0] <= 2 * n, f"{_CountedMessage.built[0]} calls copied for {n}: quadratic"


class _Counted(str):
    """Text that counts the characters its concatenations copy (str's + on it, in either order)."""

    copied = [0]

    def __add__(self, other: str) -> _Counted:
        _Counted.copied[0] += len(self) + len(other)
        return _Counted(str.__add__(self, other))

    def __radd__(self, other: str) -> _Counted:
        _Counted.copied[0] += len(self) + len(other)
        return _Counted(str.__add__(other, self))


@pytest.mark.unit
def test_consecutive_user_turns_merge_in_linear_work():
    n = 20_000
    prompt = Prompt(MODEL, [Message("user", _Counted(f"m{i}")) for i in range(n)], SamplingParams(max_tokens=1))
    (turn,) = chat_messages(prompt)
    assert turn["content"] == "\n\n".join(f"m{i}" for i in range(n))
    assert _Counted.copied[0] <= 10 * len(turn["content"]), f"{_Counted.copied[0]} characters copied: quadratic"


@pytest.mark.integration
@pytest.mark.xdist_group("real_model")
@pytest.mark.skipif(bool(needs_server[-1].args[0]), reason=needs_server[-1].kwargs["reason"])
def test_a_4_mib_body_does_not_stall_the_server(served, monkeypatch):
    """/health answers while the body waits to be decoded, and while it waits to have its shape checked: the test
    holds each step until /health has answered, as a slow step on a 4 MiB body would last. A step run on the
    server's event loop would hold /health with it (once 18.7 s behind such a body), here until the hang guard."""
    from engine.api import body as parsing

    steps = {name: (threading.Event(), threading.Event()) for name in ("decode", "check_shape")}  # reached, go on

    def held(name: str, step):
        reached, go_on = steps[name]

        def run(*args):
            reached.set()
            go_on.wait()
            return step(*args)
        return run

    for name in steps:
        monkeypatch.setattr(parsing, name, held(name, getattr(parsing, name)))
    body = _compact(_function_calls(56_000))
    answer = {}

    def hostile() -> None:
        answer["response"] = httpx.post(served.url + "/v1/responses", content=body, timeout=120,
                                        headers={"Authorization": "Bearer key-alice"})

    sender = threading.Thread(target=hostile)
    sender.start()
    try:
        for name, (reached, go_on) in steps.items():
            assert reached.wait(60), f"the body never reached {name}"  # a hang guard
            assert httpx.get(served.url + "/health", timeout=60).status_code == 200, f"/health beside {name}"
            go_on.set()
    finally:
        for _, go_on in steps.values():
            go_on.set()
        sender.join()
    assert answer["response"].status_code == 400, answer["response"].text[:300]
