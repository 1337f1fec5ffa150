"""Hostile requests against the decode engine, its serving loop and a decode instance, beside a victim that
must not notice them.

* A sampling value inside its documented range, however extreme (top_p below float32's smallest subnormal,
  1 - 2**-53, temperatures from 5e-324 to 1.7e308, top_k past the vocabulary, seed 2**64 - 1), gets a reply;
  a victim in flight finishes its own, and the instance lives on.
* A request whose own work raises in a step (here its stop check's detokenize) ends alone with the error;
  the others finish as they would have alone.
* A queued request does no engine work (its draft index waits for admission); the requests held are bounded
  in all and per principal, past them a submit is refused at once (RESOURCE_EXHAUSTED on an instance); cancels
  are taken before the submits queued ahead of them.
* Error texts are bounded (200,000 refused stop ids are named by a few and a count) and every RPC refuses
  fields it does not know.

Nothing here waits on the clock: each test asserts counts and states (a victim still streaming once every
hostile reply is in, a ticket never submitted), and `wait_for` only polls a state against hangs.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import grpc
import pytest

from engine.checkpoints.random_model import write_random_model
from engine.decode import DecodeConfig, DecodeEngine, DecodeRequest, SamplingParams
from engine.decode.request import CANCELLED, ERROR, MAX_TOKENS
from engine.model.decoder import Decoder
from engine.serving.client import InstanceClient, InstanceError
from engine.serving.loop import DRAIN_PER_STEP, EngineFault, ServingBusy, ServingLoop
from engine.serving.processes import start_instances
from engine.serving.proto import method, pb
from kvstore.server.auth import new_token, token_entry
from tests.engine.serving.conftest import BLOCK, MODEL, PAGES, VOCAB, idle, tokens
from tests.waiting import wait_for

# One sampled request per extreme, inside the documented ranges; each its own call beside the victim.
EXTREMES: list[dict] = [
    *({"temperature": 1.0, "top_p": p} for p in (5e-324, 1e-300, 7e-46, 8e-46, 1.4e-45, 1e-38, 1 - 2**-53)),
    *({"temperature": t, "top_p": p} for t in (5e-324, 1e-300, 1e300, 1.7976931348623157e308) for p in (1e-300, 1.0)),
    *({"temperature": 1.0, "top_k": k, "top_p": 5e-324} for k in (1, VOCAB - 1, VOCAB, 2**32 - 1)),
    {"temperature": 1.0, "seed": 2**64 - 1}, {"temperature": 2.0, "seed": 0, "top_k": 2**32 - 1, "top_p": 1 - 2**-53},
]
HOSTILE_TOKENS = 8
VICTIM_TOKENS = 1500  # sampled: drafts rarely hold, so ~a step a token, far more steps than the hostile replies take


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "model"
    write_random_model(path, MODEL)
    return path


@pytest.fixture(scope="module")
def model(model_dir) -> Decoder:
    return Decoder.from_pretrained(model_dir)


class Ends:
    """on_done callbacks that record each request's end by name."""

    def __init__(self) -> None:
        self.ended: queue.Queue = queue.Queue()

    def callback(self, name: object) -> Callable:
        return lambda result, error: self.ended.put((name, result, error))

    def take(self, n: int) -> dict:
        return {name: (result, error) for name, result, error in (self.ended.get(timeout=60) for _ in range(n))}


def _raising(_: object) -> str:
    raise RuntimeError("detokenize failed for this request")


# -- the engine and its loop, in process --------------------------------------------------------------------


@pytest.mark.unit
def test_a_request_whose_own_work_raises_ends_alone_and_the_others_finish_as_alone(model):
    config = DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK, max_running=8, fixed_drafts=3)
    victims = [DecodeRequest(tokens(30, 1), SamplingParams(max_tokens=20)),
               DecodeRequest(tokens(40, 2), SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=5))]
    alone = DecodeEngine(model, None, config)
    expected = [alone.submit(request) for request in victims]
    replies = {r.id: r.tokens for r in alone.run()}
    engine = DecodeEngine(model, None, config)
    ids = [engine.submit(request) for request in victims]
    # its stop check (run on every sampled token) raises: the engine's work for it alone
    bad = engine.submit(DecodeRequest(tokens(20, 3), SamplingParams(max_tokens=20, stop=("x",)), detokenize=_raising))
    results = {r.id: r for r in engine.run()}
    assert results[bad].finish_reason == ERROR and "RuntimeError: detokenize failed" in results[bad].error
    for victim, alone_id in zip(ids, expected):
        assert results[victim].finish_reason == MAX_TOKENS and results[victim].error is None
        assert results[victim].tokens == replies[alone_id]  # untouched by the failure beside it
    assert engine.pool.free_pages == PAGES  # the failed request's KV was freed with the others'


