"""The serving loop in process, on a tiny random model: what it hands back, its load, refusals, faults, close."""

from __future__ import annotations

import queue
import signal
import threading

import pytest

from engine.decode import DecodeConfig, DecodeEngine, DecodeError, DecodeRequest, SamplingParams
from engine.model.decoder import Decoder
from engine.model.kv import RequestKV
from engine.serving.loop import EngineFault, ServingClosed, ServingLoop
from tests.engine.serving.conftest import BLOCK, PAGES, VOCAB, idle, tokens
from tests.waiting import wait_for

pytestmark = pytest.mark.unit
CONFIG = DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK, max_running=8)


@pytest.fixture(scope="module")
def model(model_dir) -> Decoder:
    return Decoder.from_pretrained(model_dir)


@pytest.fixture
def serving(model):
    loop = ServingLoop(model, None, CONFIG)
    yield loop
    loop.close()


class Ends:
    """on_done callbacks that record each request's end, and the thread it ran on."""

    def __init__(self) -> None:
        self.ended: queue.Queue = queue.Queue()

    def callback(self, name: str):
        def on_done(result, error) -> None:
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # blocks nothing more: reads the mask
            self.ended.put((name, result, error, threading.current_thread(), blocked))
        return on_done

    def next(self):
        return self.ended.get(timeout=30)


def test_the_loop_decodes_as_the_engine_does_and_streams_each_token(serving, model):
    cases = [(tokens(37, 1), SamplingParams(max_tokens=24)),
             (tokens(300, 2), SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=7)),
             (tokens(5, 3), SamplingParams(max_tokens=40, stop_token_ids=(7, 9)))]
    engine = DecodeEngine(model, None, CONFIG)
    ids = [engine.submit(DecodeRequest(prompt, params)) for prompt, params in cases]
    expected = {r.id: r for r in engine.run()}
    ends, streamed = Ends(), {n: [] for n in range(len(cases))}
    for n, (prompt, params) in enumerate(cases):
        serving.submit(DecodeRequest(prompt, params, on_token=streamed[n].append), ends.callback(n))
    for _ in cases:
        n, result, error, thread, blocked = ends.next()
        assert error is None
        assert result.tokens == expected[ids[n]].tokens and result.finish_reason == expected[ids[n]].finish_reason
        assert streamed[n] == result.tokens  # every token went to on_token before the end
        # callbacks run on the engine thread, which leaves process signals to the main thread
        assert thread is not threading.main_thread() and {signal.SIGTERM, signal.SIGINT} <= blocked
    assert idle(lambda: serving.load)["kv_capacity"] == PAGES * BLOCK


def test_load_counts_a_request_at_once_and_its_kv_once_computed_and_a_cancel_frees_it(serving):
    ends = Ends()
    ticket = serving.submit(DecodeRequest(tokens(300, 4), SamplingParams(max_tokens=4000)), ends.callback("long"))
    load = serving.load  # whether or not the engine thread has taken it yet
    assert load["running"] + load["waiting"] == 1 and load["kv_tokens"] + load["queued_tokens"] >= 300
    load = wait_for(lambda: (now := serving.load)["running"] == 1 and now["kv_tokens"] >= 300 and now, "its KV")
    assert load["waiting"] == 0 and load["queued_tokens"] == 0 and load["kv_tokens"] <= 300 + 4000
    serving.cancel(ticket)
    _, result, error, _, _ = ends.next()
    assert error is None and result.finish_reason == "cancelled" and len(result.tokens) < 4000
    idle(lambda: serving.load)


def test_a_refused_request_and_a_callback_that_raises_end_alone_and_the_next_is_served(serving):
    ends = Ends()
    serving.submit(DecodeRequest([VOCAB], SamplingParams(max_tokens=2)), ends.callback("outside"))
    _, result, error, _, _ = ends.next()
    assert result is None and isinstance(error, DecodeError) and "vocabulary" in str(error)

    def broken(token: int) -> None:
        raise RuntimeError("a front end's bug")

    serving.submit(DecodeRequest(tokens(8), SamplingParams(max_tokens=3), on_token=broken), ends.callback("broken"))
    serving.submit(DecodeRequest(tokens(9), SamplingParams(max_tokens=5)), ends.callback("next"))
    finished = {name: result for name, result, _, _, _ in (ends.next(), ends.next())}
    assert len(finished["broken"].tokens) == 3 and len(finished["next"].tokens) == 5


def test_a_fault_ends_every_request_in_flight_and_the_loop_serves_on(model):
    """The engine's pages are held outside it, so nothing can run and its step raises KVCapacityError."""
    faults: queue.Queue = queue.Queue()
    serving = ServingLoop(model, None, DecodeConfig(kv_pages=8, block_tokens=BLOCK), on_fault=faults.put)
    try:
        held = RequestKV(model.config, serving.engine.pool)
        held.reserve(8 * BLOCK)  # the engine thread is idle: nothing else touches the pool now
        ends = Ends()
        serving.submit(DecodeRequest(tokens(20), SamplingParams(max_tokens=4)), ends.callback("starved"))
        _, result, error, _, _ = ends.next()
        assert result is None and isinstance(error, EngineFault) and "KVCapacityError" in str(error)
        # the step held every tenant's request, and its text may quote any of them: that stays in the log
        assert "free KV pages" not in str(error)
        assert faults.get(timeout=30) is not None
        assert idle(lambda: serving.load)["waiting"] == 0  # its KV and its place were given up
        held.release()
        serving.submit(DecodeRequest(tokens(20), SamplingParams(max_tokens=4)), ends.callback("after"))
        _, result, error, _, _ = ends.next()
        assert error is None and len(result.tokens) == 4
    finally:
        serving.close()


def test_close_cancels_what_is_in_flight_and_queued_and_takes_no_more(model):
    serving = ServingLoop(model, None, CONFIG)
    ends = Ends()
    serving.submit(DecodeRequest(tokens(16, 5), SamplingParams(max_tokens=5000)), ends.callback(0))
    wait_for(lambda: serving.load["running"] == 1, "the first request to run")
    for n in (1, 2):  # queued: perhaps not even taken by the engine thread when the loop closes
        serving.submit(DecodeRequest(tokens(16, n), SamplingParams(max_tokens=5000)), ends.callback(n))
    serving.close()
    ended = sorted((ends.next() for _ in range(3)), key=lambda end: end[0])
    assert [(name, result.finish_reason, error) for name, result, error, _, _ in ended] == \
        [(0, "cancelled", None), (1, "cancelled", None), (2, "cancelled", None)]
    assert ends.ended.empty()  # each ended once
    with pytest.raises(ServingClosed):
        serving.submit(DecodeRequest(tokens(4), SamplingParams(max_tokens=2)), ends.callback("late"))
    assert serving.load["kv_tokens"] == 0 and serving.load["waiting"] == 0
