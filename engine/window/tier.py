"""Host-memory tier for sliding-window state (docs/design.md section 8).

The block store persists only full-attention layers. A sliding-window layer's KV for the next token
depends on the last W tokens alone, so a resumed session needs, besides the stored prefix, the window
as of the prefix's last full block: a `WindowState`, kept here, keyed by the key of that block. It
lives only as long as sessions are active: bounded by bytes, least recently used out first, and a
session's newer state replaces its older one (the next turn never resumes from the earlier boundary),
except that a reply's state leaves its prompt's in place as an ordinary state, the next out: the same prompt
sent again (a retried or regenerated reply) resumes from it in this process.
Sessions whose turns end at the same boundary (a shared system prompt and a short first message) share
that state: it goes once the last of them has moved on, never under another session's feet.

A session whose next turn is known to be coming (its reply ended in a tool call) has its state held
(`hold`): passed over by eviction until that turn reads it. Held states take at most half the tier (the
oldest hold is let go first: an ordinary state again), and `holds` counts them: held, used (read by
their turn), wasted (dropped unread, its session having moved on). The same prefix's window kept again
stays held.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

from engine.model.kv import WindowState


class WindowTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("the window tier's capacity must be >= 0 bytes")
        self.capacity_bytes = capacity_bytes
        self._states: OrderedDict[bytes, WindowState] = OrderedDict()  # prefix key -> state, oldest first
        self._session_key: dict[str, bytes] = {}  # session -> its latest state's key
        self._owners: dict[bytes, set[str]] = {}  # key -> the sessions whose latest state it is
        self._bytes = 0
        self._held: OrderedDict[bytes, None] = OrderedDict()  # keys held for a turn known to be coming, oldest first
        self._held_bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0
        self.holds: Counter[str] = Counter()  # held, used, wasted

    def get(self, key: bytes) -> WindowState | None:
        with self._lock:
            state = self._states.get(key)
            if state is None:
                self.misses += 1
                return None
            self._states.move_to_end(key)
            self.hits += 1
            if self._release(key):
                self.holds["used"] += 1
            return state

    def hold(self, key: bytes) -> bool:
        """Keep the state of `key` from eviction until it is next read (its turn); whether the tier has it."""
        with self._lock:
            state = self._states.get(key)
            if state is None:
                return False
            if key not in self._held:
                self._held[key] = None
                self._held_bytes += state.nbytes
                self.holds["held"] += 1
            while self._held_bytes > self.capacity_bytes // 2:  # the oldest hold is let go: an ordinary state again
                self._release(next(iter(self._held)))
            return key in self._held

    def _release(self, key: bytes) -> bool:
        """Let go of `key`'s hold (called holding the lock); whether it was held."""
        if key not in self._held:
            return False
        del self._held[key]
        self._held_bytes -= self._states[key].nbytes
        return True

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._states

    def put(self, key: bytes, state: WindowState, session_id: str | None = None, keep_older: bool = False) -> bool:
        """Keep a copy of `state` for the prefix ending in block `key`; False if it can never fit. With
        `keep_older`, the session's older state stays, as an ordinary one (least recently used out first)
        rather than dropped: a reply's state keeps its prompt's, for the same prompt sent again."""
        if state.nbytes > self.capacity_bytes:
            return False
        state = WindowState(state.position, state.rings.to("cpu", copy=True), state.window_from)  # host memory
        with self._lock:
            if session_id is not None:
                older = self._session_key.get(session_id)
                if older is not None and older != key:
                    self._leave(older, session_id, drop=not keep_older)
            replaced = self._states.pop(key, None)  # the same window again: its sessions (and a hold) keep it
            self._bytes -= replaced.nbytes if replaced is not None else 0
            self._states[key] = state
            if session_id is not None:
                self._owners.setdefault(key, set()).add(session_id)
                self._session_key[session_id] = key
            self._bytes += state.nbytes
            while self._bytes > self.capacity_bytes:  # the oldest state neither held nor this one
                victim = next((k for k in self._states if k not in self._held and k != key), None)
                if victim is None:  # only holds are left besides it: the oldest is let go
                    self._release(next(iter(self._held)))
                    continue
                self._drop(victim)
                self.evictions += 1
        return True

    def _leave(self, key: bytes, session_id: str, drop: bool = True) -> None:
        """`session_id` has moved on from `key`'s state: dropped unless another session's latest state too, or
        with `drop` False kept as an ordinary state, evicted least recently used first."""
        owners = self._owners.get(key, set())
        owners.discard(session_id)
        if not owners:
            self._owners.pop(key, None)
            if drop:
                self._drop(key)

    def _drop(self, key: bytes) -> None:
        if self._release(key):
            self.holds["wasted"] += 1
        state = self._states.pop(key, None)
        if state is not None:
            self._bytes -= state.nbytes
        for session in self._owners.pop(key, ()):
            if self._session_key.get(session) == key:
                del self._session_key[session]

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._states)
