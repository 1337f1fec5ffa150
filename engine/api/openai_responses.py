"""OpenAI Responses API: a request body to a `Prompt`, a `Reply` to the API's response object and stream
events, and the per-tenant store of earlier responses that `previous_response_id` chains on.

Every field is honoured or refused with a 400 naming it; none is ignored. Text and function tools only.
The response object echoes the request (instructions, metadata, tools, ...): `parse` returns a
`ResponsesPrompt`, which carries that echo; `response` and `ResponseStream` read it from there (a plain
`Prompt` gets the API's defaults), so pass them `request.prompt` or a `dataclasses.replace` of it.
Item ids derive from the response id, so a stream's items and its final response object agree.
"""

from __future__ import annotations

import json
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.api import body
from engine.api.conversation import CALL_MAX_DEPTH, CALL_MAX_ITEMS, LENGTH, Message, Prompt, Reply, Tool, ToolCall
from engine.api.errors import ApiError
from engine.decode import DecodeError, SamplingParams

HONOURED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store",
            "previous_response_id", "tools", "tool_choice", "metadata", "user", "parallel_tool_calls", "truncation"}
NEUTRAL = {"background": False, "include": [], "text": {"format": {"type": "text"}}, "reasoning": None}  # only these
DEFAULT_MAX_OUTPUT_TOKENS = 256
TEXT_PARTS = ("input_text", "output_text")
ITEMS = {"message": {"type", "role", "content", "id", "status"},  # input items: their fields
         "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
         "function_call_output": {"type", "call_id", "output", "id", "status"}}


@dataclass
class ResponsesPrompt(Prompt):
    """A Prompt with what the response object repeats of its request."""

    echo: dict = field(default_factory=dict)  # what the response object repeats: instructions, metadata, tools...


@dataclass
class ResponsesRequest:
    prompt: Prompt  # messages of this request only (instructions as a leading system message)
    previous_response_id: str | None
    store: bool


