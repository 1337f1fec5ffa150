"""OpenAI Chat Completions: a request body to a `Prompt`, a `Reply` to the API's objects and stream chunks.

Every field the API defines is either honoured or refused with a 400 naming it; none is ignored, and
unknown fields are refused too. Text and, in user messages, image parts (`image_url` with a data: URL, and
an optional `uuid` naming the image as vLLM's multi_modal_uuids do; no audio or files); function tools and
tool calls travel as `engine.api.conversation` describes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from engine.api import body
from engine.api.conversation import (
    CALL_MAX_DEPTH,
    CALL_MAX_ITEMS,
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

HONOURED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
            "stream_options", "stop", "seed", "user", "tools", "tool_choice", "parallel_tool_calls"}
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "logit_bias": None,
           "top_logprobs": None, "response_format": None}  # accepted only at their no-op value
DEFAULT_MAX_TOKENS = 256


def parse(body: Any, stop_token_ids: Sequence[int]) -> Prompt:
    """The request, or ApiError(400) naming the field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    body = {name: value for name, value in body.items() if value is not None}  # null is the default, as in the API
    for name in body:
        if name not in HONOURED and name not in NEUTRAL:
            raise ApiError(400, f"unknown or unsupported field {name!r}", name)
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] != neutral and not (neutral is None and body[name] in ([], {})):
            raise ApiError(400, f"{name} is not supported by this server", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required", "model")
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n = 1 is supported", "n")
    if body.get("tool_choice", "auto") not in ("auto", None) or body.get("parallel_tool_calls") is False:
        raise ApiError(400, "tool_choice may only be 'auto' (and parallel_tool_calls not false)", "tool_choice")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", "stream")
    if not isinstance(body.get("user", ""), str):  # kept nowhere, but a string in the API
        raise ApiError(400, "user must be a string", "user")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "stream_options may hold include_usage only", "stream_options")
    return Prompt(model, _messages(body.get("messages")), _sampling(body, stop_token_ids), stream,
                  _tools(body.get("tools")), bool(options.get("include_usage", False)))


