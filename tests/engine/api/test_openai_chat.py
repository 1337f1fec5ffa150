"""The HTTP server through the official `openai` client, on the real Gemma 3 270M: replies, streaming with
usage, the API's errors with their status codes, tenants from API keys."""

from __future__ import annotations

import pytest

from tests.engine.api.conftest import needs_server

pytestmark = needs_server
QUESTION = [{"role": "user", "content": "What does len() return? <end_of_turn>"}]
ASSISTANT = {"role": "assistant", "content": "It returns the number of items."}


def test_a_reply_is_the_engines_greedy_reply_with_usage(served):
    from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
    from engine.text.chat_prompt import encode_chat

    runner, tokenizer = served.service.runner, served.tokenizer
    reply = served.openai().chat.completions.create(model="gemma-3-270m", messages=QUESTION, max_tokens=8,
                                                     temperature=0)
    ids = encode_chat(tokenizer, QUESTION)
    # without speculation: the served reply (speculative) must be the plain greedy one; nor is a profile measured
    engine = DecodeEngine(runner.prefill.model, None, DecodeConfig(kv_pages=16, speculative=False))
    engine.submit(DecodeRequest(ids, SamplingParams(max_tokens=8)))
    (expected,) = engine.run()
    assert reply.choices[0].message.content == tokenizer.decode(expected.tokens)
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 8)


def test_a_stream_gives_the_same_text_and_its_usage(served):
    client = served.openai()
    whole = client.chat.completions.create(model="gemma-3-270m", messages=QUESTION, max_tokens=10, temperature=0)
    parts, usage = [], None
    for chunk in client.chat.completions.create(model="gemma-3-270m", messages=QUESTION, max_tokens=10,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        parts += [choice.delta.content or "" for choice in chunk.choices]
    assert "".join(parts) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 10


def test_a_speculative_stream_gives_the_text_of_decoding_without_speculation(served):
    """The served engine speculates (the default); a prompt that repeats itself gets drafts accepted, and
    the streamed text is the greedy reply of an engine that does not speculate.

    How many drafts a step verifies follows the SPS profile, measured on this machine under whatever load the
    test run puts on it: a profile that makes a wider forward look dear drafts nothing, and the test failed
    that way. For this request the engine's SPS is flat (a wider forward costs nothing), so that it drafts
    whenever its drafter proposes; which drafts are accepted is still the model's greedy choice."""
    from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
    from engine.text.chat_prompt import encode_chat

    runner, tokenizer = served.service.runner, served.tokenizer
    assert runner.engine.config.speculative
    line = "for item in items: total += item.price * item.count"
    messages = [{"role": "user", "content": f"Repeat this line three times:\n{line}\n{line}\n{line}"}]
    accepted_before = _metric(served, "kvstore_api_draft_tokens_total", outcome="accepted")
    parts = []
    profiled, runner.engine._sps = runner.engine._sps, lambda b: 100.0  # the engine reads it at each step
    try:
        for chunk in served.openai().chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=32,
                                                             temperature=0, stream=True):
            parts += [choice.delta.content or "" for choice in chunk.choices]
    finally:
        runner.engine._sps = profiled
    assert _metric(served, "kvstore_api_draft_tokens_total", outcome="accepted") > accepted_before, \
        (f"no draft accepted; {_metric(served, 'kvstore_api_draft_tokens_total', outcome='rejected')} rejected "
         f"in all; the schedule's SPS profile: {runner.engine._sps}")
    plain = DecodeEngine(runner.prefill.model, None, DecodeConfig(kv_pages=16, speculative=False))
    plain.submit(DecodeRequest(encode_chat(tokenizer, messages), SamplingParams(max_tokens=32)))
    (expected,) = plain.run()
    assert "".join(parts) == tokenizer.decode(expected.tokens)


def _metric(served, name: str, **labels: str) -> float:
    """The operator's scrape of one counter, summed over tenants."""
    from prometheus_client.parser import text_string_to_metric_families

    text = served.service.metrics.exposition(None).decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def test_seeded_sampling_is_reproducible(served):
    client = served.openai()
    replies = [client.chat.completions.create(model="gemma-3-270m", messages=QUESTION, max_tokens=8, temperature=0.9,
                                              top_p=0.95, seed=11).choices[0].message.content for _ in range(2)]
    assert replies[0] == replies[1]


def test_errors_are_the_apis_with_their_status_codes(served):
    import httpx
    import openai

    client = served.openai()
    cases = [
        (openai.NotFoundError, dict(model="gpt-9", messages=QUESTION)),
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=[])),
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=QUESTION, temperature=5)),
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=QUESTION, frequency_penalty=1.0)),
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=QUESTION, max_tokens=10**6)),  # past the context
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=QUESTION + [ASSISTANT] * 2)),  # the template
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=QUESTION, tools=[{"type": "web_search"}])),
        (openai.BadRequestError, dict(model="gemma-3-270m", messages=QUESTION + [{"role": "tool", "content": "x"}])),
    ]
    for error, request in cases:
        with pytest.raises(error):
            client.chat.completions.create(**request)
    with pytest.raises(openai.AuthenticationError):
        served.openai("key-mallory").chat.completions.create(model="gemma-3-270m", messages=QUESTION, max_tokens=2)
    raw = httpx.post(served.url + "/v1/chat/completions", content=b"{not json",
                     headers={"Authorization": "Bearer key-bob", "Content-Type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert served.openai("key-bob").models.list().data[0].id == "gemma-3-270m"


def test_a_tenant_reuses_its_own_cached_prefix_and_never_anothers(served):
    from engine.text.real_text import system_prompt

    # several 256-token blocks, led by a line of this test's own: Alice's first request is cold whichever of the
    # worker's tests sent the system prompt before
    own = "This conversation tests that a tenant's cached prefix is its own.\n"
    messages = [{"role": "system", "content": own + system_prompt()}, *QUESTION]
    cached = {}
    for key in ("key-alice", "key-alice", "key-bob", "key-bob"):
        reply = served.openai(key).chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=2,
                                                              temperature=0)
        served.service.runner.prefill.flush(30)  # the blocks are saved behind the reply: stored before the next request
        cached.setdefault(key, []).append(reply.usage.prompt_tokens_details.cached_tokens)
    prompt = reply.usage.prompt_tokens
    assert prompt > 512
    assert cached["key-alice"][0] == 0 and cached["key-alice"][1] >= prompt // 256 * 256 - 256
    assert cached["key-bob"][0] == 0, "bob hit alice's blocks"
    assert cached["key-bob"][1] == cached["key-alice"][1]