def parse(body: Any, stop_token_ids: Sequence[int]) -> ResponsesRequest:
    """The request, or ApiError(400) naming the field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name in NEUTRAL and value not in (None, NEUTRAL[name]):
            raise ApiError(400, f"{name} is not supported by this server", name)
        if name not in HONOURED and name not in NEUTRAL:
            raise ApiError(400, f"unknown or unsupported field {name!r}", name)
    given = {name: value for name, value in body.items() if value is not None}
    model = given.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required", "model")
    for name in ("instructions", "previous_response_id", "user"):
        _check(name in given and not isinstance(given[name], str), f"{name} must be a string", name)
    for name in ("previous_response_id", "user"):  # kept with the response: bounded like metadata
        _check(len(given.get(name, "")) > 256, f"{name} must be at most 256 characters", name)
    for name in ("stream", "store"):
        _check(not isinstance(given.get(name, False), bool), f"{name} must be a boolean", name)
    _check(given.get("tool_choice", "auto") != "auto", "only tool_choice 'auto' is supported", "tool_choice")
    _check(given.get("parallel_tool_calls", True) is not True, "only parallel_tool_calls true is supported",
           "parallel_tool_calls")
    _check(given.get("truncation", "disabled") != "disabled", "only truncation 'disabled' is supported", "truncation")
    metadata = given.get("metadata", {})
    _check(not isinstance(metadata, dict) or len(metadata) > 16 or not all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()),
        "metadata must be an object of at most 16 string keys (64 chars) and string values (512 chars)", "metadata")
    instructions = given.get("instructions")
    messages = ([Message("system", instructions)] if instructions is not None else []) + _input(given.get("input"))
    tools, given_tools = _tools(given.get("tools", []))
    echo = {"instructions": instructions, "metadata": metadata, "tools": given_tools, "store": given.get("store", True),
            "user": given.get("user")}
    prompt = ResponsesPrompt(model=model, messages=messages, sampling=_sampling(given, stop_token_ids),
                             stream=given.get("stream", False), tools=tools, echo=echo)
    return ResponsesRequest(prompt, given.get("previous_response_id"), echo["store"])


def _check(bad: bool, message: str, param: str) -> None:
    if bad:
        raise ApiError(400, message, param)


def _fields(item: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(item) - allowed)
    _check(bool(extra), f"{where} has unsupported fields {extra}", f"{where}.{extra[0]}" if extra else where)


def _string(item: dict, name: str, where: str) -> str:
    _check(not isinstance(item.get(name), str), f"{where}.{name} must be a string", f"{where}.{name}")
    return item[name]


def _input(value: Any) -> list[Message]:
    if isinstance(value, str):
        return [Message("user", value)]
    _check(not isinstance(value, list) or not value, "input must be a string or a non-empty array of items", "input")
    messages: list[Message] = []
    calls: list[ToolCall] = []  # consecutive function_call items: one assistant message's, made once (linear)
    for i, item in enumerate(value):
        where = f"input[{i}]"
        _check(not isinstance(item, dict), f"{where} must be an object", where)
        kind = item.get("type", "message")
        _check(not isinstance(kind, str) or kind not in ITEMS,  # a list or an object is no key to look up
               f"{where}.type {kind!r} is not supported ({', '.join(ITEMS)})", f"{where}.type")
        _fields(item, ITEMS[kind], where)
        if kind == "function_call":
            calls.append(ToolCall(_string(item, "call_id", where), _string(item, "name", where),
                                  _arguments(item, where)))
            continue
        _with_calls(messages, calls)
        if kind == "message":
            given = item.get("role")
            _check(given not in ("system", "developer", "user", "assistant"),
                   f"{where}.role must be user, assistant, system or developer", f"{where}.role")
            role = "system" if given == "developer" else given
            messages.append(Message(role, _content(item.get("content"), where)))
        else:
            call_id = _string(item, "call_id", where)
            messages.append(Message("tool", _string(item, "output", where), tool_call_id=call_id))
    _with_calls(messages, calls)
    return messages


def _with_calls(messages: list[Message], calls: list[ToolCall]) -> None:
    """Consecutive function_call items: the calls of the assistant message before them, or of a new one."""
    if not calls:
        return
    if messages and messages[-1].role == "assistant":
        messages[-1] = replace(messages[-1], tool_calls=messages[-1].tool_calls + tuple(calls))
    else:
        messages.append(Message("assistant", tool_calls=tuple(calls)))
    calls.clear()


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    _check(not isinstance(content, list), f"{where}.content must be a string or an array of text parts",
           f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        _check(not isinstance(part, dict) or part.get("type") not in TEXT_PARTS,
               f"{at} must be a text part (input_text, output_text); images, files and audio are not supported",
               f"{at}.type")
        _fields(part, {"type", "text", "annotations", "logprobs"}, at)
        texts.append(_string(part, "text", at))
    return "".join(texts)


def _arguments(item: dict, where: str) -> dict:
    try:
        arguments = body.loads(_string(item, "arguments", where))
    except (ValueError, RecursionError):
        arguments = None
    _check(not isinstance(arguments, dict) or not body.within(arguments, CALL_MAX_DEPTH, CALL_MAX_ITEMS),
           f"{where}.arguments must be a JSON object in a string (finite numbers, at most {CALL_MAX_DEPTH} levels "
           "deep)", f"{where}.arguments")
    return arguments


def _tools(tools: Any) -> tuple[list[Tool], list[dict]]:
    _check(not isinstance(tools, list), "tools must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        _check(not isinstance(tool, dict) or tool.get("type") != "function",
               f"{where}: only function tools are supported", f"{where}.type")
        _fields(tool, {"type", "name", "description", "parameters", "strict"}, where)
        for name, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            _check(tool.get(name) is not None and not isinstance(tool[name], kind),
                   f"{where}.{name} must be a {kind.__name__}", f"{where}.{name}")
        out.append(Tool(_string(tool, "name", where), tool.get("description") or "", tool.get("parameters") or {}))
    return out, tools


def _sampling(given: dict, stop_token_ids: Sequence[int]) -> SamplingParams:
    temperature, top_p = given.get("temperature", 1.0), given.get("top_p", 1.0)
    max_tokens = given.get("max_output_tokens", DEFAULT_MAX_OUTPUT_TOKENS)
    number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    _check(number and not 0 <= temperature <= 2, f"temperature must lie in [0, 2], got {temperature}", "temperature")
    _check(isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1,
           f"max_output_tokens must be an integer >= 1, got {max_tokens!r}", "max_output_tokens")
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, seed=None, max_tokens=max_tokens,
                              stop_token_ids=tuple(stop_token_ids))
    except DecodeError as exc:
        message = str(exc).replace("SamplingParams: ", "")
        raise ApiError(400, message, "temperature" if message.startswith("temperature") else "top_p") from None


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _echo(prompt: Prompt) -> dict:
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
             for t in prompt.tools]
    return {"instructions": None, "metadata": {}, "tools": tools, "store": True, "user": None,
            **getattr(prompt, "echo", {})}


def _body(rid: str, model: str, prompt: Prompt, previous_response_id: str | None, created_at: int, status: str,
          output: list[dict], usage: dict | None) -> dict:
    sampling = prompt.sampling
    return {"id": rid, "object": "response", "created_at": created_at, "status": status, "model": model,
            "output": output, "usage": usage, "previous_response_id": previous_response_id,
            "max_output_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "tool_choice": "auto", "parallel_tool_calls": True, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "completed_at": int(time.time()) if status == "completed" else None,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "background": False, **_echo(prompt)}


def _message(rid: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
    return {"type": "message", "id": f"msg_{rid[5:]}", "status": status, "role": "assistant", "content": content}


def _call(rid: str, i: int, call: ToolCall, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{rid[5:]}_{i}", "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments) if status == "completed" else "", "status": status}


def response(reply: Reply, rid: str, model: str, prompt: Prompt, previous_response_id: str | None,
             created_at: int | None = None, with_message: bool | None = None) -> dict:
    """The response object: status completed, or incomplete when the reply ran out of max_output_tokens. Its
    output: a message item if the reply has text or no tool calls (or `with_message`), then the calls."""
    status = "incomplete" if reply.finish_reason == LENGTH else "completed"
    with_message = bool(reply.text) or not reply.tool_calls if with_message is None else with_message
    output = [_message(rid, reply.text, status)] * with_message
    output += [_call(rid, i, call, "completed") for i, call in enumerate(reply.tool_calls)]
    usage = {"input_tokens": reply.prompt_tokens,
             "input_tokens_details": {"cached_tokens": reply.cached_tokens, "cache_write_tokens": 0},
             "output_tokens": reply.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": reply.prompt_tokens + reply.completion_tokens}
    created_at = int(time.time()) if created_at is None else created_at
    return _body(rid, model, prompt, previous_response_id, created_at, status, output, usage)


class ResponseStream:
    """The server-sent events of one streamed reply. The message item opens at the first text, so a reply
    of tool calls alone has none, as in `response`."""

    def __init__(self, rid: str, model: str, prompt: Prompt, previous_response_id: str | None) -> None:
        self.rid, self.model, self.prompt, self.previous = rid, model, prompt, previous_response_id
        self.created_at, self.sequence, self.sent, self.opened = int(time.time()), 0, "", False
        self.final: dict | None = None  # the finished response object, when made (and stored) before `finish`

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode()

    def _text_event(self, kind: str, **fields: Any) -> bytes:
        return self._event(kind, item_id=f"msg_{self.rid[5:]}", output_index=0, content_index=0, **fields)

    def start(self, prompt_tokens: int, cached_tokens: int) -> bytes:
        """response.created and response.in_progress (usage comes with the finished response, as in the API)."""
        body = _body(self.rid, self.model, self.prompt, self.previous, self.created_at, "in_progress", [], None)
        return self._event("response.created", response=body) + self._event("response.in_progress", response=body)

    def _open(self) -> bytes:
        self.opened = True
        return (self._event("response.output_item.added", output_index=0,
                            item=_message(self.rid, "", "in_progress")) +
                self._text_event("response.content_part.added",
                                 part={"type": "output_text", "text": "", "annotations": []}))

    def text(self, delta: str) -> bytes:
        """response.output_text.delta (after the message item's opening events, the first time)."""
        if not delta:
            return b""
        opening = b"" if self.opened else self._open()
        self.sent += delta
        return opening + self._text_event("response.output_text.delta", delta=delta, logprobs=[])

    def finish(self, reply: Reply) -> bytes:
        """The text the deltas have not sent yet, the items' done events, the tool calls' items, and
        response.completed (or response.incomplete) carrying the response object."""
        out = b""
        if self.opened or reply.text or not reply.tool_calls:
            out += self.text(reply.text[len(self.sent):] if reply.text.startswith(self.sent) else "")
            out += b"" if self.opened else self._open()
            message = _message(self.rid, reply.text, "incomplete" if reply.finish_reason == LENGTH else "completed")
            out += self._text_event("response.output_text.done", text=reply.text, logprobs=[])
            out += self._text_event("response.content_part.done", part=message["content"][0])
            out += self._event("response.output_item.done", output_index=0, item=message)
        for i, call in enumerate(reply.tool_calls):
            index, item = i + self.opened, _call(self.rid, i, call, "completed")
            added = _call(self.rid, i, call, "in_progress")
            out += self._event("response.output_item.added", output_index=index, item=added)
            out += self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"])
            out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=call.name, arguments=item["arguments"])
            out += self._event("response.output_item.done", output_index=index, item=item)
        body = self.final or response(reply, self.rid, self.model, self.prompt, self.previous, self.created_at,
                                      self.opened)
        return out + self._event(f"response.{body['status']}", response=body)

    def error(self, error: ApiError) -> bytes:
        return self._event("error", code=error.kind, message=error.message, param=error.param)


