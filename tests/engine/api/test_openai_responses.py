"""OpenAI Responses shapes without a server or a model: requests parse into the expected Prompt or a 400 naming
the field, replies render as response objects and event streams the official `openai` client accepts (its
pydantic types, and its own parsing and stream accumulation over a mock HTTP transport), and the response
store chains, forgets least recently used first, and keeps tenants apart."""

from __future__ import annotations

import json

import pytest

from engine.api import openai_responses as orr
from engine.api.conversation import LENGTH, STOP, TOOL_CALLS, Message, Prompt, Reply, Tool, ToolCall
from engine.api.errors import ApiError
from engine.decode import SamplingParams

pytestmark = pytest.mark.unit
openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # the transport the openai client is built on
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

STOPS = (1, 106)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER,
          "strict": True}]
ITEMS = [
    {"role": "developer", "content": "Be brief."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                    {"type": "input_text", "text": "Paris and Rome?"}]},
    {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
     "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city": "Paris"}', "status": "completed"},
    {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "18C, sunny"},
    {"type": "function_call_output", "call_id": "call_2", "output": "25C"},
    {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
]
PARIS, ROME = ToolCall("call_1", "get_weather", {"city": "Paris"}), ToolCall("call_2", "get_weather", {"city": "Rome"})


def _parse(**fields) -> orr.ResponsesRequest:
    return orr.parse({"model": "gemma", "input": "hi", **fields}, STOPS)


def test_a_string_input_is_one_user_message_with_the_apis_defaults():
    request = orr.parse({"model": "gemma", "input": "What is 2+2?"}, STOPS)
    assert request.prompt.messages == [Message("user", "What is 2+2?")]
    assert request.prompt.sampling == SamplingParams(temperature=1.0, top_p=1.0, max_tokens=256, stop_token_ids=STOPS)
    assert (request.prompt.model, request.prompt.stream, request.prompt.tools) == ("gemma", False, [])
    assert (request.previous_response_id, request.store) == (None, True)


def test_instructions_lead_and_every_honoured_field_is_used():
    request = _parse(instructions="Answer in French.", max_output_tokens=12, temperature=0.25, top_p=0.5, stream=True,
                     store=False, previous_response_id="resp_1", tools=TOOLS, tool_choice="auto", metadata={"k": "v"},
                     user="u-1", parallel_tool_calls=True, truncation="disabled", background=False, include=[],
                     text={"format": {"type": "text"}}, reasoning=None)
    assert request.prompt.messages == [Message("system", "Answer in French."), Message("user", "hi")]
    assert request.prompt.sampling == SamplingParams(temperature=0.25, top_p=0.5, max_tokens=12, stop_token_ids=STOPS)
    assert request.prompt.stream and not request.store and request.previous_response_id == "resp_1"
    assert request.prompt.tools == [Tool("get_weather", "The weather in a city.", WEATHER)]


def test_items_with_function_calls_and_their_outputs_become_messages():
    request = _parse(input=ITEMS)
    assert request.prompt.messages == [
        Message("system", "Be brief."),
        Message("user", "Weather in Paris and Rome?"),
        Message("assistant", "Let me look.", (PARIS, ROME)),  # the calls merge into the message before them
        Message("tool", "18C, sunny", tool_call_id="call_1"),
        Message("tool", "25C", tool_call_id="call_2"),
        Message("assistant", "", (ToolCall("call_3", "get_weather", {}),)),  # no assistant message before: its own
    ]


