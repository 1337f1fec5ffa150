"""A token bucket: work measured in units (bytes, blocks) allowed at a rate on average, with a bounded
amount saved up while idle. The scrub keeps its pace with one (nothing saved up: it waits out each read's
cost); Verify passes over the checks a principal has no tokens left for (verify_meter.py).

The clock is injected (any clock in seconds; one that steps back refills nothing, it never drains).
"""

from __future__ import annotations

from collections.abc import Callable


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float]) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"a token bucket needs a positive rate, got {rate_per_s}")
        self.rate_per_s = rate_per_s
        self.burst = burst  # the most units saved up while idle
        self.clock = clock
        self._level = burst  # may go below 0: work admitted past the tokens is paid back before more is
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self._level = min(self.burst, self._level + max(0.0, now - self._at) * self.rate_per_s)
        self._at = now

    def spend(self, units: float) -> None:
        """`units` of work were done (whether or not there were tokens for them)."""
        self._refill()
        self._level -= units

    def wait_s(self) -> float:
        """How long until the work done so far is paid for; 0 if it is."""
        self._refill()
        return max(0.0, -self._level / self.rate_per_s)

    def try_spend(self, units: float) -> bool:
        """Spend `units` if any token is left (a piece of work larger than the bucket still fits in a full one,
        and its excess is paid back before the next); whether they were spent."""
        self._refill()
        if self._level <= 0:
            return False
        self._level -= units
        return True

    @property
    def full(self) -> bool:
        """Whether it holds all it can save up: a fresh bucket would act the same."""
        self._refill()
        return self._level >= self.burst