@pytest.mark.unit
def test_through_the_loop_the_failed_request_alone_ends_with_a_fault_and_no_fault_is_raised(model):
    faults: list[Exception] = []
    serving = ServingLoop(model, None, DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK), on_fault=faults.append)
    try:
        ends = Ends()
        serving.submit(DecodeRequest(tokens(30, 4), SamplingParams(max_tokens=40)), ends.callback("victim"))
        serving.submit(DecodeRequest(tokens(20, 5), SamplingParams(max_tokens=40, stop=("x",)), detokenize=_raising),
                       ends.callback("bad"))
        ended = ends.take(2)
        result, error = ended["bad"]
        assert result is None and isinstance(error, EngineFault) and "detokenize failed" in str(error)
        result, error = ended["victim"]
        assert error is None and result.finish_reason == MAX_TOKENS and len(result.tokens) == 40
        assert faults == []  # not a step's fault: an instance would not exit
        assert idle(lambda: serving.load)["kv_tokens"] == 0
    finally:
        serving.close()


@pytest.mark.unit
def test_a_queued_request_builds_no_draft_index_until_admitted(model):
    engine = DecodeEngine(model, None, DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK, max_running=1,
                                                    fixed_drafts=3))
    first = engine.submit(DecodeRequest(tokens(10, 6), SamplingParams(max_tokens=30)))
    queued = engine.submit(DecodeRequest(tokens(4000, 7), SamplingParams(max_tokens=30)))
    engine.step()
    (waiting,) = engine._waiting
    assert waiting.id == queued and waiting.drafter is None and waiting.indexing is None
    results = {r.id: r for r in engine.run()}
    assert results[first].finish_reason == results[queued].finish_reason == MAX_TOKENS
    assert results[queued].drafted > 0  # admitted, it had its index and speculated


@pytest.mark.unit
def test_past_its_bounds_the_loop_refuses_at_once_and_an_end_gives_the_place_back(model):
    serving = ServingLoop(model, None, DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK), max_calls=3,
                          max_calls_per_principal=2)
    ends = Ends()
    long = lambda seed: DecodeRequest(tokens(8, seed), SamplingParams(max_tokens=8000, temperature=1.0, seed=seed))
    try:
        alice = [serving.submit(long(n), ends.callback(("alice", n)), "alice") for n in range(2)]
        with pytest.raises(ServingBusy, match="max_calls_per_principal"):
            serving.submit(long(9), ends.callback("refused"), "alice")
        serving.submit(long(3), ends.callback("bob"), "bob")
        with pytest.raises(ServingBusy, match=r"\(max_calls\)"):
            serving.submit(long(9), ends.callback("refused"), "bob")
        assert serving.held == 3
        serving.cancel(alice[0])
        result, error = ends.take(1)[("alice", 0)]
        assert error is None and result.finish_reason == CANCELLED
        serving.submit(long(4), ends.callback(("alice", 4)), "alice")  # its place came back
    finally:
        serving.close()
    assert len(ends.take(3)) == 3 and serving.held == 0  # the close ended the rest, each once
    assert ends.ended.empty()


@pytest.mark.unit
def test_cancels_are_taken_before_the_submits_queued_ahead_of_them(model):
    """The engine thread is held inside a callback while the inbox fills to the bound with submits; their
    cancels, sent last, end every one of them before any reaches the engine."""
    queued = DRAIN_PER_STEP + 44  # more than one round of the inbox
    serving = ServingLoop(model, None, DecodeConfig(kv_pages=PAGES, block_tokens=BLOCK), max_calls=queued + 1)
    holding, release = threading.Event(), threading.Event()

    def hold(_: int) -> None:  # on the engine thread: it takes nothing from its inbox meanwhile
        if not holding.is_set():
            holding.set()
            release.wait(60)

    ends = Ends()
    try:
        serving.submit(DecodeRequest(tokens(8, 1), SamplingParams(max_tokens=12), on_token=hold),
                       ends.callback("holder"))
        assert holding.wait(60)
        tickets = [serving.submit(DecodeRequest(tokens(8, n), SamplingParams(max_tokens=12)), ends.callback(n))
                   for n in range(queued)]
        with pytest.raises(ServingBusy):  # the submit queue is full
            serving.submit(DecodeRequest(tokens(8), SamplingParams(max_tokens=12)), ends.callback("refused"))
        for ticket in tickets:
            serving.cancel(ticket)
        release.set()
        ended = ends.take(queued + 1)
    finally:
        release.set()
        serving.close()
    result, error = ended.pop("holder")
    assert error is None and result.finish_reason == MAX_TOKENS
    assert {result.finish_reason for result, _ in ended.values()} == {CANCELLED}
    assert all(result.tokens == [] for result, _ in ended.values())
    assert all(ticket.id is None for ticket in tickets)  # none of them reached the engine


# -- a decode instance ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def instance(model_dir):
    with start_instances(model_dir, 1, kv_pages=PAGES, block_tokens=BLOCK, max_running=len(EXTREMES) + 2) as started:
        yield started[0]
        assert started.stop() == [0]


