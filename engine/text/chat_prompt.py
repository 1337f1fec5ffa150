"""Chat messages to prompt token ids where only the chat template places special tokens.

A tokenizer turns the text `<start_of_turn>` into its control token wherever it appears, so a user who
writes it into a message (or a tool result, or a system prompt) could forge turns. Here the template is
rendered with each message's content replaced by a sentinel, the template's own text between sentinels
is encoded with special tokens recognised, and each content with them split into plain text
(`split_special_tokens`). Each piece is encoded alone, so a conversation's next prompt extends its last
one token for token (what the store's prefix cache needs), and for text without control strings the ids
are what `apply_chat_template(tokenize=True)` gives (tested on the real model's tokenizer).

    ids = encode_chat(tokenizer, [{"role": "system", "content": ...}, {"role": "user", "content": ...}])
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

_SENTINEL = "\ue000{}\ue001"  # Unicode private-use characters: no template writes them
_SENTINELS = re.compile("\ue000(\\d+)\ue001")
ROLES = ("system", "user", "assistant")


class ChatPromptError(ValueError):
    """Messages the chat template cannot render: the caller answers with a 400."""


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids: the template's special tokens, every message's text as plain text."""
    contents = _checked(messages)
    trim = _template_trims(tokenizer)
    stand_ins = [{"role": m["role"], "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    try:
        rendered = tokenizer.apply_chat_template(stand_ins, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # the template's own refusals (e.g. roles that do not alternate) raise from Jinja
        raise ChatPromptError(f"the chat template refuses these messages: {exc}") from None
    pieces = _SENTINELS.split(rendered)  # template text, index, template text, index, ...
    order = [int(i) for i in pieces[1::2]]
    if order != list(range(len(messages))):
        raise ChatPromptError(f"the chat template placed the messages' contents as {order}, not once each in order")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            ids += _encode(tokenizer, piece, split_special=False)  # the template's: its control tokens
        else:
            content = contents[int(piece)]
            ids += _encode(tokenizer, content.strip() if trim else content, split_special=True)
    return ids


def _checked(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ChatPromptError("messages must be a non-empty list of {role, content} objects")
    contents = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
            raise ChatPromptError(f"message {i} must have exactly the fields role and content")
        if message["role"] not in ROLES:
            raise ChatPromptError(f"message {i}: role must be one of {ROLES}, got {message['role']!r}")
        if not isinstance(message["content"], str):
            raise ChatPromptError(f"message {i}: content must be a string")
        contents.append(message["content"])
    return contents


def _template_trims(tokenizer: Any) -> bool:
    """Whether the template strips a message's surrounding whitespace (Gemma's `| trim`): the same must be
    done to the content encoded in its place."""
    probe = tokenizer.apply_chat_template([{"role": "user", "content": " " + _SENTINEL.format(0) + " "}],
                                          tokenize=False, add_generation_prompt=False)
    return " " + _SENTINEL.format(0) + " " not in probe


def _encode(tokenizer: Any, text: str, split_special: bool) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"])
