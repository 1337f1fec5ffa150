"""What every API's request becomes, and how tools travel through a model that has no tool tokens.

Each API module parses its body into a `Prompt` (messages, tools, sampling) and renders a `Reply` in its
own shapes; the server in between knows neither API.

Gemma 3 has no tool-calling tokens, so tools travel as text (the convention of Google's Gemma function
calling guide: tools described in the prompt, a call written as a fenced block):
* the tools are described in the system text, as JSON, with how to call one:

      ```tool_call
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      ```

* an assistant message's earlier tool calls are written back the same way, and tool results go in the
  next user turn as ```tool_output blocks (the template alternates user and model turns, so tool results
  and a following user message merge into one turn);
* a reply holding at least one well-formed call of a declared tool is a tool call (finish reason
  `tool_calls`); anything else is text.
All of it is message content, so `engine.text.chat_prompt` encodes it as plain text: a tool name or result that
spells a control token stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from engine.api import body
from engine.decode import SamplingParams
from engine.text.chat_prompt import IMAGE_MARK

CALL_FENCE = "```tool_call\n"
OUTPUT_FENCE = "```tool_output\n"
_CALLS = re.compile(r"```tool_call\n(.*?)\n```", re.DOTALL)
STOP, LENGTH, TOOL_CALLS = "stop", "length", "tool_calls"  # a reply's end, in the OpenAI API's words
# a model's tool call deeper or longer than a request body may be is text: it is rendered back into prompts
CALL_MAX_DEPTH, CALL_MAX_ITEMS = 64, 4096


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    @staticmethod
    def new(name: str, arguments: dict[str, Any]) -> ToolCall:
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)  # a JSON schema


@dataclass(frozen=True)
class ImagePart:
    """An image as a request sent it, decoded later off the event loop (engine.vision.images)."""

    data: str  # a data: URL (OpenAI), or base64 (Anthropic, with media_type)
    media_type: str | None = None
    caller_id: str | None = None  # the client's own id for the image (vLLM's multi_modal_uuids): its identity


@dataclass(frozen=True)
class Message:
    role: str  # system, user, assistant, tool
    content: str = ""  # with IMAGE_MARK (engine.text.chat_prompt) where each of `images` goes
    tool_calls: tuple[ToolCall, ...] = ()  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of
    images: tuple[ImagePart, ...] = ()  # user: in the order of the content's marks


def plain_text(text: str) -> str:
    """A client's text, with no image mark in it: only an image part puts one in a message."""
    return text.replace(IMAGE_MARK, "\ufffd")


@dataclass
class Prompt:
    """One API request, whichever API it came through."""

    model: str
    messages: list[Message]
    sampling: SamplingParams
    stream: bool = False
    tools: list[Tool] = field(default_factory=list)
    stream_usage: bool = False  # Chat Completions: usage as a last chunk of the stream (the others always send it)
    prefill: bool = False  # the last message is the assistant's start of the reply, which the reply continues


@dataclass
class Reply:
    """A finished reply, whichever API it goes out through."""

    text: str  # the text outside tool calls
    tool_calls: list[ToolCall]
    finish_reason: str  # STOP, LENGTH or TOOL_CALLS
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the store held
    stop_sequence: str | None = None  # the request's stop string that ended the reply, if one did
    tokens: list[int] = field(default_factory=list)  # the reply's token ids


def conversation_id(prompt: Prompt) -> str:
    """A name for the conversation a prompt continues, the same on every turn: a digest of its messages up to
    and including the first user message, which later turns repeat. The engines keep one window record per
    conversation by it (an older one is deleted once superseded). Two conversations that open alike (the same
    text and the same images' bytes) share it,
    and then only the latest of them keeps its record; the other resumes by replay or recompute, exactly."""
    opening = []
    for message in prompt.messages:
        images = [xxhash.xxh3_64_hexdigest(image.data.encode()) for image in message.images]  # as sent: not decoded
        opening.append([message.role, message.content] + [images] * bool(images))
        if message.role == "user":
            break
    return "conversation-" + xxhash.xxh3_128_hexdigest(json.dumps(opening).encode())


def chat_messages(prompt: Prompt) -> list[dict[str, Any]]:
    """The prompt as the chat template's {role, content} messages, tools and tool traffic written as text; a
    prefill's last message is marked to be continued."""
    messages = list(prompt.messages)
    if prompt.tools:
        described = describe_tools(prompt.tools)
        if messages and messages[0].role == "system":
            messages[0] = Message("system", messages[0].content + "\n\n" + described)
        else:
            messages.insert(0, Message("system", described))
    turns: list[tuple[str, list[str]]] = []  # role, its contents: joined once, so merging is linear
    for message in messages:
        # a client's text never places an image: only the image parts an API put in a message's content do
        role, content = message.role, message.content if message.images else plain_text(message.content)
        if message.role == "assistant" and message.tool_calls:
            content = "\n".join([content] * bool(content) + [_call_text(call) for call in message.tool_calls])
        elif message.role == "tool":
            role, content = "user", f"{OUTPUT_FENCE}{content}\n```"
        # tool results, then perhaps the user: one turn; and system texts one after another (instructions and
        # developer messages) one system text
        if turns and turns[-1][0] == role and role in ("user", "system"):
            turns[-1][1].append(content)
        else:
            turns.append((role, [content]))
    out: list[dict[str, Any]] = [{"role": role, "content": "\n\n".join(contents)} for role, contents in turns]
    if prompt.prefill and out[-1]["role"] == "assistant":
        out[-1]["continue"] = True  # engine.text.chat_prompt leaves its turn open
    return out


def describe_tools(tools: Sequence[Tool]) -> str:
    listed = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
                       for t in tools)
    return ("You can call these tools:\n" + listed + "\n\nTo call a tool, reply with only\n" + CALL_FENCE +
            '{"name": "<the tool\'s name>", "arguments": {<its arguments>}}\n```\n'
            "and its result comes back in a tool_output block.")


def _call_text(call: ToolCall) -> str:
    return f"{CALL_FENCE}{json.dumps({'name': call.name, 'arguments': call.arguments})}\n```"


def split_tool_calls(text: str, tools: Sequence[Tool]) -> tuple[str, list[ToolCall]]:
    """A reply's text and the tool calls in it: fenced blocks naming a declared tool with an object of
    arguments. Without one such block the whole reply is text; so is a block whose name is not a string, whose
arguments hold NaN or an infinite number, or nest deeper than CALL_MAX_DEPTH."""
    names = {tool.name for tool in tools}
    calls = []
    for block in _CALLS.finditer(text):
        try:
            call = body.loads(block.group(1))  # NaN, Infinity and 1e999 are not JSON a client could read back
        except (ValueError, RecursionError):
            continue
        # the model writes anything: a name that is a list, arguments nested past what renders safely
        if isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"] in names and \
                isinstance(call.get("arguments", {}), dict) and body.within(call, CALL_MAX_DEPTH, CALL_MAX_ITEMS):
            calls.append(ToolCall.new(call["name"], call.get("arguments", {})))
    if not calls:
        return text, []
    return text[: text.find(CALL_FENCE)].rstrip(), calls