@pytest.mark.integration
def test_sampling_extremes_get_replies_and_the_victim_in_flight_finishes(instance):
    client = instance.client
    streamed: list[int] = []
    victim = client.generate(tokens(16, 1), VICTIM_TOKENS, temperature=1.0, seed=1, on_tokens=streamed.extend)
    wait_for(lambda: streamed, "the victim's first tokens")
    hostile = [client.generate(tokens(16, 10 + n), HOSTILE_TOKENS, **fields) for n, fields in enumerate(EXTREMES)]
    for fields, future in zip(EXTREMES, hostile):
        reply = future.result(120)
        assert reply.finish_reason == "max_tokens" and len(reply.tokens) == HOSTILE_TOKENS, fields
        assert all(0 <= t < VOCAB for t in reply.tokens)
    assert not victim.done(), "the victim must still be in flight once every hostile reply is in"
    reply = victim.result(300)
    assert reply.finish_reason == "max_tokens" and len(reply.tokens) == VICTIM_TOKENS
    assert instance.process.poll() is None  # the instance lives on, and serves
    assert idle(client.load)["kv_tokens"] == 0


def _generate_raw(port: int, raw: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(channel.unary_stream(method("Generate"), None, pb.GenerateReply.FromString)(raw, timeout=60))
    return refused.value


@pytest.mark.integration
def test_refusals_say_a_few_values_and_a_count_and_every_rpc_refuses_unknown_fields(instance):
    many = list(range(VOCAB, VOCAB + 200_000))  # 200,000 stop ids outside the vocabulary (~600 KB)
    refused = _generate_raw(instance.port, pb.GenerateRequest(prompt=[1], max_tokens=2,
                                                              stop_token_ids=many).SerializeToString())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "(200000 in all)" in refused.details() and len(refused.details()) < 300
    # 100,000 fields of numbers this protocol does not have (varints, field numbers from 100 up)
    unknown = b"".join(_varint((number << 3) | 0) + b"\x01" for number in range(100, 100_100))
    refused = _generate_raw(instance.port, pb.GenerateRequest(prompt=[1], max_tokens=2).SerializeToString()
                            + unknown)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "(100000 in all)" in refused.details() and len(refused.details()) < 300
    with grpc.insecure_channel(f"127.0.0.1:{instance.port}") as channel:
        load = channel.unary_unary(method("Load"), None, pb.LoadReply.FromString)
        with pytest.raises(grpc.RpcError) as caught:
            load(_varint((99 << 3) | 0) + b"\x01", timeout=60)  # LoadRequest has no field 99
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[99]" in caught.value.details()
        assert load(b"", timeout=60).kv_capacity == PAGES * BLOCK
    assert instance.process.poll() is None


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


TOKENS = {name: new_token() for name in ("alice", "bob")}


@pytest.mark.integration
def test_calls_past_the_instance_bounds_end_resource_exhausted_and_cancels_give_them_back(model_dir, tmp_path):
    """max_calls 4, 3 per principal (a token's name). Each call runs long (sampled to the context, ~8,000
    steps) and is cancelled by the test, so every one is held while the bounds are probed."""
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text("".join(token_entry(name, token, None, ["read", "write"]) for name, token in TOKENS.items()))
    with start_instances(model_dir, 1, kv_pages=2 * PAGES, block_tokens=BLOCK, max_running=2, max_calls=4,
                         max_calls_per_principal=3, auth_tokens=tokens_file,
                         client={"token": TOKENS["alice"]}) as started:
        alice = started[0].client
        with InstanceClient(f"127.0.0.1:{started[0].port}", token=TOKENS["bob"]) as bob:
            long = lambda client, seed: client.generate(tokens(8, seed), None, temperature=1.0, seed=seed)
            held = []
            for n in range(3):  # 2 run, 1 queues
                held.append(long(alice, n))
                wait_for(lambda: (load := alice.load())["running"] + load["waiting"] == n + 1, f"call {n} held")
            with pytest.raises(InstanceError) as refused:
                long(alice, 9).result(60)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_calls_per_principal" in refused.value.message
            held.append(long(bob, 3))
            wait_for(lambda: (load := alice.load())["running"] + load["waiting"] == 4, "bob's call held")
            with pytest.raises(InstanceError) as refused:
                long(bob, 9).result(60)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "(max_calls)" in refused.value.message
            assert not any(future.done() for future in held), "every call must still be held"
            for future in held:
                future.cancel()
            idle(alice.load)
            reply = bob.generate(tokens(8, 5), 4).result(60)  # the places came back
            assert reply.finish_reason == "max_tokens" and len(reply.tokens) == 4
        assert started[0].process.poll() is None
        assert started.stop() == [0]


@pytest.mark.unit
def test_the_bounds_are_instance_settings_with_clear_errors(model_dir, capsys):
    from engine.serving.config import parse_args

    config = parse_args(["--model", str(model_dir), "--max-calls", "8", "--max-calls-per-principal", "2"])
    assert (config.max_calls, config.max_calls_per_principal) == (8, 2)
    for flags, says in ((["--max-calls", "0"], "max_calls must be an integer >= 1, got 0"),
                        (["--max-calls", "4", "--max-calls-per-principal", "5"], "must not exceed it")):
        with pytest.raises(SystemExit):
            parse_args(["--model", str(model_dir), *flags])
        assert says in capsys.readouterr().err
