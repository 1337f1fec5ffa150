"""Whether the store's daemons answer, for an operator to see: serving without a cache is correct, so a store
that is gone never fails a request, and without this it would not show anywhere but in the hit rate.

`StoreState.probe` asks every daemon for its Stats (the cheapest call that proves a daemon answers this
client, its token included) and says which answered; kvstore-api probes at start-up (`report`: a line naming
the daemons that did not answer) and every `interval_s` while it serves (`watch`). A change of the store's
state (reachable, degraded: some daemons answer, unreachable: none does) is logged as a warning, at most one
line per `log_every_s`: a flapping daemon cannot flood the log, and the line after a quiet spell says how many
changes it folds in. GET /health stays 200 and says the state in its body; `missing_store` tells a prompt the
store could not be asked about (counted as the prefill path "store_unreachable", apart from a real miss).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from kvstore.client import KVClient

log = logging.getLogger("kvstore.api.store")

REACHABLE, DEGRADED, UNREACHABLE, NONE = "reachable", "degraded", "unreachable", "none"
UNKNOWN = "unknown"  # not probed yet
# The prefill path a cold prompt is counted under while no daemon answers: the store was not asked, so the
# miss says nothing about what it holds (kvstore_api_prefill_paths_total{path="store_unreachable"})
STORE_UNREACHABLE = "store_unreachable"


@dataclass(frozen=True)
class Probe:
    """One probe's answer: each daemon's name -> None where it answered, else why it did not."""

    daemons: dict[str, str | None] = field(default_factory=dict)

    @property
    def state(self) -> str:
        answered = sum(why is None for why in self.daemons.values())
        return REACHABLE if self.daemons and answered == len(self.daemons) else DEGRADED if answered else UNREACHABLE

    def line(self) -> str:
        """The daemons that answered and those that did not, with why, in one line."""
        answered = [name for name, why in self.daemons.items() if why is None]
        silent = [f"{name} ({why})" for name, why in self.daemons.items() if why is not None]
        if not self.daemons:
            return "store unreachable: no daemon known yet (the membership lists none)"
        return (f"store {self.state}: " + (f"answered: {', '.join(answered)}" if answered else "")
                + ("; " if answered and silent else "") + (f"did not answer: {', '.join(silent)}" if silent else ""))


class StoreState:
    def __init__(self, client: KVClient | None, interval_s: float = 5.0, log_every_s: float = 60.0) -> None:
        self.client, self.interval_s, self.log_every_s = client, interval_s, log_every_s
        self.last: Probe | None = None  # the latest probe's answer; None before the first
        self._logged_at = -float("inf")
        self._logged_state = REACHABLE  # what the log said last: a first probe that finds it so says nothing
        self._unlogged_changes = 0  # changes seen since the last line, not said
        self._seen_state = REACHABLE  # what the latest probe found, logged or not
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        return NONE if self.client is None else UNKNOWN if self.last is None else self.last.state

    @property
    def daemons(self) -> dict[str, str | None]:
        """Each daemon's name -> None where it answered the latest probe, else why it did not."""
        return {} if self.last is None else dict(self.last.daemons)

    def probe(self, log_change: bool = True) -> Probe:
        """Ask every daemon (blocking: off the event loop); the answer is also kept as `last`, and a change of
        the state logged (rate-limited) unless `log_change` is False: the caller says it itself."""
        if self.client is None:
            return Probe()
        stats = self.client.server_stats()
        errors = self.client.last_errors()
        found = Probe({name: None if value is not None else errors.get(name, "no answer")
                       for name, value in stats.items()})
        with self._lock:
            self.last = found
            if not log_change:  # said by the caller: the log goes on from it
                self._logged_at, self._logged_state = time.monotonic(), found.state
                self._seen_state, self._unlogged_changes = found.state, 0
        if log_change:
            self._log_change(found)
        return found

    def _log_change(self, found: Probe) -> None:
        now = time.monotonic()
        with self._lock:
            self._unlogged_changes += found.state != self._seen_state
            self._seen_state = found.state
            if found.state == self._logged_state:  # as the log says already (a flap within the interval)
                return
            if now - self._logged_at < self.log_every_s:  # said at the first probe past the interval
                return
            folded = max(self._unlogged_changes - 1, 0)  # besides the change this line says
            self._logged_at, self._logged_state, self._unlogged_changes = now, found.state, 0
        again = " again" if found.state == REACHABLE else ""
        log.warning("%s%s%s", found.line().replace("store reachable", f"store reachable{again}", 1),
                    "" if found.state == REACHABLE else "; prompts are computed without the cache meanwhile",
                    f" ({folded} earlier changes not logged)" if folded else "")

    def missing_store(self) -> bool:
        """Whether a miss now is the store's absence, not a prompt it does not hold: the last probe found no
        daemon answering, or every daemon is marked down by a call that failed since."""
        if self.client is None:
            return False
        shards = self.client.shards
        return self.state == UNREACHABLE or not any(shard.up for shard in shards.values())

    async def watch(self) -> None:
        """Probe now and then every `interval_s` until cancelled (in a thread: the client blocks)."""
        while True:
            try:
                await asyncio.to_thread(self.probe)
            except Exception as exc:  # a probe that fails is no reason to stop watching, nor to stop serving
                log.warning("probing the store failed: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(self.interval_s)
