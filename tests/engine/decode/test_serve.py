"""Decode instances as real processes on loopback (engine.decode.serve, engine.decode.instances), and the
router placing on them by the loads they report."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

from engine.checkpoints.random_model import write_random_model
from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
from engine.decode.instances import InstanceClient, InstanceError, InstanceStartError, start_instances, to_instance_load
from engine.decode.router import KV_AWARE, LEAST_REQUESTS, Router, RouterConfig
from engine.model.decoder import Decoder

pytestmark = pytest.mark.integration

VOCAB, CONTEXT, PAGES, BLOCK = 512, 8192, 128, 64
MAX_LINE = 65_536  # small, so the over-long line of a test is cheap to send
MODEL = {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
         "max_position_embeddings": CONTEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}
OPTIONS = dict(kv_pages=PAGES, block_tokens=BLOCK, max_running=8, max_line_bytes=MAX_LINE)


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wait_for(condition, what: str, timeout_s: float = 30.0):
    """Poll until condition() is truthy (its value); a deadline against hangs, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return value


def idle(client: InstanceClient) -> dict:
    return wait_for(lambda: (l := client.load())["running"] + l["waiting"] == 0 and l["kv_tokens"] == 0 and l,
                    "the instance to be idle")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "model"
    write_random_model(path, MODEL)
    return path


@pytest.fixture(scope="module")
def pair(model_dir):
    with start_instances(model_dir, 2, **OPTIONS) as instances:
        yield instances
        codes = instances.stop()
    assert codes == [0, 0]  # SIGTERM shut both down cleanly


def test_an_instance_decodes_as_the_engine_does_in_process(pair, model_dir):
    engine = DecodeEngine(Decoder.from_pretrained(model_dir), None,
                          DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK, max_running=8))
    cases = [(tokens(37, 1), SamplingParams(max_tokens=24)),
             (tokens(300, 2), SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=7)),
             (tokens(5, 3), SamplingParams(max_tokens=40, stop_token_ids=(7, 9)))]
    ids = [engine.submit(DecodeRequest(prompt, params)) for prompt, params in cases]
    results = {r.id: r for r in engine.run()}
    client = pair[0].client
    futures = [client.generate(prompt, params.max_tokens, temperature=params.temperature, top_k=params.top_k,
                               top_p=params.top_p, seed=params.seed, stop_token_ids=list(params.stop_token_ids))
               for prompt, params in cases]
    for (prompt, _), future, want in zip(cases, futures, [results[i] for i in ids]):
        got = future.result(30)
        assert got["tokens"] == want.tokens
        assert got["finish_reason"] == want.finish_reason
        assert got["prompt_tokens"] == len(prompt)
        assert len(got["token_times_s"]) == len(got["tokens"])
        assert got["token_times_s"] == sorted(got["token_times_s"])


def _lines(sock: socket.socket, until_id) -> list[dict]:
    """Replies read from a raw connection up to the "done" of `until_id`."""
    stream, out = sock.makefile("rb"), []
    while True:
        line = stream.readline()
        assert line, "the instance closed the connection"
        out.append(json.loads(line))
        if out[-1]["op"] == "done" and out[-1]["id"] == until_id:
            return out


