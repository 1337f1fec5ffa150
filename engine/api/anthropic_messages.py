"""Anthropic Messages (`POST /v1/messages`): a request body to a `Prompt`, a `Reply` to the API's message and
to its server-sent events.

Every field the API defines is honoured or refused with a 400 naming it; none is ignored, and unknown fields
are refused too. A null field counts as absent. Text, images in user messages (base64 sources; a url
source is refused, since this server fetches nothing), tools, tool calls and tool results only: documents,
thinking, server tools and forced tool choices are refused. `cache_control` is accepted wherever the
API allows it and has no effect: this server caches every prompt's prefix on its own, with no breakpoints.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from engine.api.conversation import (
    LENGTH,
    STOP,
    TOOL_CALLS,
    ImagePart,
    Message,
    Prompt,
    Reply,
    Tool,
    ToolCall,
    plain_text,
)
from engine.api.errors import ApiError
from engine.decode import DecodeError, SamplingParams
from engine.text.chat_prompt import IMAGE_MARK

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
          "metadata", "tools", "tool_choice", "cache_control"}
TEXT = {"text": {"text"}}  # block type: its fields
BLOCKS = {"user": {**TEXT, "image": {"source"}, "tool_result": {"tool_use_id", "content", "is_error"}},
          "assistant": {**TEXT, "tool_use": {"id", "name", "input"}}}
STOP_REASONS = {STOP: "end_turn", LENGTH: "max_tokens", TOOL_CALLS: "tool_use"}
ERROR_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 529: "overloaded_error"}  # any other: api_error


def parse(body: Any, stop_token_ids: Sequence[int]) -> Prompt:
    """The request, or ApiError(400) naming the field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    body = _object(body, "body")
    for name in body:
        if name not in FIELDS:
            raise ApiError(400, f"{name}: unknown or unsupported field", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model: a non-empty string is required", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream: must be a boolean", "stream")
    metadata = _object(body.get("metadata", {}), "metadata")
    _fields(metadata, {"user_id"}, "metadata")
    if "user_id" in metadata:
        _string(metadata, "user_id", "metadata", empty=True)
    choice = _object(body.get("tool_choice", {"type": "auto"}), "tool_choice")
    if choice.get("type") != "auto" or choice.get("disable_parallel_tool_use", False) is not False:
        raise ApiError(400, 'tool_choice: only {"type": "auto"} is supported', "tool_choice")
    _fields(choice, {"type", "disable_parallel_tool_use"}, "tool_choice")
    system = [Message("system", _text(body["system"], "system"))] if "system" in body else []
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: a non-empty list is required", "messages")
    turns = [turn for i, message in enumerate(messages) for turn in _message(message, f"messages.{i}")]
    # a last assistant message is a prefill: the reply continues it (and, as in the API, the reply's text is
    # only what follows it)
    prefill = turns[-1].role == "assistant"
    if prefill and turns[-1].content != turns[-1].content.rstrip():
        at = f"messages.{len(messages) - 1}.content"
        raise ApiError(400, f"{at}: final assistant content cannot end with trailing whitespace", at)
    return Prompt(model, system + turns, _sampling(body, stop_token_ids), stream, _tools(body.get("tools", [])),
                  prefill=prefill)


def _object(value: Any, where: str) -> dict:
    """A JSON object without its null fields."""
    if not isinstance(value, dict):
        raise ApiError(400, f"{where}: must be an object", where)
    return {name: field for name, field in value.items() if field is not None}


