"""The engines behind the HTTP server: one thread owns the prefill and decode engines and steps them.

Handlers on the event loop call `generate`, which queues the request and returns at once; the engine
thread submits it between steps, and reports each token and the end through the callbacks, which it
calls on its own thread (a handler passes them on to its loop with `call_soon_threadsafe`). A request
the engine refuses (DecodeError) ends at once with that error; one whose client went away is cancelled
(`cancel`), which frees its KV at the next step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.decode import DecodeConfig, DecodeEngine, DecodeError, DecodeRequest, DecodeResult, SamplingParams
from engine.prefill import PrefillEngine, PrefillRequest


@dataclass
class Generation:
    """One request for the engine thread."""

    tokens: list[int]
    sampling: SamplingParams
    salt: str  # the tenant's namespace salt: from its API key, never from the request body
    traffic_class: str
    on_token: Callable[[int], None]
    on_done: Callable[[DecodeResult | None, str | None], None]  # (result, None) or (None, error message)
    session_id: str | None = None
    id: int | None = None  # the decode engine's, once submitted


class EngineRunner:
    def __init__(self, prefill: PrefillEngine, config: DecodeConfig = DecodeConfig()) -> None:
        self.prefill = prefill
        self.decode = DecodeEngine(prefill.model, prefill, config)
        self._inbox: queue.SimpleQueue[Generation | tuple[str, Generation] | None] = queue.SimpleQueue()
        self._callbacks: dict[int, Generation] = {}
        self.load = {"running": 0, "waiting": 0, "kv_tokens": 0}  # after the last step, for any thread to read
        self._thread = threading.Thread(target=self._run, name="engines", daemon=True)
        self._thread.start()

    def generate(self, generation: Generation) -> None:
        """Queue a generation (any thread)."""
        self._inbox.put(generation)

    def cancel(self, generation: Generation) -> None:
        """Stop a generation (any thread): its on_done gets the result so far, finish reason "cancelled"."""
        self._inbox.put(("cancel", generation))

    def close(self, timeout: float = 10.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            block = not self.decode.pending  # idle: wait for work; busy: take what came, then step
            while True:
                try:
                    generation = self._inbox.get(block=block, timeout=None)
                except queue.Empty:
                    break
                if generation is None:
                    return
                if isinstance(generation, tuple):
                    self._cancel(generation[1])
                else:
                    self._submit(generation)
                block = False
            try:
                results = self.decode.step() if self.decode.pending else []
            except Exception as exc:  # an engine fault: every request in flight ends with it, the engine goes on
                for rid, generation in list(self._callbacks.items()):
                    self.decode.cancel(rid)
                    generation.on_done(None, f"engine error: {type(exc).__name__}: {exc}")
                self._callbacks.clear()
                continue
            self.load = {"running": self.decode.running, "waiting": self.decode.waiting,
                         "kv_tokens": self.decode.kv_tokens}
            for result in results:
                generation = self._callbacks.pop(result.id, None)
                if generation is not None:
                    generation.on_done(result, None)

    def _cancel(self, generation: Generation) -> None:
        if generation.id in self._callbacks:
            self.decode.cancel(generation.id)

    def _submit(self, generation: Generation) -> None:
        request = PrefillRequest(generation.tokens, salt=generation.salt, traffic_class=generation.traffic_class,
                                 session_id=generation.session_id)
        try:
            decode = DecodeRequest(request, generation.sampling, on_token=generation.on_token)
            generation.id = self.decode.submit(decode)
        except DecodeError as exc:
            generation.on_done(None, str(exc))
            return
        self._callbacks[generation.id] = generation
