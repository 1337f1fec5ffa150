"""Decode instances as real processes on loopback, over gRPC (engine.serving.instance, client, processes), and
the router placing on them by the loads they report."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
from engine.decode.router import KV_AWARE, LEAST_REQUESTS, Router, RouterConfig
from engine.model.decoder import Decoder
from engine.serving.client import InstanceClient, InstanceError, to_instance_load
from engine.serving.processes import REPO_ROOT, InstanceStartError, start_instances
from engine.serving.proto import method, pb
from kvstore.block import tenant_of
from tests.engine.serving.conftest import BLOCK, CONTEXT, PAGES, VOCAB, idle, tokens
from tests.waiting import wait_for

# one worker runs the module, so its pair of instances starts once
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("decode_instances")]

MAX_MESSAGE = 65_536  # small, so the oversized request of a test is cheap to send
# float32 on both sides: in bf16, replies computed here (two threads) and in the instances (one) parted at a
# near-tie (tests/engine/checkpoints/test_real_model_bf16.py holds bf16)
OPTIONS = dict(kv_pages=PAGES, block_tokens=BLOCK, max_running=8, max_message_bytes=MAX_MESSAGE, dtype="float32")


@pytest.fixture(scope="module")
def pair(model_dir):
    with start_instances(model_dir, 2, **OPTIONS) as instances:
        yield instances
        codes = instances.stop()
    assert codes == [0, 0]  # SIGTERM shut both down cleanly


def test_an_instance_decodes_as_the_engine_does_in_process_and_streams_its_tokens(pair, model_dir):
    engine = DecodeEngine(Decoder.from_pretrained(model_dir, torch.float32), None,
                          DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK, max_running=8))
    cases = [(tokens(37, 1), SamplingParams(max_tokens=24)),
             (tokens(300, 2), SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=7)),
             (tokens(5, 3), SamplingParams(max_tokens=40, stop_token_ids=(7, 9)))]
    ids = [engine.submit(DecodeRequest(prompt, params)) for prompt, params in cases]
    results = {r.id: r for r in engine.run()}
    client = pair[0].client
    streamed = [[] for _ in cases]
    futures = [client.generate(prompt, params.max_tokens, on_tokens=streamed[n].extend,
                               temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                               seed=params.seed, stop_token_ids=params.stop_token_ids)
               for n, (prompt, params) in enumerate(cases)]
    for (prompt, _), future, want, sent in zip(cases, futures, [results[i] for i in ids], streamed):
        got = future.result(30)
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
        assert sent == got.tokens  # streamed as sampled, then the result
        assert got.prompt_tokens == len(prompt) and got.prefill_path is None
        assert len(got.token_times_s) == len(got.tokens) and got.token_times_s == sorted(got.token_times_s)


def _generate_raw(port: int, raw: bytes) -> list[pb.GenerateReply]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return list(channel.unary_stream(method("Generate"), None, pb.GenerateReply.FromString)(raw, timeout=30))


def test_bad_requests_get_errors_and_the_next_request_is_served(pair):
    request = lambda **fields: pb.GenerateRequest(**fields).SerializeToString()
    invalid = [
        (b"\xff\xff\xff", "valid GenerateRequest"),
        (request(prompt=[1]), "max_tokens (>= 1) or to_context"),
        (request(prompt=[1], to_context=False), "max_tokens (>= 1) or to_context"),
        (request(prompt=[], max_tokens=2), "empty prompt"),
        (request(prompt=[1], max_tokens=0), "max_tokens must be"),
        (request(prompt=[1], max_tokens=2, top_p=2), "top_p"),
        (request(prompt=[1], max_tokens=2, temperature=math.nan), "temperature"),
        (request(prompt=[1], max_tokens=2, from_handoff=True), "need a store"),
        (request(prompt=[1], max_tokens=2, tenant=tenant_of("t")), "need a store"),
        # field 10 carried the raw salt: a client that still sends it is refused, not served as the empty salt
        (request(prompt=[1], max_tokens=2) + b"R\x01t", "fields [10] are not in"),
        (request(prompt=[1], max_tokens=2) + bytes([0x98, 0x06, 0x01]), "fields [99] are not in"),  # field 99
        (request(prompt=[1] * CONTEXT, max_tokens=2), "leaves no room"),  # refused before it queues
        # refused by DecodeEngine.submit itself: outside the vocabulary, past the context
        (request(prompt=[VOCAB], max_tokens=2), "vocabulary"),
        (request(prompt=[1], max_tokens=2, stop_token_ids=[VOCAB]), "stop_token_ids"),
        (request(prompt=[1] * 8000, max_tokens=500), "context"),
    ]
    for raw, text in invalid:
        with pytest.raises(grpc.RpcError) as refused:
            _generate_raw(pair[0].port, raw)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in refused.value.details(), text
    with pytest.raises(grpc.RpcError) as refused:  # past --max-message-bytes: gRPC refuses it unread
        _generate_raw(pair[0].port, request(prompt=[300] * MAX_MESSAGE, max_tokens=1))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    *streamed, last = _generate_raw(pair[0].port, request(prompt=tokens(12), max_tokens=6))
    assert last.result.finish_reason == "max_tokens" and len(last.result.tokens) == 6
    assert [t for message in streamed for t in message.tokens.ids] == list(last.result.tokens)
    with pytest.raises(InstanceError, match="INVALID_ARGUMENT: .*vocabulary"):  # through the client, the same
        pair[0].client.generate([VOCAB + 1], 2).result(30)


def test_a_client_that_goes_away_has_its_request_cancelled_and_its_kv_freed(pair, model_dir):
    """A process that started a long generate is killed: its connection drops, the instance cancels it."""
    client = pair[1].client
    idle(client.load)
    script = (f"import grpc, sys\nfrom engine.serving.proto import method, pb\n"
              f"call = grpc.insecure_channel('127.0.0.1:{pair[1].port}').unary_stream(method('Generate'), "
              f"pb.GenerateRequest.SerializeToString, pb.GenerateReply.FromString)("
              f"pb.GenerateRequest(prompt={tokens(200, 9)}, max_tokens=5000))\n"
              "next(call)\nprint('streaming', flush=True)\nsys.stdin.read()\n")
    away = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert away.stdout.readline() == b"streaming\n"
        # its first token may reach it before the engine publishes the step that sampled it
        wait_for(lambda: client.load()["kv_tokens"] >= 200, "its KV")
    finally:
        away.kill()
        away.wait()
    idle(client.load)


def test_a_request_is_cancelled_by_cancelling_its_call(pair):
    client = pair[1].client
    idle(client.load)
    future = client.generate(tokens(8), 5000)
    wait_for(lambda: client.load()["running"] == 1, "the request to run")
    assert future.cancel() and future.cancelled()
    idle(client.load)  # cancelled on the instance: its KV freed


def test_load_reports_a_request_at_once_and_its_kv_once_computed(pair):
    client = pair[1].client
    assert idle(client.load)["kv_capacity"] == PAGES * BLOCK
    future = client.generate(tokens(300, 4), 4000)
    try:
        # received, perhaps not yet taken by the engine: counted, and its prompt as queued KV
        load = wait_for(lambda: (now := client.load())["running"] + now["waiting"] == 1 and now, "the request")
        assert load["kv_tokens"] + load["queued_tokens"] >= 300
        load = wait_for(lambda: (now := client.load())["running"] == 1 and now["kv_tokens"] >= 300 and now,
                        "the prompt's KV")
        assert load["waiting"] == 0 and load["queued_tokens"] == 0 and load["kv_tokens"] <= 300 + 4000
    finally:
        future.cancel()
    idle(client.load)


def test_kv_aware_places_on_the_instance_with_less_kv_where_least_requests_would_not(pair):
    a, b = pair[0].client, pair[1].client
    idle(a.load), idle(b.load)
    held = [a.generate(tokens(5000, 5), 3000)]  # one long sequence: 5,000 of the 8,192 KV tokens
    try:
        wait_for(lambda: a.load()["kv_tokens"] >= 5000, "the long prompt's KV")
        held += [b.generate(tokens(4, 6), 3000), b.generate(tokens(4, 7), 3000)]  # two short ones
        wait_for(lambda: b.load()["running"] + b.load()["waiting"] == 2, "the short ones")
        loads = [to_instance_load(c.load()) for c in (a, b)]
        assert (loads[0].running, loads[1].running) == (1, 2)
        assert loads[0].kv_tokens >= 5000 and loads[1].kv_tokens < 1000
        # 0.5 * 1/2 + 0.5 * 5,100/8,192 for the first against 0.5 * 2/2 + 0.5 * ~100/8,192 for the second
        chosen = Router(RouterConfig(policy=KV_AWARE)).place(loads, 100)
        assert chosen == 1
        assert Router(RouterConfig(policy=LEAST_REQUESTS)).place(loads, 100) == 0
        assert len((a, b)[chosen].generate(tokens(100, 8), 5).result(30).tokens) == 5
    finally:
        for future in held:
            future.cancel()
    idle(a.load), idle(b.load)


def test_sigterm_sigint_and_stdin_end_each_cancel_what_is_in_flight_and_exit_cleanly(model_dir):
    with start_instances(model_dir, 3, **OPTIONS) as instances:
        futures = [i.client.generate(tokens(16, n), 5000) for n, i in enumerate(instances)]
        for instance in instances:
            wait_for(lambda: instance.client.load()["running"] == 1, "the request to run")
        instances[0].process.send_signal(signal.SIGTERM)
        instances[1].process.send_signal(signal.SIGINT)
        instances[2].process.stdin.close()  # what the parent's death looks like to the child
        for future in futures:
            assert future.result(30).finish_reason == "cancelled"  # its stream ended with its result
        assert [i.process.wait(30) for i in instances] == [0, 0, 0]
        with pytest.raises(InstanceError, match="UNAVAILABLE"):  # nobody listens any more
            instances[2].client.load(timeout_s=30)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; whoever adopted it has not reaped it yet


def test_no_instance_outlives_its_parent(model_dir):
    script = ("import sys\nfrom engine.serving.processes import start_instances\n"
              f"instances = start_instances({str(model_dir)!r}, 1, kv_pages=16, block_tokens={BLOCK})\n"
              "print(instances[0].process.pid, flush=True)\nsys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
    finally:
        parent.kill()  # SIGKILL: no clean-up of its own runs
        parent.wait()
    wait_for(lambda: not _alive(child), "the instance to exit")


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
    model = Decoder.from_pretrained(model_dir, torch.float32)
    with KVClient([daemon.address]) as client:
        prefill = PrefillEngine.from_pretrained(model_dir, client, PrefillConfig(block_tokens=BLOCK, kv_pages=16,
                                                                                 cost=ChunkCost(1e-9, 1e-3, 1e-3)),
                                                torch.float32)
        result = prefill.prefill(PrefillRequest(handed, hand_off=True, salt="t"))
        assert result.handed_off and prefill.flush(10)
        result.kv.release()
    expected = DecodeEngine(model, None, DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK))
    expected.submit(DecodeRequest(handed, SamplingParams(max_tokens=20)))
    (reference,) = expected.run()
    with start_instances(model_dir, 1, servers=[daemon.address], **OPTIONS) as instances:
        client = instances[0].client
        # the instance is sent the tenant, not the salt: another salt's tenant finds nothing handed over to it
        stranger = client.generate(handed, 20, from_handoff=True, salt="u").result(60)
        assert stranger.prefill_path == "cold" and stranger.cached_tokens == 0
        done = client.generate(handed, 20, from_handoff=True, salt="t").result(60)
        assert done.prefill_path == "handed_over" and done.tokens == reference.tokens
        assert client.generate(other, 5, salt="t", traffic_class="agent").result(60).prefill_path == "cold"
        with pytest.raises(InstanceError, match="traffic_class"):
            client.generate(other, 5, traffic_class="").result(60)
        with pytest.raises(InstanceError, match="tenant is 16 bytes"):
            client.generate(other, 5, tenant=b"t").result(60)
        assert instances.stop() == [0]


def test_a_client_of_no_instance_says_so(tmp_path):
    with InstanceClient("127.0.0.1:1") as client, pytest.raises(InstanceError, match="UNAVAILABLE"):
        client.load(timeout_s=30)


def test_speculation_is_on_by_default_and_a_flag_turns_it_off(model_dir):
    from engine.serving.config import parse_args

    assert parse_args(["--model", str(model_dir)]).decode_config().speculative
    assert not parse_args(["--model", str(model_dir), "--no-speculative"]).decode_config().speculative
