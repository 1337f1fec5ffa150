"""A client that goes away before its first token: the request was cancelled only
when its prefill ended (about 20 s for a 3k-token prompt), its first token already sampled. Now the
server watches the client while the request is queued, waits for its fair share and prefills."""

from __future__ import annotations

import httpx
import pytest

from tests.engine.api.conftest import needs_server
from tests.engine.api.test_server import MODEL, _sample
from tests.waiting import wait_for

pytestmark = needs_server


def test_a_stream_whose_client_leaves_during_its_prefill_is_cancelled_before_a_token(served):
    headers = {"Authorization": "Bearer key-alice"}
    metrics = lambda: httpx.get(served.url + "/metrics", headers=headers).text  # noqa: E731
    before = metrics()
    cancelled = _sample(before, "kvstore_api_cancelled_total")
    first_tokens = _sample(before, "kvstore_api_time_to_first_token_seconds_count")
    words = " ".join(f"item{i} is a long, careful note about streams that nobody reads" for i in range(300))
    with pytest.raises(httpx.TimeoutException):  # about 3k tokens: seconds of prefill; the client waits 1.5 s
        with httpx.stream("POST", served.url + "/v1/chat/completions", headers=headers, timeout=1.5,
                          json={"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 8,
                                "stream": True}) as response:
            next(response.iter_lines())
    wait_for(lambda: _sample(metrics(), "kvstore_api_cancelled_total") == cancelled + 1,
             "the stream whose client left counted as cancelled")
    assert _sample(metrics(), "kvstore_api_time_to_first_token_seconds_count") == first_tokens, \
        "the request ran to its first token after its client had gone"
    # a liveness bound, not a speed claim: the prefill chunk in flight when the client left ends first (on a
    # loaded 2-core machine a chunk of the real model can take longer than the 20 s default)
    wait_for(lambda: served.service.runner.load["running"] == 0 and served.service.runner.load["waiting"] == 0,
             "the runner idle again", timeout_s=120)
