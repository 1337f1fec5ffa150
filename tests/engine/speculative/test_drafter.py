"""The n-gram drafter: proposes what followed an earlier occurrence, nothing without one, bounded memory."""

from __future__ import annotations

import random

import pytest

from engine.speculative.drafter import NGramDrafter, NGramIndex


def drafter_on(tokens: list[int], **kwargs) -> NGramDrafter:
    drafter = NGramDrafter(**kwargs)
    drafter.extend(tokens)
    return drafter


def test_repeated_text_proposes_its_continuation() -> None:
    phrase = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    history = [1, 2, 3] + phrase + [4, 5] + phrase[:3]  # the phrase starts again
    drafts = drafter_on(history).propose()
    assert [d.token for d in drafts] == phrase[3:8]  # the five tokens that followed 11 12 13 last time
    assert all(d.match >= 1 for d in drafts)


def test_most_recent_occurrence_of_the_longest_suffix_wins() -> None:
    # "7 8" was followed by 1 long ago and by 2 more recently; "6 7 8" (longer) was followed by 3
    history = [6, 7, 8, 3, 3, 3, 9, 7, 8, 1, 9, 7, 8, 2, 9, 6, 7, 8]
    assert drafter_on(history).propose()[0].token == 3
    history_short = [5, 7, 8, 1, 5, 7, 8, 2, 9, 4, 7, 8]  # no 3-gram match: the latest "7 8" -> 2
    assert drafter_on(history_short).propose()[0].token == 2


def test_text_without_repeats_proposes_nothing() -> None:
    assert drafter_on(list(range(100, 400))).propose() == []
    assert drafter_on([]).propose() == []


def test_a_short_period_is_continued_through_the_drafts() -> None:
    drafts = drafter_on([5, 1, 2, 1, 2, 1, 2]).propose()
    assert [d.token for d in drafts] == [1, 2, 1, 2, 1]


def test_limit_and_gamma_bound_the_drafts() -> None:
    history = list(range(20)) * 2
    assert len(drafter_on(history).propose()) == 5
    assert len(drafter_on(history).propose(limit=2)) == 2
    assert len(drafter_on(history, gamma=3).propose()) == 3
    assert drafter_on(history).propose(limit=0) == []


def test_confidence_rises_with_consistent_repeats_and_falls_with_conflicting_ones() -> None:
    once = drafter_on([1, 2, 3, 4, 9, 1, 2, 3]).propose()[0]
    often = drafter_on([1, 2, 3, 4, 9] * 6 + [1, 2, 3]).propose()[0]
    assert once.token == often.token == 4
    assert often.confidence > once.confidence
    # the longest context is the 4-gram 9 1 2 3: seen 5 times with a successor (the first 1 2 3 has no 9)
    assert (often.match, often.context_count, often.follow_count) == (4, 5, 5)
    # the same context followed by different tokens: the drafted one (the latest) is less certain
    conflicting = drafter_on([1, 2, 3, 5, 9, 1, 2, 3, 6, 9, 1, 2, 3, 7, 9, 1, 2, 3, 4, 9, 1, 2, 3]).propose()[0]
    assert conflicting.token == 4
    assert conflicting.confidence < often.confidence
    assert conflicting.follow_count < conflicting.context_count


def test_deterministic() -> None:
    rng = random.Random(3)
    history = [rng.randrange(8) for _ in range(500)]
    assert drafter_on(history).propose() == drafter_on(history).propose()


def test_incremental_updates_match_a_fresh_index() -> None:
    rng = random.Random(5)
    history = [rng.randrange(6) for _ in range(300)]
    grown = NGramDrafter(window=64)
    for i, token in enumerate(history):
        grown.extend([token])
        if i % 37 == 0:
            assert grown.propose() == drafter_on(history[: i + 1], window=64).propose()


def test_memory_and_counts_stay_bounded_on_a_long_history() -> None:
    window, max_n = 256, 4
    rng = random.Random(7)
    index = NGramIndex(max_n, window)
    peak = 0
    for _ in range(20 * window):
        index.append(rng.randrange(50))  # mostly unseen n-grams: the worst case for the dictionaries
        peak = max(peak, index.entries)
    assert peak <= 3 * window * max_n
    assert len(index._tokens) <= window + max_n + 1
    # the counts are over the window only: a token seen only before it is forgotten
    for token in range(1000, 1010):
        index.append(token)
    for _ in range(window + max_n):
        index.append(rng.randrange(50))
    assert index.counts((1000,), 1001) == (0, 0) and index.continuation((1000,)) is None


def test_forgotten_context_no_longer_drafts() -> None:
    drafter = NGramDrafter(window=32)
    drafter.extend([900, 901, 902, 903])
    drafter.extend(range(40))  # pushes the first phrase out of the window
    drafter.extend([900, 901])
    assert drafter.propose() == []


@pytest.mark.parametrize("bad", [dict(max_n=0), dict(window=3, max_n=4)])
def test_bad_index_arguments(bad: dict) -> None:
    with pytest.raises(ValueError):
        NGramIndex(**bad)
