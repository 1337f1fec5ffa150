"""SPS(B) profiled on a real (tiny, random-weight) model: cached and reused, and non-increasing in B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.checkpoints.random_model import write_random_model
from engine.model.decoder import Decoder
from engine.speculative.profile import SpsProfile, format_profile, layout, load_or_measure

TINY = {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}
GRID = (1, 4, 16, 48)


@pytest.fixture(scope="module")
def tiny_decoder(tmp_path_factory) -> Decoder:
    path = tmp_path_factory.mktemp("tiny-model")
    write_random_model(path, TINY)
    return Decoder.from_pretrained(path)


def test_the_profile_is_cached_and_reused(tiny_decoder: Decoder, tmp_path: Path) -> None:
    profile, measured = load_or_measure(tiny_decoder, tmp_path, GRID, context=32, repeats=2)
    assert measured
    (cached,) = tmp_path.glob("sps-*.json")
    written = cached.read_text()
    assert json.loads(written)["key"]["torch"]
    again, measured_again = load_or_measure(tiny_decoder, tmp_path, GRID, context=32, repeats=2)
    assert not measured_again and again == profile
    assert cached.read_text() == written  # read, not measured and rewritten
    # another measurement's key (here: another context) is measured on its own, beside the first
    _, other = load_or_measure(tiny_decoder, tmp_path, GRID, context=64, repeats=1)
    assert other and len(list(tmp_path.glob("sps-*.json"))) == 2
    # a damaged file is measured again, not trusted
    cached.write_text("{not json")
    _, remeasured = load_or_measure(tiny_decoder, tmp_path, GRID, context=32, repeats=1)
    assert remeasured


def test_sps_is_non_increasing_in_b(tiny_decoder: Decoder, tmp_path: Path) -> None:
    profile, _ = load_or_measure(tiny_decoder, tmp_path, GRID, context=32, repeats=2)
    assert profile.tokens == GRID
    values = [profile.sps(b) for b in range(1, 200)]  # through the interpolation and past the last B
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert all(v > 0 for v in values)
    table = format_profile(profile)
    assert len(table.splitlines()) == len(GRID) + 1


def test_the_fit_irons_out_a_noisy_sample() -> None:
    # B = 4 timed faster than B = 2 (noise): pooled with it, so the times never fall with B
    profile = SpsProfile.fitted([(1, 0.010), (2, 0.020), (4, 0.016), (8, 0.040)])
    assert profile.seconds == pytest.approx((0.010, 0.018, 0.018, 0.040))
    assert profile.step_seconds(16) == pytest.approx(0.040 + 8 * (0.040 - 0.018) / 4)
    assert SpsProfile.from_dict(profile.to_dict()) == profile
    with pytest.raises(ValueError):
        SpsProfile((1, 2), (0.02, 0.01))


def test_layout_spreads_b_over_verification_chunks() -> None:
    assert layout(1, 6) == [1]
    assert layout(12, 6) == [6, 6]
    assert layout(13, 6) == [5, 4, 4]
    assert all(sum(layout(b, 6)) == b and max(layout(b, 6)) <= 6 for b in range(1, 200))


def test_a_b_timed_slower_than_a_larger_b_is_timed_again(tiny_decoder: Decoder, monkeypatch) -> None:
    # B = 1's timed forwards stall for 1 s (another process took the core): without timing it again the
    # fit would pool it with every larger B, at >= 0.25 s each, and flatten the small-B end. The forwards run,
    # but the clock measure() reads is this test's: each forward takes 1 ms a token, plus the stalls, so that
    # what is asserted does not depend on how fast this machine is or what else it runs.
    from engine.speculative import profile as profile_module
    from engine.speculative.profile import measure

    forward, calls = tiny_decoder.forward, []

    class Clock:
        now = 0.0

        def perf_counter(self) -> float:
            return self.now

    clock = Clock()

    def stalled(chunks, *args, **kwargs):
        calls.append(sum(len(c.tokens) for c in chunks))
        clock.now += 0.001 * calls[-1]
        if len(calls) - 1 in (len(GRID), 2 * len(GRID)):  # after every B's warm-up: B = 1 in both timed rounds
            clock.now += 1.0
        return forward(chunks, *args, **kwargs)

    monkeypatch.setattr(tiny_decoder, "forward", stalled)
    monkeypatch.setattr(profile_module, "time", clock)
    profile = measure(tiny_decoder, GRID, context=32, repeats=2)
    rounds = list(GRID) * 3  # warm-up, then two rounds over the grid, each B once a round
    assert calls[:len(rounds)] == [sum(layout(b, 6)) for b in rounds] and calls.count(1) > 3  # timed again
    assert profile.seconds[0] < 0.2 and profile.seconds[0] <= profile.seconds[1]


def test_observed_forwards_correct_the_profile_where_they_fall_and_lend_to_stretches_not_seen() -> None:
    from engine.speculative.profile import ObservedSps

    profile = SpsProfile((1, 8, 32, 64), (0.1, 0.15, 0.25, 0.3))
    observed = ObservedSps(profile, weight=0.5)
    assert observed.step_seconds(20) == profile.step_seconds(20)  # nothing seen: the profile
    observed.observe(20, 1.5 * profile.step_seconds(20))  # a forward of 20 tokens, 1.5x the profile
    assert observed.step_seconds(30) == pytest.approx(1.5 * profile.step_seconds(30))  # the same stretch (8, 32]
    assert observed.step_seconds(50) == pytest.approx(1.5 * profile.step_seconds(50))  # borrowed: nearest seen
    observed.observe(50, 2.0 * profile.step_seconds(50))
    assert observed.step_seconds(50) == pytest.approx(2.0 * profile.step_seconds(50))  # its own now
    assert observed.step_seconds(30) == pytest.approx(1.5 * profile.step_seconds(30))
    observed.observe(20, 1.0 * profile.step_seconds(20))  # an average: half way back
    assert observed.step_seconds(20) == pytest.approx(1.25 * profile.step_seconds(20))
    assert observed.sps(20) == pytest.approx(1 / observed.step_seconds(20))
    for bad in (0.0, float("nan"), float("inf"), -1.0):
        observed.observe(20, bad)  # ignored
    assert observed.step_seconds(20) == pytest.approx(1.25 * profile.step_seconds(20))
    with pytest.raises(ValueError):
        ObservedSps(profile, weight=0)


def test_a_speculating_engine_times_its_forwards_into_its_sps(tiny_decoder: Decoder) -> None:
    from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
    from engine.speculative.profile import ObservedSps

    observed = ObservedSps(SpsProfile((1, 8, 64), (1e-3, 2e-3, 5e-3)))
    engine = DecodeEngine(tiny_decoder, None, DecodeConfig(kv_pages=64, sps=observed))
    engine.submit(DecodeRequest([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=12)))
    engine.run()
    assert observed.ratios and all(ratio > 0 for ratio in observed.ratios.values())