def test_bad_lines_and_requests_get_errors_and_the_next_request_is_served(pair):
    bad = [
        (b"this is not json", None, "not a JSON line"),
        (b"[1, 2, 3]", None, "JSON object"),
        (b"{\xff}", None, "not a JSON line"),
        (b'{"op": "fly"}', None, "unknown op"),
        (b"x" * (MAX_LINE + 10), None, "longer than"),
        (json.dumps({"op": "generate", "id": True, "prompt": [1], "max_tokens": 2}).encode(), None, "id must be"),
        (json.dumps({"op": "generate", "id": "a", "prompt": "12", "max_tokens": 2}).encode(), "a", "list of integer"),
        (json.dumps({"op": "generate", "id": "b", "prompt": [1, True], "max_tokens": 2}).encode(), "b",
         "list of integer"),
        (json.dumps({"op": "generate", "id": "c", "prompt": [1]}).encode(), "c", "max_tokens is required"),
        (json.dumps({"op": "generate", "id": "d", "prompt": [1], "max_tokens": 0}).encode(), "d", "max_tokens must"),
        (json.dumps({"op": "generate", "id": "e", "prompt": [1], "max_tokens": 2, "stop": ["x"]}).encode(), "e",
         "stop strings"),
        (json.dumps({"op": "generate", "id": "f", "prompt": [1], "max_tokens": 2, "top_p": 2}).encode(), "f", "top_p"),
        (json.dumps({"op": "generate", "id": "i", "prompt": [1] * CONTEXT, "max_tokens": 2}).encode(), "i",
         "leaves no room"),  # refused as it is read: a prompt past the context never queues
        # refused by DecodeEngine.submit itself: outside the vocabulary, past the context
        (json.dumps({"op": "generate", "id": "g", "prompt": [VOCAB], "max_tokens": 2}).encode(), "g", "vocabulary"),
        (json.dumps({"op": "generate", "id": "h", "prompt": [1] * 8000, "max_tokens": 500}).encode(), "h", "context"),
        (json.dumps({"op": "cancel", "id": "nobody"}).encode(), "nobody", "no request"),
    ]
    good = {"op": "generate", "id": 99, "prompt": tokens(12), "max_tokens": 6}
    with socket.create_connection(("127.0.0.1", pair[0].port), timeout=30) as sock:
        sock.sendall(b"\n".join(line for line, _, _ in bad) + b"\n" + json.dumps(good).encode() + b"\n")
        replies = _lines(sock, 99)
    errors = [r for r in replies if r["op"] == "error"]
    assert len(errors) == len(bad)
    # one each, in line order: the reader answers the lines it refuses as it reads them, the engine thread
    # the last three (it refuses them in turn, after all the reader's)
    for (_, rid, text), error in zip(bad, errors):
        assert error["id"] == rid and text in error["message"], (error, text)
    assert len(replies[-1]["tokens"]) == 6 and replies[-1]["finish_reason"] == "max_tokens"


def test_a_client_that_never_reads_its_replies_is_dropped_and_others_are_served(pair):
    """Loads asked for and never read: once its socket buffers and its bounded outbox are full, the
    instance ends that connection instead of growing its memory."""
    with socket.create_connection(("127.0.0.1", pair[1].port), timeout=30) as flood:
        flood.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        line = b'{"op":"load"}\n'
        try:
            for _ in range(100):
                flood.sendall(line * 2000)  # 200,000 loads, ~3 MB
        except OSError:
            pass  # dropped while still sending: what is asserted below
        flood.settimeout(60)
        replies = 0
        try:
            while data := flood.recv(1 << 16):  # what was sent before the drop, then the end
                replies += data.count(b"\n")
        except ConnectionResetError:
            pass  # reset: also an end (a timeout is not, and fails the test)
        assert replies < 200_000  # the instance stopped answering it, rather than queue every reply
        done = pair[1].client.generate(tokens(10, seed=3), 4).result(60)
        assert len(done["tokens"]) == 4


def test_an_id_in_flight_is_refused_twice_and_a_request_can_be_cancelled(pair):
    client = pair[1].client
    idle(client)
    with socket.create_connection(("127.0.0.1", pair[1].port), timeout=30) as sock:
        long = {"op": "generate", "id": "long", "prompt": tokens(8), "max_tokens": 5000}
        sock.sendall((json.dumps(long) + "\n" + json.dumps(long) + "\n").encode())
        stream = sock.makefile("rb")
        assert json.loads(stream.readline()) == {"op": "error", "id": "long",
                                                 "message": "id 'long' is already in flight on this connection"}
        sock.sendall(b'{"op": "cancel", "id": "long"}\n')
        done = json.loads(stream.readline())
    assert done["op"] == "done" and done["id"] == "long" and done["finish_reason"] == "cancelled"
    assert len(done["tokens"]) < 5000
    idle(client)  # its KV was released


def test_load_reports_a_request_at_once_and_its_kv_once_computed(pair):
    client = pair[1].client
    assert idle(client)["kv_capacity"] == PAGES * BLOCK
    future = client.generate(tokens(300, 4), 4000)
    try:
        # before any step: the instance counts the request it has received, and its prompt as queued KV
        load = client.load()
        assert load["running"] + load["waiting"] == 1
        assert load["kv_tokens"] + load["queued_tokens"] >= 300
        load = wait_for(lambda: (l := client.load())["running"] == 1 and l["kv_tokens"] >= 300 and l,
                        "the prompt's KV")
        assert load["waiting"] == 0 and load["queued_tokens"] == 0
        assert load["kv_tokens"] <= 300 + 4000
    finally:
        client.cancel(future.request_id)
    assert future.result(30)["finish_reason"] == "cancelled"
    idle(client)


