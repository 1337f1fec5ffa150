"""OpenAI Chat Completions: a request body to messages and sampling, a reply to the API's objects.

Every field the API defines is either honoured or refused with a 400 naming it; none is ignored.
Unknown fields are refused too. Text content only; tools and tool calls are not supported yet.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from engine.decode import DecodeError, SamplingParams
from engine.decode.request import CONTEXT, MAX_TOKENS

HONOURED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
            "stream_options", "stop", "seed", "user"}
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "logit_bias": None,
           "top_logprobs": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None,
           "response_format": None}  # accepted only at their no-op value
DEFAULT_MAX_TOKENS = 256


class ApiError(Exception):
    """A request the API refuses: its HTTP status and the API's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]  # {role: system|user|assistant, content: str}
    sampling: SamplingParams
    stream: bool
    include_usage: bool


def parse(body: Any, stop_token_ids: Sequence[int]) -> ChatRequest:
    """The request, or ApiError(400) naming the field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
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
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "stream_options may hold include_usage only", "stream_options")
    return ChatRequest(model, _messages(body.get("messages")), _sampling(body, stop_token_ids), stream,
                       bool(options.get("include_usage", False)))


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object", "messages")
        role = {"developer": "system"}.get(message.get("role"), message.get("role"))
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role {message.get('role')!r} is not supported (system, developer, "
                                "user, assistant)", "messages")
        if set(message) - {"role", "content", "name"}:
            raise ApiError(400, f"messages[{i}] has unsupported fields {sorted(set(message) - {'role', 'content', 'name'})}",
                           "messages")
        out.append({"role": role, "content": _text(message.get("content"), i)})
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or text parts", "messages")


def _sampling(body: dict, stop_token_ids: Sequence[int]) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
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
    except DecodeError as exc:  # the field it names is the API's too
        raise ApiError(400, str(exc).replace("SamplingParams: ", "")) from None


def finish_reason(reason: str) -> str:
    return "length" if reason in (MAX_TOKENS, CONTEXT) else "stop"


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(rid: str, model: str, text: str, reason: str, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason(reason), "logprobs": None}],
            "usage": usage_}


def chunk(rid: str, model: str, delta: dict, reason: str | None = None, usage_: dict | None = None) -> dict:
    choices = [] if usage_ is not None else [{"index": 0, "delta": delta, "logprobs": None,
                                               "finish_reason": finish_reason(reason) if reason else None}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


class ReplyText:
    """The reply's text as tokens come: what can be sent so far, without a stop string or its start, a
    stop token, or half a UTF-8 character."""

    def __init__(self, detokenize, stop_token_ids: Sequence[int], stop: Sequence[str]) -> None:
        self.detokenize, self.stop_ids, self.stop = detokenize, set(stop_token_ids), tuple(stop)
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already sent

    def push(self, token: int) -> None:
        """Record a token (a stop token is not text)."""
        if token not in self.stop_ids:
            self.tokens.append(token)

    def add(self, token: int) -> str:
        """Record a token; the new text it makes safe to send."""
        self.push(token)
        text = self._text()
        held = max((len(s) - 1 for s in self.stop), default=0)  # a stop string may be starting
        ready = len(text) - held if not text.endswith("\ufffd") else len(text.rstrip("\ufffd")) - held
        return self._take(text, ready)

    def finish(self) -> str:
        """The rest, at the end of the reply."""
        return self._take(self._text(), None)

    def _text(self) -> str:
        text = self.detokenize(self.tokens)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        return text if cut < 0 else text[:cut]

    def _take(self, text: str, ready: int | None) -> str:
        end = len(text) if ready is None else max(self.sent, ready)
        new, self.sent = text[self.sent:end], max(self.sent, end)
        return new
