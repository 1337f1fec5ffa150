"""Load or recompute: is reading a cached prefix faster than computing it again?

Not always (SGLang #26305: an 8K-token prompt took 1.7 s to recompute and 2.45 s from a file
backend). The client keeps a moving average of the bandwidth each source delivered (its host tier,
each daemon); the engine says what computing a token range costs. For a hit of n blocks the client
picks the number of blocks k to load that minimises the estimated time to the end of prefill:

    pipelined:  max(load(k), compute(k·T, total))     (layers load while earlier layers compute)
    serial:     load(k) + compute(k·T, total)

where load(k) sums each block's bytes over its source's bandwidth and compute(a, b) is the engine's
estimate for computing tokens [a, b) with [0, a) cached.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

DEFAULT_BYTES_PER_S = {"host": 10e9, "daemon": 1e9}  # until measured


class BandwidthMeter:
    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._rates: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, source: str, nbytes: int, seconds: float) -> None:
        """A transfer of `nbytes` from `source` took `seconds` (ignored when too small to mean anything)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            previous = self._rates.get(source)
            self._rates[source] = rate if previous is None else (1 - self.alpha) * previous + self.alpha * rate

    def bytes_per_s(self, source: str) -> float:
        with self._lock:
            if source in self._rates:
                return self._rates[source]
        return DEFAULT_BYTES_PER_S["host" if source == "host" else "daemon"]


def blocks_worth_loading(sources: Sequence[str], block_bytes: int, block_tokens: int, total_tokens: int,
                         compute_s: Callable[[int, int], float], meter: BandwidthMeter,
                         pipelined: bool = True) -> int:
    """How many of the leading cached blocks (held by `sources`, in prefix order) to load."""
    best_blocks, best_time = 0, compute_s(0, total_tokens)
    load_s = 0.0
    for k, source in enumerate(sources, start=1):
        load_s += block_bytes / meter.bytes_per_s(source)
        rest = compute_s(min(k * block_tokens, total_tokens), total_tokens)
        estimate = max(load_s, rest) if pipelined else load_s + rest
        if estimate < best_time:
            best_blocks, best_time = k, estimate
    return best_blocks