def test_kv_aware_places_on_the_instance_with_less_kv_where_least_requests_would_not(pair):
    a, b = pair[0].client, pair[1].client
    idle(a), idle(b)
    held = [a.generate(tokens(5000, 5), 3000)]  # one long sequence: 5,000 of the 8,192 KV tokens
    try:
        wait_for(lambda: a.load()["kv_tokens"] >= 5000, "the long prompt's KV")
        held += [b.generate(tokens(4, 6), 3000), b.generate(tokens(4, 7), 3000)]  # two short ones
        loads = [to_instance_load(c.load()) for c in (a, b)]
        assert (loads[0].running, loads[1].running) == (1, 2)
        assert loads[0].kv_tokens >= 5000 and loads[1].kv_tokens < 1000
        # 0.5 * 1/2 + 0.5 * 5,100/8,192 for the first against 0.5 * 2/2 + 0.5 * ~100/8,192 for the second
        chosen = Router(RouterConfig(policy=KV_AWARE)).place(loads, 100)
        assert chosen == 1
        assert Router(RouterConfig(policy=LEAST_REQUESTS)).place(loads, 100) == 0
        reply = (a, b)[chosen].generate(tokens(100, 8), 5).result(30)
        assert len(reply["tokens"]) == 5
    finally:
        for client, future in zip((a, b, b), held):
            client.cancel(future.request_id)
    assert {f.result(30)["finish_reason"] for f in held} == {"cancelled"}


def test_sigterm_stdin_end_and_the_shutdown_op_each_cancel_what_is_in_flight_and_exit_cleanly(model_dir):
    with start_instances(model_dir, 3, **OPTIONS) as instances:
        futures = [i.client.generate(tokens(16, n), 5000) for n, i in enumerate(instances)]
        for instance in instances:
            wait_for(lambda: instance.client.load()["running"] == 1, "the request to run")
        instances[0].process.terminate()
        instances[1].process.stdin.close()  # what the parent's death looks like to the child
        instances[2].client.shutdown()
        for future in futures:
            assert future.result(30)["finish_reason"] == "cancelled"
        assert [i.process.wait(30) for i in instances] == [0, 0, 0]
        with pytest.raises(InstanceError):  # the connection has ended
            instances[2].client.load(timeout_s=10)


def test_an_instance_that_cannot_start_is_reported_with_its_stderr(tmp_path):
    with pytest.raises(InstanceStartError, match="model must be a model directory"):
        start_instances(tmp_path / "no-model", 1, ready_timeout_s=60)


def test_an_instance_with_a_store_continues_a_handed_over_prompt(model_dir, daemons):
    """A prefill process hands a prompt over through a daemon; the instance continues from that state (one
    token computed) and says so; a prompt nobody handed over is prefilled through the store and says how."""
    from engine.prefill import PrefillConfig, PrefillEngine, PrefillRequest
    from engine.prefill.cost import ChunkCost
    from kvstore.client import KVClient

    (daemon,) = daemons(1)
    handed, other = tokens(300, seed=60), tokens(100, seed=61)
    model = Decoder.from_pretrained(model_dir)
    with KVClient([daemon.address]) as client:
        prefill = PrefillEngine.from_pretrained(model_dir, client, PrefillConfig(block_tokens=BLOCK, kv_pages=16,
                                                                                 cost=ChunkCost(1e-9, 1e-3, 1e-3)))
        result = prefill.prefill(PrefillRequest(handed, hand_off=True, salt="t"))
        assert result.handed_off and prefill.flush(10)
        result.kv.release()
    expected = DecodeEngine(model, None, DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK))
    expected.submit(DecodeRequest(handed, SamplingParams(max_tokens=20)))
    (reference,) = expected.run()
    with start_instances(model_dir, 1, servers=[daemon.address], **OPTIONS) as instances:
        client = instances[0].client
        done = client.generate(handed, 20, from_handoff=True, salt="t").result(60)
        assert done["prefill_path"] == "handed_over" and done["tokens"] == reference.tokens
        assert client.generate(other, 5, salt="t").result(60)["prefill_path"] == "cold"
        with pytest.raises(InstanceError, match="from_handoff must be a bool"):
            client.generate(other, 5, from_handoff="yes").result(60)
        instances.stop()