def engine_error(error: ApiError) -> ApiError:
    """An engine's refusal of the request's max_tokens (the prompt leaves too little of the context), in this
    API's words: max_output_tokens."""
    if error.status == 400 and error.param is None and error.message.startswith("max_tokens "):
        return ApiError(400, "max_output_tokens " + error.message.removeprefix("max_tokens "), "max_output_tokens")
    return error


def deleted(rid: str) -> dict:
    return {"id": rid, "object": "response", "deleted": True}


def error_body(error: ApiError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": None}}


@dataclass
class StoredResponse:
    messages: list[Message]  # the whole conversation through this response's reply
    body: dict  # the response object, for GET
    tokens: Sequence[int]  # prompt ids + reply ids (kept as an array of int32)
    traffic_class: str


class ResponseStore:
    """Stored responses by tenant and id, each tenant's least recently used dropped past its bounds: at
    most `max_responses` and `max_bytes` (about: token ids, text, the response object) per tenant, so one
    tenant can neither fill the server's memory nor push another's responses out. A tenant never sees
    another's: the same id under another tenant is simply not found. Used from one asyncio loop only, so
    it takes no lock."""

    def __init__(self, max_responses: int = 10_000, max_bytes: int = 256 << 20) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"max_responses and max_bytes must be >= 1, got {max_responses}, {max_bytes}")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self.tenants: dict[str, OrderedDict[str, tuple[StoredResponse, int]]] = {}  # tenant -> id -> (entry, bytes)
        self.bytes: dict[str, int] = {}

    def put(self, tenant: str, rid: str, entry: StoredResponse) -> None:
        """Store (or replace) a response, dropping the tenant's least recently used past its bounds."""
        entry.tokens = array("i", entry.tokens)  # 4 bytes a token, not a Python int's 28
        size = 4 * len(entry.tokens) + len(json.dumps(entry.body)) + sum(
            len(m.content) + sum(len(json.dumps(c.arguments)) for c in m.tool_calls) for m in entry.messages)
        self.delete(tenant, rid, missing_ok=True)
        entries = self.tenants.setdefault(tenant, OrderedDict())
        entries[rid] = (entry, size)
        self.bytes[tenant] = self.bytes.get(tenant, 0) + size
        while len(entries) > self.max_responses or (self.bytes[tenant] > self.max_bytes and len(entries) > 1):
            _, (_, dropped) = entries.popitem(last=False)
            self.bytes[tenant] -= dropped

    def get(self, tenant: str, rid: str, param: str = "response_id") -> StoredResponse:
        """The tenant's response (now its most recently used), or ApiError 404."""
        entries = self.tenants.get(tenant)
        if entries is None or rid not in entries:
            raise ApiError(404, f"Response with id {rid!r} not found.", param, "not_found_error")
        entries.move_to_end(rid)
        return entries[rid][0]

    def delete(self, tenant: str, rid: str, missing_ok: bool = False) -> StoredResponse | None:
        """Remove the tenant's response and return it, or ApiError 404."""
        if missing_ok and rid not in self.tenants.get(tenant, {}):
            return None
        self.get(tenant, rid)
        entry, size = self.tenants[tenant].pop(rid)
        self.bytes[tenant] -= size
        return entry

    def conversation(self, tenant: str, previous_response_id: str | None, prompt: Prompt) -> list[Message]:
        """This request's instructions, the earlier conversation without its instructions (the API does not
        carry them over), then this request's messages."""
        if previous_response_id is None:
            return list(prompt.messages)
        earlier = self.get(tenant, previous_response_id, "previous_response_id")
        old, new = earlier.messages, prompt.messages
        earlier_instructions = earlier.body.get("instructions")
        if old and earlier_instructions is not None and old[0] == Message("system", earlier_instructions):
            old = old[1:]
        instructions = _echo(prompt)["instructions"]
        head = [new[0]] if instructions is not None and new and new[0] == Message("system", instructions) else []
        return head + old + new[len(head):]