def _fields(value: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise ApiError(400, f"{where}.{extra[0]}: unknown or unsupported field", f"{where}.{extra[0]}")


def _string(value: dict, name: str, where: str, empty: bool = False) -> str:
    field = value.get(name)
    if not isinstance(field, str) or not (field or empty):
        raise ApiError(400, f"{where}.{name}: a {'' if empty else 'non-empty '}string is required", f"{where}.{name}")
    return field


def _block(block: Any, where: str, kinds: dict[str, set[str]]) -> dict:
    block = _object(block, where)
    kind = block.get("type")
    if not isinstance(kind, str) or kind not in kinds:  # a list or an object is no key to look up
        raise ApiError(400, f"{where}.type: {kind!r} blocks are not supported here (only {sorted(kinds)})",
                       f"{where}.type")
    _fields(block, kinds[kind] | {"type", "cache_control"}, where)
    return block


def _text(content: Any, where: str) -> str:
    """A string, or text blocks (system prompts, tool results) joined as paragraphs."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: must be a string or a list of text blocks", where)
    return "\n\n".join(_string(_block(block, f"{where}.{j}", TEXT), "text", f"{where}.{j}", empty=True)
                       for j, block in enumerate(content))


def _message(message: Any, where: str) -> list[Message]:
    message = _object(message, where)
    _fields(message, {"role", "content"}, where)
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or role not in BLOCKS:
        raise ApiError(400, f"{where}.role: must be 'user' or 'assistant', got {role!r}", f"{where}.role")
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: must be a string or a list of blocks", f"{where}.content")
    texts, calls, results, images = [], [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        block = _block(block, at, BLOCKS[role])
        if block["type"] == "text":
            texts.append(plain_text(_string(block, "text", at, empty=True)))
        elif block["type"] == "image":
            source = _object(block.get("source"), f"{at}.source")
            if source.get("type") == "url":
                raise ApiError(400, f"{at}.source: remote image URLs are not fetched by this server: send the "
                                    "image as a base64 source", f"{at}.source")
            _fields(source, {"type", "media_type", "data"}, f"{at}.source")
            if source.get("type") != "base64":
                raise ApiError(400, f"{at}.source.type: must be 'base64'", f"{at}.source.type")
            images.append(ImagePart(_string(source, "data", f"{at}.source"),
                                    _string(source, "media_type", f"{at}.source")))
            texts.append(IMAGE_MARK)
        elif block["type"] == "tool_use":
            if not isinstance(block.get("input"), dict):
                raise ApiError(400, f"{at}.input: an object is required", f"{at}.input")
            calls.append(ToolCall(_string(block, "id", at), _string(block, "name", at), block["input"]))
        else:
            failed = block.get("is_error", False)
            if not isinstance(failed, bool):
                raise ApiError(400, f"{at}.is_error: must be a boolean", f"{at}.is_error")
            result = _text(block.get("content", ""), f"{at}.content")
            # the model has no error channel for tools: a failed call's result says so in its text
            results.append(Message("tool", "Error: " * failed + result, tool_call_id=_string(block, "tool_use_id", at)))
    text = "\n\n".join(texts)
    if role == "assistant":
        return [Message("assistant", text, tool_calls=tuple(calls))]
    # tool results answer the previous turn's calls, so they come before the user's own text (as the API requires)
    return results + [Message("user", text, images=tuple(images))] * bool(texts or not results)


def _tools(tools: Any) -> list[Tool]:
    if not isinstance(tools, list):
        raise ApiError(400, "tools: must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools.{i}"
        tool = _object(tool, at)
        if tool.get("type", "custom") != "custom":
            raise ApiError(400, f"{at}.type: server tools such as {tool['type']!r} are not supported", f"{at}.type")
        _fields(tool, {"type", "name", "description", "input_schema", "cache_control"}, at)
        if not isinstance(tool.get("input_schema"), dict):
            raise ApiError(400, f"{at}.input_schema: a JSON schema object is required", f"{at}.input_schema")
        description = _string(tool, "description", at, empty=True) if "description" in tool else ""
        out.append(Tool(_string(tool, "name", at), description, tool["input_schema"]))
    return out


def _sampling(body: dict, stop_token_ids: Sequence[int]) -> SamplingParams:
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, f"max_tokens: an integer >= 1 is required, got {max_tokens!r}", "max_tokens")
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise ApiError(400, f"temperature: must lie in [0, 1], got {temperature}", "temperature")
    stop = body.get("stop_sequences", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop_sequences: must be a list of strings", "stop_sequences")
    try:
        return SamplingParams(temperature=temperature, top_p=body.get("top_p", 1.0), top_k=body.get("top_k", 0),
                              seed=None, max_tokens=max_tokens, stop_token_ids=tuple(stop_token_ids),
                              stop=tuple(stop))
    except DecodeError as exc:  # its message starts with the field at fault
        message = str(exc).replace("SamplingParams: ", "")
        name = message.split()[0]
        raise ApiError(400, message, {"stop": "stop_sequences"}.get(name, name)) from None


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _stop(reply: Reply, stop_sequence: str | None) -> dict:
    stop_sequence = stop_sequence if stop_sequence is not None else reply.stop_sequence
    reason = "stop_sequence" if stop_sequence is not None and reply.finish_reason == STOP else \
        STOP_REASONS[reply.finish_reason]
    return {"stop_reason": reason, "stop_sequence": stop_sequence if reason == "stop_sequence" else None}


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    # Anthropic counts cache reads apart from input_tokens (the prompt is their sum); nothing counts as written to
    # the cache, since every prefix is kept without being asked
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


def message(reply: Reply, rid: str, model: str, stop_sequence: str | None = None) -> dict:
    """The response body. `stop_sequence`, when given, overrides `reply.stop_sequence`: the request's stop string
    that ended the reply, if one did."""
    content = [{"type": "text", "text": reply.text}] if reply.text or not reply.tool_calls else []
    return {"id": rid, "type": "message", "role": "assistant", "model": model,
            "content": content + [_tool_use(call) for call in reply.tool_calls], **_stop(reply, stop_sequence),
            "usage": _usage(reply.prompt_tokens, reply.cached_tokens, reply.completion_tokens)}


def _event(data: dict) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


def error_body(error: ApiError) -> dict:
    kind = error.kind if error.kind in {*ERROR_KINDS.values(), "api_error"} else \
        ERROR_KINDS.get(error.status, "api_error")  # e.g. the OpenAI kind server_error
    return {"type": "error", "error": {"type": kind, "message": error.message}}


class MessageStream:
    """The server-sent events of one streamed reply: message_start, the text block as the text comes, then the
    tool_use blocks, message_delta and message_stop. The text block opens at the first text, so that a reply of
    tool calls alone has none, as in `message`; the events add up to `message`'s body."""

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model = rid, model
        self.blocks = 0  # content blocks opened so far
        self.text_open = False

    def start(self, prompt_tokens: int, cached_tokens: int) -> bytes:
        body: dict[str, Any] = {
            "id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_tokens, cached_tokens, 1)}
        return _event({"type": "message_start", "message": body})

    def text(self, delta: str) -> bytes:
        if not delta:
            return b""
        opened = b"" if self.text_open else self._open({"type": "text", "text": ""})
        self.text_open = True
        delta_ = {"type": "text_delta", "text": delta}
        return opened + _event({"type": "content_block_delta", "index": 0, "delta": delta_})

    def finish(self, reply: Reply, stop_sequence: str | None = None) -> bytes:
        """The rest, once the reply is done (its text all sent through `text`); `stop_sequence` as in `message`."""
        out = []
        if not self.text_open and not reply.tool_calls:  # an empty reply still has its (empty) text block
            out.append(self._open({"type": "text", "text": ""}))
            self.text_open = True
        if self.text_open:
            out.append(_event({"type": "content_block_stop", "index": 0}))
        for call in reply.tool_calls:
            index = self.blocks
            out += [self._open({**_tool_use(call), "input": {}}),  # the input follows as JSON, as the API does
                    _event({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}}),
                    _event({"type": "content_block_stop", "index": index})]
        usage = _usage(reply.prompt_tokens, reply.cached_tokens, reply.completion_tokens)
        out += [_event({"type": "message_delta", "delta": _stop(reply, stop_sequence), "usage": usage}),
                _event({"type": "message_stop"})]
        return b"".join(out)

    def error(self, error: ApiError) -> bytes:
        return _event(error_body(error))

    def _open(self, block: dict) -> bytes:
        self.blocks += 1
        return _event({"type": "content_block_start", "index": self.blocks - 1, "content_block": block})