def _item(**fields) -> dict:
    return {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", **fields}


BAD = [
    ({"model": "", "input": "hi"}, "model"),
    ({"input": "hi"}, "model"),
    ({"model": "gemma"}, "input"),
    ({"model": "gemma", "input": []}, "input"),
    ({"model": "gemma", "input": 3}, "input"),
    ({"model": "gemma", "input": "hi", "frequency_penalty": 0}, "frequency_penalty"),
    ({"model": "gemma", "input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"model": "gemma", "input": "hi", "background": True}, "background"),
    ({"model": "gemma", "input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"model": "gemma", "input": "hi", "text": {"format": {"type": "json_object"}}}, "text"),
    ({"model": "gemma", "input": ["hi"]}, "input[0]"),
    ({"model": "gemma", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": "gemma", "input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name"),
    ({"model": "gemma", "input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"model": "gemma", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, "input[0].content[0].type"),
    ({"model": "gemma", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[1].type"),
    ({"model": "gemma", "input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text"),
    ({"model": "gemma", "input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"model": "gemma", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"model": "gemma", "input": [_item(arguments="{not json")]}, "input[0].arguments"),
    ({"model": "gemma", "input": [_item(arguments="[1, 2]")]}, "input[0].arguments"),
    ({"model": "gemma", "input": [_item(arguments={"city": "Paris"})]}, "input[0].arguments"),
    ({"model": "gemma", "input": [_item(call_id=None)]}, "input[0].call_id"),
    ({"model": "gemma", "input": [_item(name=3)]}, "input[0].name"),
    ({"model": "gemma", "input": [{"type": "function_call_output", "call_id": "c",
                                   "output": [{"type": "input_text", "text": "x"}]}]}, "input[0].output"),
    ({"model": "gemma", "input": "hi", "instructions": ["be brief"]}, "instructions"),
    ({"model": "gemma", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "gemma", "input": "hi", "max_output_tokens": "8"}, "max_output_tokens"),
    ({"model": "gemma", "input": "hi", "max_output_tokens": True}, "max_output_tokens"),
    ({"model": "gemma", "input": "hi", "temperature": 2.5}, "temperature"),
    ({"model": "gemma", "input": "hi", "temperature": -0.1}, "temperature"),
    ({"model": "gemma", "input": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "gemma", "input": "hi", "top_p": 0}, "top_p"),
    ({"model": "gemma", "input": "hi", "top_p": 1.5}, "top_p"),
    ({"model": "gemma", "input": "hi", "stream": "yes"}, "stream"),
    ({"model": "gemma", "input": "hi", "store": 1}, "store"),
    ({"model": "gemma", "input": "hi", "previous_response_id": 7}, "previous_response_id"),
    ({"model": "gemma", "input": "hi", "tools": {"type": "function", "name": "f"}}, "tools"),
    ({"model": "gemma", "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "gemma", "input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"model": "gemma", "input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"model": "gemma", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "{}"}]},
     "tools[0].parameters"),
    ({"model": "gemma", "input": "hi", "tools": [{"type": "function", "name": "f", "strict": "yes"}]},
     "tools[0].strict"),
    ({"model": "gemma", "input": "hi", "tools": [{"type": "function", "name": "f", "defer_loading": True}]},
     "tools[0].defer_loading"),
    ({"model": "gemma", "input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"model": "gemma", "input": "hi", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"model": "gemma", "input": "hi", "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"model": "gemma", "input": "hi", "truncation": "auto"}, "truncation"),
    ({"model": "gemma", "input": "hi", "metadata": {"k": 1}}, "metadata"),
    ({"model": "gemma", "input": "hi", "metadata": ["k"]}, "metadata"),
    ({"model": "gemma", "input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"model": "gemma", "input": "hi", "user": 5}, "user"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[f"{i}-{param}" for i, (_, param) in enumerate(BAD)])
def test_an_unsupported_field_type_or_value_is_a_400_naming_it(body, param):
    with pytest.raises(ApiError) as caught:
        orr.parse(body, STOPS)
    assert (caught.value.status, caught.value.param, caught.value.kind) == (400, param, "invalid_request_error")


def test_a_body_that_is_not_an_object_is_a_400():
    with pytest.raises(ApiError) as caught:
        orr.parse(["model"], STOPS)
    assert caught.value.status == 400


TEXT = Reply("Bonjour !", [], STOP, prompt_tokens=20, completion_tokens=4, cached_tokens=16)
CALLS = Reply("", [ToolCall("call_a", "get_weather", {"city": "Paris"}),
                   ToolCall("call_b", "get_weather", {"city": "Oslo"})], TOOL_CALLS,
              prompt_tokens=30, completion_tokens=25, cached_tokens=0)
BOTH = Reply("Looking.", [ToolCall("call_c", "get_weather", {"city": "Lima"})], TOOL_CALLS, 30, 12, 8)
CUT = Reply("Once upon a", [], LENGTH, prompt_tokens=5, completion_tokens=3, cached_tokens=0)


def _prompt():
    return _parse(instructions="Be brief.", tools=TOOLS, metadata={"session": "s-1"}, user="u-1",
                  max_output_tokens=64, temperature=0.5).prompt


def test_a_text_response_validates_and_its_output_text_is_the_reply():
    body = orr.response(TEXT, "resp_1", "gemma", _prompt(), "resp_0")
    response = Response.model_validate(body)
    assert (response.output_text, response.status, response.incomplete_details) == ("Bonjour !", "completed", None)
    assert [item.type for item in response.output] == ["message"]
    usage = response.usage
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens, usage.total_tokens) == (
        20, 16, 4, 24)
    assert (response.id, response.model, response.previous_response_id, response.instructions) == (
        "resp_1", "gemma", "resp_0", "Be brief.")
    assert (response.metadata, response.user, response.max_output_tokens, response.temperature) == (
        {"session": "s-1"}, "u-1", 64, 0.5)
    assert body["tools"] == TOOLS and body["store"] is True


def test_tool_calls_are_function_call_items_after_the_text_if_any():
    response = Response.model_validate(orr.response(CALLS, "resp_2", "gemma", _prompt(), None))
    assert response.output_text == "" and response.status == "completed"
    assert [(item.type, item.call_id, item.name, json.loads(item.arguments)) for item in response.output] == [
        ("function_call", "call_a", "get_weather", {"city": "Paris"}),
        ("function_call", "call_b", "get_weather", {"city": "Oslo"})]
    assert len({item.id for item in response.output}) == 2
    response = Response.model_validate(orr.response(BOTH, "resp_3", "gemma", _prompt(), None))
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Looking."


def test_a_reply_cut_at_max_output_tokens_is_incomplete():
    response = Response.model_validate(orr.response(CUT, "resp_4", "gemma", _prompt(), None))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "Once upon a"


def test_a_plain_prompt_gets_the_apis_defaults():
    prompt = Prompt("gemma", [Message("user", "hi")], SamplingParams(max_tokens=8), tools=[Tool("f")])
    response = Response.model_validate(orr.response(TEXT, "resp_5", "gemma", prompt, None))
    assert (response.instructions, response.metadata, [tool.name for tool in response.tools]) == (None, {}, ["f"])


def test_response_ids_are_fresh():
    ids = {orr.response_id() for _ in range(100)}
    assert len(ids) == 100 and all(rid.startswith("resp_") for rid in ids)


def _events(raw: bytes) -> list[dict]:
    """The stream's events, each an `event:` line naming the type of the `data:` line's JSON."""
    assert raw.endswith(b"\n\n")
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def _stream(reply: Reply, deltas: list[str], rid: str = "resp_s") -> tuple[bytes, list[dict]]:
    stream = orr.ResponseStream(rid, "gemma", _prompt(), "resp_0")
    raw = stream.start(reply.prompt_tokens, reply.cached_tokens) + b"".join(map(stream.text, deltas))
    raw += stream.finish(reply)
    events = _events(raw)
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return raw, events


def _without_times(body: dict) -> dict:
    return {name: value for name, value in body.items() if name not in ("created_at", "completed_at")}


def test_a_streamed_text_reply_validates_event_by_event_and_ends_with_the_response():
    _, events = _stream(TEXT, ["Bon", "", "jour !"])
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta") == "Bonjour !"
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert _without_times(final) == _without_times(orr.response(TEXT, "resp_s", "gemma", _prompt(), "resp_0"))
    assert final["created_at"] == events[0]["response"]["created_at"]


def test_a_streamed_tool_call_reply_has_function_call_items_and_no_message():
    _, events = _stream(CALLS, [])
    assert [event["type"] for event in events] == ["response.created", "response.in_progress"] + [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"] * 2 + ["response.completed"]
    done = [event for event in events if event["type"] == "response.function_call_arguments.done"]
    assert [(event["output_index"], json.loads(event["arguments"])) for event in done] == [
        (0, {"city": "Paris"}), (1, {"city": "Oslo"})]
    assert _without_times(events[-1]["response"]) == _without_times(
        orr.response(CALLS, "resp_s", "gemma", _prompt(), "resp_0"))


def test_text_held_back_is_sent_at_the_finish_and_a_cut_reply_ends_incomplete():
    _, events = _stream(BOTH, ["Look"])
    assert "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta") == "Looking."
    assert [event["output_index"] for event in events if event["type"] == "response.output_item.added"] == [0, 1]
    _, events = _stream(CUT, [])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_error_event_validates_and_continues_the_sequence():
    stream = orr.ResponseStream("resp_e", "gemma", _prompt(), None)
    events = _events(stream.start(3, 0) + stream.text("a") + stream.error(ApiError(500, "boom", kind="server_error")))
    assert events[-1] == {"type": "error", "sequence_number": 5, "code": "server_error", "message": "boom",
                          "param": None}
    TypeAdapter(ResponseStreamEvent).validate_python(events[-1])


def _client(status: int, content: bytes, content_type: str = "application/json"):
    """The official client, its requests answered with `content` (no network)."""
    transport = httpx2.MockTransport(lambda request: httpx2.Response(status, content=content,
                                                                     headers={"content-type": content_type}))
    return openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0,
                         http_client=httpx2.Client(transport=transport))


@pytest.mark.parametrize("reply", [TEXT, CALLS, BOTH, CUT], ids=["text", "calls", "both", "cut"])
def test_the_official_client_reads_the_response_and_accumulates_the_stream(reply):
    body = orr.response(reply, "resp_c", "gemma", _prompt(), None)
    response = _client(200, json.dumps(body).encode()).responses.create(model="gemma", input="hi")
    assert response.output_text == reply.text and response.id == "resp_c"
    raw, _ = _stream(reply, [reply.text[:3]], rid="resp_c")
    with _client(200, raw, "text/event-stream").responses.stream(model="gemma", input="hi") as stream:
        last = list(stream)[-1]
        # the client's helper finishes only at response.completed; an incomplete reply ends at its last event
        final = stream.get_final_response() if reply.finish_reason != LENGTH else last.response
    assert last.type == f"response.{body['status']}" and last.response.id == "resp_c"
    assert final.output_text == reply.text and final.status == body["status"]
    assert [item.type for item in final.output] == [item["type"] for item in body["output"]]


def test_output_items_the_client_sends_back_as_input_parse():
    sent = []

    def answer(request):
        sent.append(json.loads(request.content))
        return httpx2.Response(200, content=json.dumps(orr.response(BOTH, "resp_b", "gemma", _prompt(), None)).encode(),
                               headers={"content-type": "application/json"})

    client = openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))
    first = client.responses.create(model="gemma", input="Weather in Lima?", tools=TOOLS)
    call = first.output[1]
    client.responses.create(model="gemma", tools=TOOLS, input=[
        {"role": "user", "content": "Weather in Lima?"}, *first.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": "20C"}])
    assert orr.parse(sent[1], STOPS).prompt.messages == [
        Message("user", "Weather in Lima?"), Message("assistant", "Looking.", (BOTH.tool_calls[0],)),
        Message("tool", "20C", tool_call_id="call_c")]


def test_errors_and_deletion_have_the_apis_shapes():
    error = ApiError(404, "Response with id 'resp_x' not found.", "response_id", "not_found_error")
    assert orr.error_body(error) == {"error": {"message": error.message, "type": "not_found_error",
                                               "param": "response_id", "code": None}}
    with pytest.raises(openai.NotFoundError) as caught:
        _client(404, json.dumps(orr.error_body(error)).encode()).responses.retrieve("resp_x")
    assert caught.value.body["param"] == "response_id"
    assert orr.deleted("resp_x") == {"id": "resp_x", "object": "response", "deleted": True}
    assert _client(200, json.dumps(orr.deleted("resp_x")).encode()).responses.delete("resp_x") is None


def _turn(store: orr.ResponseStore, tenant: str, body: dict, answer: str, rid: str) -> list[Message]:
    """One request through the store as the server does it; the conversation the model saw."""
    request = orr.parse({"model": "gemma", **body}, STOPS)
    messages = store.conversation(tenant, request.previous_response_id, request.prompt)
    reply = Reply(answer, [], STOP, 10, 2, 0)
    store.put(tenant, rid, orr.StoredResponse(
        messages + [Message("assistant", answer)],
        orr.response(reply, rid, "gemma", request.prompt, request.previous_response_id), [1, 2, 3], "interactive"))
    return messages


def test_chaining_gives_the_earlier_conversation_then_the_new_messages_without_old_instructions():
    store = orr.ResponseStore()
    _turn(store, "alice", {"instructions": "Be terse.", "input": [{"role": "system", "content": "Shh."},
                                                                  {"role": "user", "content": "Hi"}]}, "Hello.", "r1")
    seen = _turn(store, "alice", {"instructions": "Be verbose.", "input": "And?", "previous_response_id": "r1"},
                 "Well...", "r2")
    assert seen == [Message("system", "Be verbose."), Message("system", "Shh."), Message("user", "Hi"),
                    Message("assistant", "Hello."), Message("user", "And?")]
    seen = _turn(store, "alice", {"input": "Bye", "previous_response_id": "r2"}, "Bye.", "r3")
    assert seen == [Message("system", "Shh."), Message("user", "Hi"), Message("assistant", "Hello."),
                    Message("user", "And?"), Message("assistant", "Well..."), Message("user", "Bye")]
    assert store.get("alice", "r3").body["previous_response_id"] == "r2"


def _entry(n: int) -> orr.StoredResponse:
    return orr.StoredResponse([Message("user", str(n))], {"id": f"r{n}"}, [n], "batch")


def test_the_store_forgets_the_least_recently_used_first():
    store = orr.ResponseStore(max_responses=2)
    store.put("alice", "r1", _entry(1))
    store.put("alice", "r2", _entry(2))
    assert list(store.get("alice", "r1").tokens) == [1]  # read: now r2 is the least recently used
    store.put("alice", "r3", _entry(3))
    assert [list(store.get("alice", rid).tokens) for rid in ("r1", "r3")] == [[1], [3]]
    with pytest.raises(ApiError) as caught:
        store.get("alice", "r2")
    assert caught.value.status == 404
    store.put("alice", "r4", _entry(4))  # r1 was read before r3: r1 goes
    with pytest.raises(ApiError):
        store.get("alice", "r1")
    with pytest.raises(ValueError):
        orr.ResponseStore(max_responses=0)


def test_each_tenant_has_its_own_bounds_in_count_and_bytes():
    store = orr.ResponseStore(max_responses=2, max_bytes=10_000)
    store.put("alice", "a1", _entry(1))
    for i in range(5):  # bob's many responses never push alice's out
        store.put("bob", f"b{i}", _entry(i))
    assert list(store.get("alice", "a1").tokens) == [1]
    big = _entry(2)
    big.tokens = list(range(2_000))  # 8,000 bytes as int32
    store.put("alice", "a2", big)
    store.put("alice", "a3", big)  # two of them pass alice's bytes: her oldest go
    with pytest.raises(ApiError):
        store.get("alice", "a1")
    with pytest.raises(ApiError):
        store.get("alice", "a2")
    assert len(store.get("alice", "a3").tokens) == 2_000 and store.bytes["alice"] <= 10_000


def test_delete_removes_and_returns_the_entry():
    store = orr.ResponseStore()
    store.put("alice", "r1", _entry(1))
    assert list(store.delete("alice", "r1").tokens) == [1]
    for call in (lambda: store.get("alice", "r1"), lambda: store.delete("alice", "r1")):
        with pytest.raises(ApiError) as caught:
            call()
        assert (caught.value.status, caught.value.param, caught.value.kind) == (404, "response_id", "not_found_error")


def test_a_tenant_never_sees_chains_on_or_deletes_another_tenants_response():
    store = orr.ResponseStore()
    store.put("alice", "r1", _entry(1))
    prompt = _parse(previous_response_id="r1").prompt
    for call, param in ((lambda: store.get("bob", "r1"), "response_id"),
                        (lambda: store.delete("bob", "r1"), "response_id"),
                        (lambda: store.conversation("bob", "r1", prompt), "previous_response_id")):
        with pytest.raises(ApiError) as caught:
            call()
        assert (caught.value.status, caught.value.param) == (404, param)
    assert store.conversation("alice", "r1", prompt) == [Message("user", "1"), Message("user", "hi")]
    store.put("bob", "r1", _entry(2))  # the same id under bob is bob's own
    assert (list(store.get("alice", "r1").tokens), list(store.get("bob", "r1").tokens)) == ([1], [2])
    store.delete("bob", "r1")
    assert list(store.get("alice", "r1").tokens) == [1]