def _messages(messages: Any) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object", "messages")
        given = message.get("role")
        if message.get("name") is not None:  # the template has no participants' names to give the model
            raise ApiError(400, f"messages[{i}].name is not supported: this server's template cannot tell "
                                "participants apart", f"messages[{i}].name")
        if given not in ("system", "developer", "user", "assistant", "tool"):  # compared, never hashed: any JSON
            raise ApiError(400, f"messages[{i}].role {given!r} is not supported (system, developer, "
                                "user, assistant, tool)", "messages")
        role: str = "system" if given == "developer" else given
        allowed = {"role", "content", "name"} | {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(role, set())
        if set(message) - allowed:
            raise ApiError(400, f"messages[{i}] has unsupported fields {sorted(set(message) - allowed)}", "messages")
        calls = tuple(_call(call, i) for call in message.get("tool_calls") or ())
        images: tuple[ImagePart, ...] = ()
        if role == "user" and isinstance(message.get("content"), list):
            content, images = _user_parts(message["content"], i)
        else:
            content = "" if message.get("content") is None and (calls or role == "assistant") else \
                _text(message.get("content"), i)
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise ApiError(400, f"messages[{i}]: a tool message needs its tool_call_id", "messages")
        out.append(Message(role, content, calls, message.get("tool_call_id"), images))
    return out


def _call(call: Any, i: int) -> ToolCall:
    try:
        function = call["function"]
        arguments = body.loads(function["arguments"])
        assert call.get("type", "function") == "function" and isinstance(arguments, dict)
        assert body.within(arguments, CALL_MAX_DEPTH, CALL_MAX_ITEMS)  # they are rendered back into the prompt
        return ToolCall(str(call["id"]), str(function["name"]), arguments)
    except (KeyError, TypeError, ValueError, AssertionError, RecursionError):
        raise ApiError(400, f"messages[{i}].tool_calls: each must be a function call with an id, a name and "
                            f"JSON object arguments (finite numbers, at most {CALL_MAX_DEPTH} levels deep)",
                       "messages") from None


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or text parts", "messages")


def _user_parts(content: list, i: int) -> tuple[str, tuple[ImagePart, ...]]:
    """A user message's text and image parts: the text with an image mark where each image goes."""
    texts, images = [], []
    for j, part in enumerate(content):
        at = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
            raise ApiError(400, f"{at} must be a text or image_url part", "messages")
        if part["type"] == "text":
            if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{at}: a text part is {{type, text}} with text a string", "messages")
            texts.append(plain_text(part["text"]))
            continue
        image, caller_id = part.get("image_url"), part.get("uuid")
        if set(part) - {"type", "image_url", "uuid"} or not isinstance(image, dict) or set(image) - {"url", "detail"} \
                or not isinstance(image.get("url"), str) or not isinstance(caller_id, (str, type(None))):
            raise ApiError(400, f"{at}: an image_url part is {{type, image_url: {{url, detail}}, uuid}} with url a "
                                "string (a data: URL)", "messages")
        if image.get("detail", "auto") not in ("auto", "low", "high"):
            raise ApiError(400, f"{at}.image_url.detail must be auto, low or high", "messages")
        texts.append(IMAGE_MARK)
        images.append(ImagePart(image["url"], caller_id=caller_id))
    return "".join(texts), tuple(images)


def _tools(tools: Any) -> list[Tool]:
    if tools in (None, []):
        return []
    out = []
    for i, tool in enumerate(tools if isinstance(tools, list) else [None]):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(400, f"tools[{i}] must be a function tool with a name", "tools")
        if set(function) - {"name", "description", "parameters", "strict"}:
            raise ApiError(400, f"tools[{i}].function has unsupported fields", "tools")
        out.append(Tool(function["name"], str(function.get("description", "")), function.get("parameters") or {}))
    return out


def _sampling(body: dict, stop_token_ids: Sequence[int]) -> SamplingParams:
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                      DEFAULT_MAX_TOKENS)  # null is the default, never "until the context is full"
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 2:
        raise ApiError(400, f"temperature must lie in [0, 2], got {temperature}", "temperature")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > 4:
        raise ApiError(400, "stop must be a string or an array of at most 4 strings", "stop")
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed < 0:
        seed += 2**64  # OpenAI seeds are signed 64-bit
    try:
        return SamplingParams(temperature=temperature, top_p=body.get("top_p", 1.0), seed=seed,
                              max_tokens=max_tokens, stop_token_ids=tuple(stop_token_ids), stop=tuple(stop))
    except DecodeError as exc:  # its message starts with the field at fault, which is the API's too
        message = str(exc).replace("SamplingParams: ", "")
        field = message.split()[0]
        given = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        raise ApiError(400, message, given if field == "max_tokens" else field) from None


def error_body(error: ApiError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": None}}


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(reply: Reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": reply.cached_tokens}}


def _tool_calls(reply: Reply) -> list[dict]:
    return [{"index": i, "id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for i, call in enumerate(reply.tool_calls)]


def completion(reply: Reply, rid: str, model: str) -> dict:
    text = reply.text if reply.text or not reply.tool_calls else None
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reply.tool_calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in _tool_calls(reply)]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
            "usage": usage(reply)}


class ChatStream:
    """The server-sent events of one streamed completion."""

    def __init__(self, rid: str, model: str, prompt: Prompt) -> None:
        self.rid, self.model, self.include_usage = rid, model, prompt.stream_usage

    def start(self, prompt_tokens: int, cached_tokens: int) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, delta: str) -> bytes:
        return self._chunk({"content": delta})

    def finish(self, reply: Reply) -> bytes:
        out = self._chunk({"tool_calls": _tool_calls(reply)}) if reply.tool_calls else b""
        out += self._chunk({}, reply.finish_reason)
        if self.include_usage:
            out += _event({"id": self.rid, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": self.model, "choices": [], "usage": usage(reply)})
        return out + b"data: [DONE]\n\n"

    def error(self, error: ApiError) -> bytes:
        return _event(error_body(error)) + b"data: [DONE]\n\n"

    def _chunk(self, delta: dict, reason: str | None = None) -> bytes:
        return _event({"id": self.rid, "object": "chat.completion.chunk", "created": int(time.time()),
                       "model": self.model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                         "finish_reason": reason}]})


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
