"""Nothing waits on the store on the engine's thread: with the daemon paused (SIGSTOP), the sequences already
decoding go on to the end of their replies while a request that resumes from the store waits for it, and once
the daemon runs again that request resumes exactly (its prefix and its window from the store)."""

from __future__ import annotations

import signal
import threading
from collections import Counter

import pytest

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
from engine.prefill.request import CACHED, PrefillRequest
from kvstore.client import ClientConfig, KVClient
from tests.engine.decode.test_reply_saving import _decode
from tests.engine.prefill.test_engine import _client, _engine, _tokens

pytestmark = pytest.mark.integration
# Longer than the test takes: a call the engine thread made to the paused daemon would hold every step this
# long, rather than fail fast and let the request fall back to computing from scratch
PATIENT_S = 120.0
REPLY = 40


class CallThreads:
    """The real client, noting the thread of every call that waits on a daemon."""

    WAITING = frozenset({"lookup", "present", "get", "put", "touch", "delete", "advise"})

    def __init__(self, client: KVClient) -> None:
        self.client = client
        self.threads: Counter[str] = Counter()

    def __getattr__(self, name: str):
        attribute = getattr(self.client, name)
        if name not in self.WAITING:
            return attribute

        def noted(*args, **kwargs):
            self.threads[threading.current_thread().name] += 1
            return attribute(*args, **kwargs)
        return noted


def test_a_paused_daemon_holds_up_only_the_request_that_needs_it(families, tiny_models, daemons):
    tiny, family = tiny_models["gpt_oss"], families["gpt_oss"]
    (daemon,) = daemons(1)
    prompt, more = _tokens(150, seed=51), _tokens(20, seed=52)
    with _client(daemon) as first_client:  # the first turn, served elsewhere: its blocks and window record stored
        first = _engine(tiny, first_client)
        (done,) = _decode(first, [first.prefill(PrefillRequest(prompt, session_id="s"))], 40)
    next_turn = prompt + done.tokens + more
    patient = ClientConfig(servers=(daemon.address,), timeout_s=PATIENT_S, lookup_timeout_s=PATIENT_S)
    with KVClient(patient) as real:
        client = CallThreads(real)
        # a token a step (no drafts), so that none of the 8 ends before the last of them runs
        decode = DecodeEngine(family.model, _engine(tiny, client), DecodeConfig(speculative=False))
        running = [decode.submit(DecodeRequest(PrefillRequest(_tokens(40, seed=60 + i)),
                                               SamplingParams(max_tokens=REPLY))) for i in range(8)]
        results = {}
        while decode.waiting:  # their lookups answered, their prompts prefilled
            results.update((r.id, r) for r in decode.step())
        assert decode.running == 8 and not results
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            resumed = decode.submit(DecodeRequest(PrefillRequest(next_turn, session_id="s", turn=1),
                                                  SamplingParams(max_tokens=8)))
            while not all(i in results for i in running):
                results.update((r.id, r) for r in decode.step())
            assert resumed not in results and decode.waiting == 1  # its lookups wait on the paused daemon
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        while decode.pending:
            results.update((r.id, r) for r in decode.step())
        assert real.write_behind.flush(PATIENT_S)
    assert all(len(results[i].tokens) == REPLY for i in running)
    second = results[resumed]
    assert (second.prefill_path, second.window_source) == (CACHED, "store")  # exact, from the daemon
    assert second.tokens == family.generate(next_turn, 8)
    assert threading.current_thread().name not in client.threads  # every call that waited, off this thread
    assert client.threads["prefill-lookups_0"] >= 2  # the prefix's lookup and the window record's get
