from __future__ import annotations

import pytest
import torch

from engine.model.kv import WindowState
from engine.window.tier import WindowTier

pytestmark = pytest.mark.unit


def _state(position: int) -> WindowState:
    return WindowState(position, torch.full((1, 2, 4, 1, 2), float(position)))  # 64 bytes


def test_bounded_least_recently_used_first():
    tier = WindowTier(3 * 64)
    for key in (b"a", b"b", b"c"):
        assert tier.put(key, _state(1))
    tier.get(b"a")
    tier.put(b"d", _state(2))
    assert b"b" not in tier and b"a" in tier and tier.nbytes == 3 * 64 and tier.evictions == 1


def test_a_session_keeps_only_its_newest_state_and_copies_are_kept():
    tier = WindowTier(10 * 64)
    state = _state(16)
    tier.put(b"turn1", state, session_id="s")
    tier.put(b"turn2", _state(32), session_id="s")
    tier.put(b"other", _state(16), session_id="t")
    assert b"turn1" not in tier and len(tier) == 2
    state.rings.zero_()  # the caller's tensor is reused; the tier holds its own copy
    assert tier.get(b"other").rings.max() == 16


def test_a_replys_state_leaves_its_prompts_as_an_ordinary_state_the_next_out():
    tier = WindowTier(3 * 64)
    tier.put(b"prompt", _state(16), session_id="s")
    tier.put(b"reply", _state(32), session_id="s", keep_older=True)
    assert b"prompt" in tier and tier.get(b"prompt").position == 16  # the same prompt again resumes there
    tier.put(b"turn2", _state(48), session_id="s")  # the next turn: the reply's state goes, the prompt's is nobody's
    assert b"reply" not in tier and b"prompt" in tier
    tier.put(b"other", _state(16), session_id="t")
    tier.put(b"more", _state(16))
    assert b"prompt" not in tier and tier.evictions == 1, "an ordinary state, least recently used first out"


def test_sessions_sharing_a_boundary_share_its_state_until_the_last_moves_on():
    tier = WindowTier(10 * 64)
    tier.put(b"system", _state(16), session_id="s")
    tier.put(b"system", _state(16), session_id="t")  # t's first turn ends where s's did
    tier.put(b"t-turn2", _state(32), session_id="t")
    assert b"system" in tier, "s's latest state stays while t moves on"
    tier.put(b"s-turn2", _state(32), session_id="s")
    assert b"system" not in tier and len(tier) == 2


def test_too_large_a_state_is_refused():
    assert not WindowTier(10).put(b"a", _state(1))
    with pytest.raises(ValueError):
        WindowTier(-1)


def test_a_held_state_outlives_newer_ones_until_its_turn_reads_it():
    tier = WindowTier(4 * 64)
    tier.put(b"agent", _state(1))
    assert tier.hold(b"agent") and not tier.hold(b"absent")
    for key in (b"b", b"c", b"d", b"e", b"f"):  # traffic that would have evicted it four times over
        tier.put(key, _state(2))
    assert b"agent" in tier and tier.nbytes == 4 * 64
    assert tier.get(b"agent") is not None and tier.holds == {"held": 1, "used": 1}
    tier.put(b"g", _state(3))  # read, it is an ordinary state again: the least recent goes
    assert b"c" not in tier and b"agent" in tier


def test_holds_take_at_most_half_the_tier_and_survive_the_same_window_kept_again():
    tier = WindowTier(4 * 64)
    for key in (b"a", b"b", b"c"):
        tier.put(key, _state(1))
        tier.hold(key)
    assert tier.holds["held"] == 3 and b"a" in tier  # the oldest hold was let go, not the state
    for key in (b"x", b"y"):
        tier.put(key, _state(2))
    assert b"a" not in tier and b"b" in tier and b"c" in tier  # a, no longer held, went first
    tier.put(b"b", _state(5))  # the same prefix's window again (another session's turn ended there): still held
    for key in (b"p", b"q"):
        tier.put(key, _state(6))
    assert b"b" in tier and b"c" in tier and tier.holds["wasted"] == 0 and tier.nbytes <= 4 * 64


def test_a_held_state_its_session_moved_on_from_is_wasted():
    tier = WindowTier(4 * 64)
    tier.put(b"turn1", _state(1), session_id="s")
    tier.hold(b"turn1")
    tier.put(b"turn2", _state(2), session_id="s")  # the next turn was served elsewhere, and a later one here
    assert b"turn1" not in tier and tier.holds == {"held": 1, "wasted": 1}
