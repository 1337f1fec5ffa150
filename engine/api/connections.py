"""What one client may hold of the HTTP server's connections (docs/api.md, "Limits").

uvicorn, left alone, keeps a fresh connection open for as long as its client sends half a header, takes
any number of connections, and lets a stream nobody reads hold its engine slot forever: 600 sockets that
sent half a header under `ulimit -n 512` made /health fail for everyone. `guarded(limits)` is uvicorn's
h11 protocol with the bounds of ApiConfig:

* `max_connections` in all, and `max_connections_per_client` from one client address, refused by
  closing before a byte is read;
* a request head must arrive whole within `header_timeout_s` of the connection or of the last response
  (a keep-alive connection between requests ends sooner, at uvicorn's keep-alive timeout);
* a response the client does not take (its socket's buffer full) for `write_timeout_s` ends the
  connection, so that the request is cancelled and its engine slot and KV pages freed.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.api.config import ApiConfig


def guarded(limits: ApiConfig) -> type[H11Protocol]:
    """An H11Protocol class for uvicorn's `http=` that keeps to the limits of `limits` (one per server)."""
    open_from: Counter[str] = Counter()

    class Guarded(H11Protocol):
        _admitted = False
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            self._peer = str(peer[0]) if peer else "?"
            if (open_from.total() >= limits.max_connections
                    or open_from[self._peer] >= limits.max_connections_per_client):
                transport.abort()  # before a byte is read: a refusal that costs nothing
                return
            self._admitted = True
            open_from[self._peer] += 1
            super().connection_made(transport)
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if not self._admitted:
                return
            self._admitted = False
            open_from[self._peer] -= 1
            if open_from[self._peer] <= 0:
                del open_from[self._peer]
            self._cancel_timers()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete and self._header_timer is not None:
                self._header_timer.cancel()  # a request's head arrived whole
                self._header_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_head()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(limits.write_timeout_s, self._close)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _await_head(self) -> None:
            if self._header_timer is None and not self.transport.is_closing():
                # Cancelled once the next request's head is in; a keep-alive idle ends sooner (uvicorn's).
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self._close()

        def _close(self) -> None:
            self._write_timer = None
            if not self.transport.is_closing():
                self.transport.abort()  # aborted: close() would wait for the unread buffer to drain

        def _cancel_timers(self) -> None:
            for timer in (self._header_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            self._header_timer = self._write_timer = None

    return Guarded
