"""The serving loop: one thread owns the engines and steps them; any thread submits, cancels and reads the load.

    serving = ServingLoop(model, prefill_engine_or_None, DecodeConfig(...))
    ticket = serving.submit(DecodeRequest(prompt, SamplingParams(...), on_token=...), on_done, principal)
    serving.cancel(ticket)          # on_done then gets the result so far, finish reason "cancelled"
    serving.load                    # at once, never waiting for a step
    serving.close()                 # what is in flight ends "cancelled"; the thread stops

The engines are not thread-safe, so one thread does all engine work. Between two steps it takes what
has arrived in its inbox (at most DRAIN_PER_STEP messages, so a flood of them cannot starve decoding),
steps while anything is pending, and blocks on the inbox only when idle. Cancels have a queue of their
own, taken before each message of the inbox: a cancel never waits behind submits, and a request cancelled
before the engine thread took it ends at once without reaching the engine. Callbacks run on that thread
and must not block: a front end passes them on to its own thread (an event loop's
`call_soon_threadsafe`). One that raises is logged and the engine goes on.

The requests held at once (submitted and not ended: running or queued) may be bounded, in all
(`max_calls`) and for each principal (`max_calls_per_principal`, whom the front end names at submit): a
submit past either raises ServingBusy at once, and nothing is queued for it.

`on_done(result, None)` ends a request with its DecodeResult; `on_done(None, error)` with a DecodeError
(the engine refused the request at submit) or an EngineFault: the engine failed on this request alone
(its sampling or drafting raised; the others go on), or a step raised, and then every request in flight
ends so, their KV freed, and `on_fault` is called (the loop itself serves on).

The load is published by the engine thread after every batch of messages and every step, and read by
any thread with the requests submitted but not yet taken by the engine thread added (`Load`), so a
router sees a request it placed a moment ago at once. The engine thread blocks SIGTERM and SIGINT (as do
the threads it starts, torch's included): a process signal then wakes the main thread, whose handler
shuts the process down, rather than a thread that would only set a flag for it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from engine.decode import DecodeConfig, DecodeEngine, DecodeError, DecodeRequest, DecodeResult
from engine.decode.request import CANCELLED
from engine.model.decoder import Decoder
from engine.prefill import PrefillEngine, PrefillRequest, PrefillResult

log = logging.getLogger(__name__)

DRAIN_PER_STEP = 256  # inbox messages taken between two steps

OnDone = Callable[[DecodeResult | None, Exception | None], None]


class Load(TypedDict):
    running: int  # sequences fed each step
    waiting: int  # not admitted yet: queued, prefilling, preempted, or submitted and not yet taken
    kv_tokens: int  # tokens held in the running sequences' KV, as of the last step
    queued_tokens: int  # the waiting requests' prompt tokens (exact unless some were preempted)
    kv_capacity: int  # pages x block tokens


class EngineFault(RuntimeError):
    """A step raised: an engine bug or a state it cannot go on from, not a bad request."""


class ServingClosed(RuntimeError):
    """The loop was closed: it takes no more requests."""


class ServingBusy(RuntimeError):
    """The loop holds as many requests as it may, in all or of this principal: refused, nothing queued."""


@dataclass(eq=False)
class Ticket:
    """A request handed to the loop: what `cancel` takes."""

    request: DecodeRequest
    on_done: OnDone
    prompt_tokens: int
    principal: str = ""  # whose share of max_calls_per_principal it holds
    id: int | None = None  # the engine's, once submitted (engine thread)
    ended: bool = False  # its on_done was called (engine thread)


ERROR_TEXT = 1000  # characters of an exception's text a request's own error carries at most
_STOP = object()
_WAKE = object()  # in the inbox after a cancel: an idle engine thread wakes to take it


class ServingLoop:
    def __init__(self, model: Decoder, prefill: PrefillEngine | None = None, config: DecodeConfig = DecodeConfig(),
                 on_fault: Callable[[Exception], None] | None = None, name: str = "engine",
                 max_calls: int | None = None, max_calls_per_principal: int | None = None) -> None:
        """A DecodeEngine on `model` (continuing what `prefill` prefills, in its page pool, where given) and
        the thread that serves it, started here. `max_calls`, `max_calls_per_principal`: the requests held at
        once, in all and of one principal (None: unbounded)."""
        for bound in (max_calls, max_calls_per_principal):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
                raise ValueError(f"ServingLoop: max_calls and max_calls_per_principal must be integers >= 1 or "
                                 f"None, got {bound!r}")
        self.max_calls, self.max_calls_per_principal = max_calls, max_calls_per_principal
        self.prefill = prefill
        self.engine = DecodeEngine(model, prefill, config)
        self.context = model.config.max_position_embeddings
        self._on_fault = on_fault
        # SimpleQueue: its put is reentrant, so a signal handler may submit or cancel while a put is under way
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue = queue.SimpleQueue()  # tickets to cancel, taken before the inbox's
        self._tickets: dict[int, Ticket] = {}  # engine id -> ticket, of requests in flight (engine thread)
        self._order: list[int] = []  # their engine ids in submit order: the newest are the waiting ones
        self._lock = threading.Lock()  # guards what follows, between the engine thread and the others
        self._closed = False
        self._held: Counter[str] = Counter()  # requests submitted and not ended, by principal
        self._published = {"running": 0, "waiting": 0, "kv_tokens": 0, "queued_tokens": 0}
        self._unsubmitted = [0, 0]  # requests submitted and not in the published state yet: count, prompt tokens
        self._taken = [0, 0]  # of them, those the engine thread took since its last publish (engine thread)
        self._capacity = self.engine.pool.num_pages * self.engine.pool.block_tokens
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------------

    def submit(self, request: DecodeRequest, on_done: OnDone, principal: str = "") -> Ticket:
        """Queue a request of `principal` (whose share of max_calls_per_principal it takes); its ticket.
        ServingClosed once the loop is closed; ServingBusy past max_calls or max_calls_per_principal."""
        if request.on_token is not None:
            request = dataclasses.replace(request, on_token=_guarded(request.on_token))
        ticket = Ticket(request, on_done, prompt_tokens(request), principal)
        with self._lock:  # a request is queued before the stop or refused, never lost behind it
            if self._closed:
                raise ServingClosed("the engine is shutting down")
            if (refusal := self._refusal(principal)) is not None:
                raise ServingBusy(refusal)
            self._held[principal] += 1
            self._unsubmitted[0] += 1
            self._unsubmitted[1] += ticket.prompt_tokens
            self._inbox.put(ticket)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request and free its KV; its on_done gets the result so far, "cancelled" (if not done yet).
        Taken before any submit still queued: a flood of submits never delays it."""
        self._cancels.put(ticket)
        self._inbox.put(_WAKE)

    @property
    def held(self) -> int:
        """Requests submitted and not ended (running or queued): what max_calls bounds."""
        with self._lock:
            return sum(self._held.values())

    def _refusal(self, principal: str) -> str | None:
        """Why a request of `principal` may not be queued now (under the lock); None if it may."""
        if self.max_calls is not None and sum(self._held.values()) >= self.max_calls:
            return (f"the engine holds {self.max_calls} requests already (max_calls), running or queued; "
                    "retry later")
        if self.max_calls_per_principal is not None and self._held[principal] >= self.max_calls_per_principal:
            return (f"this caller holds {self.max_calls_per_principal} requests already (max_calls_per_principal), "
                    "running or queued; let some end, or retry later")
        return None

    @property
    def load(self) -> Load:
        """As of the engine's last step, plus the requests submitted since."""
        with self._lock:
            state, (requests, tokens) = self._published, self._unsubmitted
            return Load(running=state["running"], waiting=state["waiting"] + requests, kv_tokens=state["kv_tokens"],
                        queued_tokens=state["queued_tokens"] + tokens, kv_capacity=self._capacity)

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel every request in flight or queued (each gets its on_done), then stop the engine thread."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._inbox.put(_STOP)
        self._thread.join(timeout_s)

    # -- the engine thread ----------------------------------------------------------------------------

    def _serve(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        while True:
            item = self._inbox.get() if not self.engine.pending else self._poll()
            handled = 0
            while item is not None:
                self._take_cancels()  # before every message: a cancel never waits behind the submits queued
                if item is _STOP:
                    self._stop()
                    return
                if isinstance(item, Ticket):
                    self._handle(item)
                handled += 1
                item = self._poll() if handled < DRAIN_PER_STEP else None
            self._publish()
            if self.engine.pending:
                self._step()
                self._publish()

    def _poll(self) -> Ticket | object | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _take_cancels(self) -> None:
        while True:
            try:
                ticket = self._cancels.get_nowait()
            except queue.Empty:
                return
            if ticket.id is None:  # still in the inbox: it ends now, and its submit is skipped when taken
                self._end(ticket, self._cancelled(ticket), None)
            elif ticket.id in self._tickets:
                self.engine.cancel(ticket.id)  # its result comes with the next step's

    def _handle(self, ticket: Ticket) -> None:
        self._taken[0] += 1  # off the unsubmitted count only when the next published state includes it
        self._taken[1] += ticket.prompt_tokens
        if ticket.ended:  # cancelled before it was taken
            return
        try:
            ticket.id = self.engine.submit(ticket.request)
        except DecodeError as exc:
            self._end(ticket, None, exc)
            return
        except Exception as exc:  # not a refusal: a bug, which ends this request alone
            log.error("the engine failed to take a request", exc_info=exc)
            self._end(ticket, None, EngineFault(f"engine error: {type(exc).__name__}: {exc}"[:ERROR_TEXT]))
            return
        self._tickets[ticket.id] = ticket
        self._order.append(ticket.id)

    def _end(self, ticket: Ticket, result: DecodeResult | None, error: Exception | None) -> None:
        """Hand a request its end, once, and give back its place under the bounds."""
        if ticket.ended:
            return
        ticket.ended = True
        with self._lock:
            self._held[ticket.principal] -= 1
            if self._held[ticket.principal] <= 0:
                del self._held[ticket.principal]
        _call(ticket.on_done, result, error)

    @staticmethod
    def _cancelled(ticket: Ticket) -> DecodeResult:
        """The result of a request cancelled before it reached the engine: no tokens."""
        return DecodeResult(-1, ticket.request, [], CANCELLED, ticket.prompt_tokens, [])

    def _step(self) -> None:
        try:
            results = self.engine.step()
        except Exception as exc:
            self._fault(exc)
            return
        for result in results:
            self._finished(result)

    def _finished(self, result: DecodeResult) -> None:
        ticket = self._tickets.pop(result.id, None)
        if ticket is None:
            return  # ended already, by a fault
        self._order.remove(result.id)
        if result.error is not None:  # the engine failed on this request alone; the others went on
            self._end(ticket, None, EngineFault(f"engine error: {result.error}"))
        else:
            self._end(ticket, result, None)

    def _fault(self, exc: Exception) -> None:
        """A step raised: every request in flight ends with the fault, and its KV is freed."""
        log.error("the engine failed a step; every request in flight ends with the fault", exc_info=exc)
        # the step held every tenant's request, so its text (which may quote one of them) stays in the log
        fault = EngineFault(f"engine error: a step failed ({type(exc).__name__}); the instance's log has it")
        tickets, self._tickets, self._order = list(self._tickets.values()), {}, []
        for ticket in tickets:
            try:
                if ticket.id is not None:
                    self.engine.cancel(ticket.id)
            except Exception:
                log.exception("cancelling request %s after the fault failed too", ticket.id)
            self._end(ticket, None, fault)
        if self._on_fault is not None:
            _call(self._on_fault, fault)

    def _publish(self) -> None:
        """The state `load` reports, as of now."""
        engine = self.engine
        # the newest `waiting` requests are those not admitted yet (admission is first come, first served)
        waiting = self._order[len(self._order) - engine.waiting:] if engine.waiting else []
        state = {"running": engine.running, "waiting": engine.waiting, "kv_tokens": engine.kv_tokens,
                 "queued_tokens": sum(self._tickets[i].prompt_tokens for i in waiting if i in self._tickets)}
        with self._lock:  # one swap: a reader never sees a request in neither count nor in both
            self._published = state
            self._unsubmitted = [self._unsubmitted[0] - self._taken[0], self._unsubmitted[1] - self._taken[1]]
        self._taken = [0, 0]

    def _stop(self) -> None:
        """End what is still queued as cancelled without submitting it (nothing comes after the stop), cancel
        everything in flight, hand each its cancelled result, and stop the engine's own workers."""
        self._take_cancels()
        while (item := self._poll()) is not None:
            if isinstance(item, Ticket):
                self._taken[0] += 1
                self._taken[1] += item.prompt_tokens
                self._end(item, self._cancelled(item), None)
        for rid in list(self._tickets):
            self.engine.cancel(rid)
        if self._tickets:
            self._step()  # nothing runs now: the step hands back the cancelled
        self._publish()
        self.engine.close()


def prompt_tokens(request: DecodeRequest) -> int:
    prompt = request.prompt
    if isinstance(prompt, PrefillResult):
        return prompt.prompt_tokens
    return len(prompt.tokens if isinstance(prompt, PrefillRequest) else prompt)


def _call(callback: Callable, *args) -> None:
    try:
        callback(*args)
    except Exception:
        log.exception("a serving callback raised; the engine goes on")


def _guarded(on_token: Callable[[int], None]) -> Callable[[int], None]:
    """`on_token` as the engine calls it inside its step, where a raise would fail every request."""
    return lambda token: _call(on_token, token)
