"""The token bucket (pace.py) the scrub and Verify's meter share, on an injected clock."""

import pytest

from kvstore.server.pace import TokenBucket

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_time_saves_up_at_most_the_burst():
    clock = Clock()
    bucket = TokenBucket(rate_per_s=10, burst=20, clock=clock)
    clock.now += 3600  # an hour idle: still only the burst
    assert bucket.try_spend(20) and not bucket.try_spend(1)
    assert bucket.wait_s() == 0
    bucket.spend(5)
    assert bucket.wait_s() == 0.5
    clock.now += 0.5
    assert bucket.wait_s() == 0 and not bucket.try_spend(1), "paid back, nothing left over"
    assert not bucket.full
    clock.now += 2
    assert bucket.full


def test_a_clock_that_steps_back_refills_nothing_and_drains_nothing():
    clock = Clock()
    bucket = TokenBucket(rate_per_s=10, burst=10, clock=clock)
    bucket.spend(10)
    clock.now -= 50
    assert bucket.wait_s() == 0 and not bucket.try_spend(1), "a step back drains nothing, refills nothing"
    clock.now += 0.5  # half a second after the reading it stepped back to
    assert bucket.try_spend(5) and not bucket.try_spend(1)


def test_a_rate_must_be_positive():
    with pytest.raises(ValueError, match="positive rate"):
        TokenBucket(rate_per_s=0, burst=0, clock=Clock())
