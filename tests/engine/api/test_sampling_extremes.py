"""Sampling values at the edges of their documented ranges, on all three APIs, beside another tenant's reply in
flight: each gets its reply, and the victim's stream finishes (one tenant's request once failed every request in
the engine: a top_p below float32's smallest subnormal emptied the draw's distribution)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.engine.api.conftest import needs_server
from tests.waiting import wait_for

pytestmark = needs_server
MODEL = "gemma-3-270m"
USER = [{"role": "user", "content": "Name a colour."}]
TINY_TOP_P = (5e-324, 1e-300, 7e-46, 1.4e-45, 1 - 2**-53)
EXTREMES: list[tuple[str, dict]] = [
    *(("/v1/chat/completions", {"temperature": 1, "top_p": p}) for p in TINY_TOP_P),
    *(("/v1/chat/completions", {"temperature": t, "top_p": 1e-300}) for t in (5e-324, 1e-300, 2)),
    *(("/v1/chat/completions", {"temperature": 1, "seed": s}) for s in (2**64 - 1, -1, -(2**63), 2**63 - 1)),
    *(("/v1/responses", {"temperature": 1, "top_p": p}) for p in TINY_TOP_P),
    ("/v1/responses", {"temperature": 5e-324, "top_p": 1e-300}),
    *(("/v1/messages", {"temperature": 1, "top_p": p}) for p in TINY_TOP_P),
    *(("/v1/messages", {"temperature": 1, "top_k": k, "top_p": 5e-324}) for k in (1, 2**31, 2**64, 10**30)),
    ("/v1/messages", {"temperature": 5e-324, "top_k": 2**62}),
]
# temperature 2: a near-flat draw, so no early end of turn, and about a step a token. The victim is in flight when
# the hostile requests are sent; it must still be when their replies are in, which a loaded machine can make it lose
# (27 HTTP requests tokenized and prefilled against its steps): a round it loses is run again with a victim twice
# as long, so the overlap is required and a slow machine costs a round, not a failure.
VICTIM_TOKENS = (300, 600, 1200)


def _body(path: str, fields: dict) -> dict:
    if path == "/v1/responses":
        return {"model": MODEL, "input": USER, "max_output_tokens": 3, "store": False, **fields}
    return {"model": MODEL, "messages": USER, "max_tokens": 3, **fields}


def _post(url: str, path: str, fields: dict) -> httpx.Response:
    headers = {"Authorization": "Bearer key-bob", "Content-Type": "application/json"}
    return httpx.post(url + path, content=json.dumps(_body(path, fields)).encode(), headers=headers, timeout=300)


def test_sampling_extremes_on_every_api_get_replies_and_another_tenants_stream_finishes(served):
    for victim_tokens in VICTIM_TOKENS:
        if _round(served, victim_tokens):
            return
    raise AssertionError(f"the victim finished before the hostile replies were in, in every round ({VICTIM_TOKENS})")


def _round(served, victim_tokens: int) -> bool:
    """Send every extreme beside a victim's stream: each gets its reply and the victim's stream runs to its length
    without an error. Whether the victim was still streaming once every hostile reply was in."""
    victim_done, chunks = threading.Event(), []

    def victim() -> None:
        with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=600,
                          headers={"Authorization": "Bearer key-alice"},
                          json={"model": MODEL, "messages": USER, "max_tokens": victim_tokens, "temperature": 2,
                                "seed": 7, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        victim_done.set()

    with ThreadPoolExecutor(len(EXTREMES) + 1) as pool:
        streaming = pool.submit(victim)
        wait_for(lambda: len(chunks) > 1 or streaming.done(), "the victim's first chunks", timeout_s=120)
        assert not streaming.done(), streaming.exception()
        replies = list(pool.map(lambda case: _post(served.url, *case), EXTREMES))
        for (path, fields), reply in zip(EXTREMES, replies):
            assert reply.status_code == 200, (path, fields, reply.text[:300])
        overlapped = not victim_done.is_set()
        streaming.result(600)
    assert all("error" not in chunk for chunk in chunks)
    (finish,) = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == "length"  # it ran to its max_tokens
    wait_for(lambda: served.service.runner.load["running"] == 0, "the runner idle again", timeout_s=120)
    return overlapped
