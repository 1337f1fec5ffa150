"""Host-memory tier for sliding-window state (docs/design.md section 8).

The block store persists only full-attention layers. A sliding-window layer's KV for the next token
depends on the last W tokens alone, so a resumed session needs, besides the stored prefix, the window
as of the prefix's last full block: a `WindowState`, kept here, keyed by the key of that block. It
lives only as long as sessions are active: bounded by bytes, least recently used out first, and a
session's newer state replaces its older one (the next turn never resumes from the earlier boundary).
Sessions whose turns end at the same boundary (a shared system prompt and a short first message) share
that state: it goes once the last of them has moved on, never under another session's feet.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

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
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: bytes) -> WindowState | None:
        with self._lock:
            state = self._states.get(key)
            if state is None:
                self.misses += 1
                return None
            self._states.move_to_end(key)
            self.hits += 1
            return state

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._states

    def put(self, key: bytes, state: WindowState, session_id: str | None = None) -> bool:
        """Keep a copy of `state` for the prefix ending in block `key`; False if it can never fit."""
        if state.nbytes > self.capacity_bytes:
            return False
        state = WindowState(state.position, state.rings.to("cpu", copy=True), state.window_from)  # host memory
        with self._lock:
            if session_id is not None:
                older = self._session_key.get(session_id)
                if older is not None and older != key:
                    self._leave(older, session_id)
            replaced = self._states.pop(key, None)  # the same window again: its sessions keep it
            self._bytes -= replaced.nbytes if replaced is not None else 0
            self._states[key] = state
            if session_id is not None:
                self._owners.setdefault(key, set()).add(session_id)
                self._session_key[session_id] = key
            self._bytes += state.nbytes
            while self._bytes > self.capacity_bytes:
                oldest = next(iter(self._states))
                self._drop(oldest)
                self.evictions += 1
        return True

    def _leave(self, key: bytes, session_id: str) -> None:
        """`session_id` has moved on from `key`'s state: dropped unless another session's latest state too."""
        owners = self._owners.get(key, set())
        owners.discard(session_id)
        if not owners:
            self._drop(key)

    def _drop(self, key: bytes) -> None:
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
