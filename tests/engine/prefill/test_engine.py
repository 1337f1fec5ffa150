"""Golden tests: the prefill engine over real daemons gives the reference logits, cold or warm."""

from __future__ import annotations

import pytest
import torch

from engine.model.kv import KVCapacityError
from engine.prefill.config import PrefillConfig
from engine.prefill.cost import ChunkCost
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import CACHED, COLD, LOAD_FAILED, WINDOW_MISSING, PrefillError, PrefillRequest
from engine.window import record as window_records
from kvstore.block import Namespace
from kvstore.client import ClientConfig, KVClient
from tests.engine.conftest import VOCAB

pytestmark = pytest.mark.integration
TOLERANCE = 1e-4
BLOCK = 16
COST = ChunkCost(a=1e-7, b=1e-3, c=1e-3)  # fixed (tests time nothing), and slow enough that loading pays
# A conversation: each turn extends the last. Turn 2 resumes from 32 cached tokens, inside the first
# 128-token window; turn 4 from 288, past it.
TURNS = [40, 100, 300, 350]


def _tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(tiny, client, **overrides) -> PrefillEngine:
    config = PrefillConfig(**{"block_tokens": BLOCK, "kv_pages": 128, "cost": COST, "step_budget_s": 0.5,
                              **overrides})
    return PrefillEngine.from_pretrained(tiny.path, client, config, torch.float32)


def _client(daemon, engine_block_bytes: int | None = None) -> KVClient:
    host = {"host_tier_bytes": 64 * engine_block_bytes, "host_block_bytes": engine_block_bytes} \
        if engine_block_bytes else {}
    return KVClient(ClientConfig(servers=(daemon.address,), **host))


def _check(tiny, result, tokens):
    reference = tiny.logits(tokens)[-1]
    assert (result.logits - reference).abs().max().item() <= TOLERANCE
    assert result.first_token == int(reference.argmax())
    result.kv.release()


def test_cold_and_warm_from_the_host_tier(tiny, daemons):
    (daemon,) = daemons(1)
    block_bytes = _engine(tiny, None).block_bytes
    with _client(daemon, block_bytes) as client:
        engine = _engine(tiny, client)
        conversation = _tokens(TURNS[-1])
        for turn, length in enumerate(TURNS):
            result = engine.prefill(PrefillRequest(conversation[:length], session_id="s1"))
            if turn == 0:
                assert result.path == COLD and result.loaded_tokens == 0
            else:
                previous_blocks = TURNS[turn - 1] // BLOCK
                assert result.path == CACHED
                assert result.loaded_tokens == previous_blocks * BLOCK
                assert result.sources == {"host": previous_blocks}
            _check(tiny, result, conversation[:length])
            client.write_behind.flush()
            assert len(result.blocks) == length // BLOCK
            assert client.advise(result.blocks, continues=True) == len(result.blocks)  # the store holds them
        assert engine.pool.free_pages == 128


def test_warm_from_a_restarted_daemons_ssd(tiny, daemons):
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[2], seed=1)
    with _client(daemon) as client:  # no host tier: every hit comes from the daemon
        engine = _engine(tiny, client)
        _check(tiny, engine.prefill(PrefillRequest(conversation[:TURNS[1]], session_id="s")), conversation[:TURNS[1]])
        assert client.write_behind.flush()
    daemon.stop()
    daemon.start()
    with _client(daemon) as client:
        engine.client = client  # the engine (and its window tier) lives on; the daemon restarted
        result = engine.prefill(PrefillRequest(conversation, session_id="s"))
        assert result.path == CACHED and result.sources == {"daemon": TURNS[1] // BLOCK}
        _check(tiny, result, conversation)
        stats = client.server_stats()[daemon.address]
        assert stats.value("kvstore_hits_total", tier="ssd") >= TURNS[1] // BLOCK


def test_missing_window_state_recomputes_exactly(tiny, daemons):
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[1], seed=2)
    with _client(daemon) as client:
        first = _engine(tiny, client, store_windows=False)  # as if its window record had expired
        first.prefill(PrefillRequest(conversation[:TURNS[0]])).kv.release()
        client.write_behind.flush()
        fresh = _engine(tiny, client)  # a different engine: the store has the prefix, not its window
        result = fresh.prefill(PrefillRequest(conversation))
        assert result.stored_tokens == (TURNS[0] // BLOCK) * BLOCK
        if fresh.model.config.sliding_layers:
            assert result.path == WINDOW_MISSING and result.loaded_tokens == 0
        else:
            assert result.path == CACHED and result.loaded_tokens == result.stored_tokens
        _check(tiny, result, conversation)


def test_a_restarted_engine_resumes_exactly_from_the_stored_window_and_the_next_turns_too(tiny_models, daemons):
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[-1], seed=12)
    with _client(daemon) as client:
        first = _engine(tiny, client)
        first.prefill(PrefillRequest(conversation[:TURNS[0]], session_id="s")).kv.release()
        client.write_behind.flush()
        for length in TURNS[1:]:  # each turn on an engine of its own, as if restarted or behind a balancer
            engine = _engine(tiny, client)
            result = engine.prefill(PrefillRequest(conversation[:length], session_id="s"))
            assert (result.path, result.window_source) == (CACHED, "store")
            assert result.loaded_tokens == result.stored_tokens > 0 and result.window_bytes > 0
            _check(tiny, result, conversation[:length])
            client.write_behind.flush()
            assert engine.window_misses == {}


def test_a_sessions_older_window_record_is_deleted_once_a_newer_one_is_saved(tiny_models, daemons):
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[1], seed=13)
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        first = engine.prefill(PrefillRequest(conversation[:TURNS[0]], session_id="s"))
        client.write_behind.flush()
        chain = engine.namespace()
        older = window_records.window_record(chain, first.blocks[-1])
        assert client.lookup([older]) == 1
        first.kv.release()
        second = engine.prefill(PrefillRequest(conversation, session_id="s"))
        client.write_behind.flush()
        assert client.lookup([older]) == 0, "superseded by the newer turn's record"
        assert client.lookup([window_records.window_record(chain, second.blocks[-1])]) == 1
        second.kv.release()


def test_a_session_deletes_its_older_record_saved_by_another_engine_and_leaves_a_shared_one(tiny_models, daemons):
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[2], seed=14)
    with _client(daemon) as client:
        chain = _engine(tiny, None).namespace()
        record = lambda result: window_records.window_record(chain, result.blocks[-1])  # noqa: E731
        first = _engine(tiny, client).prefill(PrefillRequest(conversation[:TURNS[0]], session_id="s"))
        client.write_behind.flush()
        # another session resumes from the first's record (a prefix they share), on an engine of its own
        other = _engine(tiny, client).prefill(PrefillRequest(conversation[:TURNS[0]] + _tokens(40, 15),
                                                             session_id="t"))
        client.write_behind.flush()
        assert (other.path, other.window_source) == (CACHED, "store") and record(other) != record(first)
        assert client.lookup([record(first)]) == 1, "another session's record is left where it was"
        first.kv.release(), other.kv.release()
        records = [record(first)]
        for length in TURNS[1:3]:  # the session's next turns, each on another engine
            result = _engine(tiny, client).prefill(PrefillRequest(conversation[:length], session_id="s"))
            client.write_behind.flush()
            assert (result.path, result.window_source) == (CACHED, "store")
            records.append(record(result))
            assert [client.lookup([r]) for r in records[-2:]] == [0, 1], "the session's older record is superseded"
            result.kv.release()
        assert client.lookup(records[:1]) == 0 and client.lookup([record(other)]) == 1


def test_sessions_whose_turns_end_at_one_boundary_leave_each_others_record(tiny_models, daemons):
    """A shared system prompt and a short first message: two sessions' first turns end at the same block
    boundary, so they share one record key. The daemon keeps the first's record (the second's answers
    EXISTS), and the second session moving on must not delete it under the first."""
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    system = _tokens(2 * BLOCK, seed=16)
    s_turns = [system + _tokens(8, seed=17), system + _tokens(8, seed=17) + _tokens(60, seed=18)]
    t_turns = [system + _tokens(5, seed=19), system + _tokens(5, seed=19) + _tokens(70, seed=20)]
    with _client(daemon) as client:
        chain = _engine(tiny, None).namespace()
        s_first = _engine(tiny, client).prefill(PrefillRequest(s_turns[0], session_id="s"))
        client.write_behind.flush()
        shared = window_records.window_record(chain, s_first.blocks[-1])
        t_engine = _engine(tiny, client)
        for turn in t_turns:  # both of t's turns on one engine, which remembers what it saved for t
            t_engine.prefill(PrefillRequest(turn, session_id="t")).kv.release()
            client.write_behind.flush()
        assert client.lookup([shared]) == 1, "s's record survives t's second turn"
        s_first.kv.release()
        s_second = _engine(tiny, client).prefill(PrefillRequest(s_turns[1], session_id="s"))
        assert (s_second.path, s_second.window_source) == (CACHED, "store") and s_second.loaded_tokens > 0
        _check(tiny, s_second, s_turns[1])
        s_second.kv.release()


@pytest.mark.parametrize("damage", ["position", "shape", "format", "replayed"])
def test_a_window_record_that_is_not_the_window_is_a_counted_miss_and_the_prompt_exact(tiny_models, daemons, damage):
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[1], seed=14)
    with _client(daemon) as client:
        first = _engine(tiny, client, store_windows=False)
        stored = first.prefill(PrefillRequest(conversation[:TURNS[0]]))
        client.write_behind.flush()
        boundary = len(stored.blocks) * BLOCK
        state = first.window_tier.get(stored.blocks[-1].key)  # the true window as of the boundary
        stored.kv.release()
        codec = first.namespace().layout.codec  # the engine's: a record in another is a miss of cause "codec"
        wrong = {"position": window_records.encode(type(state)(boundary - 1, state.rings), codec=codec),
                 "shape": window_records.encode(type(state)(boundary, state.rings[:, :, :, :, :-1]), codec=codec),
                 "format": b"KVH1" + window_records.encode(state, codec=codec)[4:],
                 "replayed": window_records.encode(type(state)(boundary, state.rings, window_from=1),
                                                   codec=codec)}[damage]
        record = window_records.window_record(first.namespace(), stored.blocks[-1])
        client.put([(record, wrong)], 1, window_records.WINDOW_CLASS)  # a record made by someone else
        fresh = _engine(tiny, client, replay_tokens=0)
        result = fresh.prefill(PrefillRequest(conversation))
        assert result.path == WINDOW_MISSING and result.window_source is None
        assert fresh.window_misses == {damage: 1}
        _check(tiny, result, conversation)


def test_several_requests_share_steps_and_all_finish(tiny, daemons):
    (daemon,) = daemons(1)
    shared = _tokens(64, seed=3)
    prompts = [shared + _tokens(n, seed=10 + n) for n in (5, 180, 70, 300)]
    with _client(daemon) as client:
        engine = _engine(tiny, client, step_budget_s=0.15)
        for prompt in prompts:
            engine.submit(PrefillRequest(prompt))
        results = engine.run()
        assert sorted(len(r.request.tokens) for r in results) == sorted(len(p) for p in prompts)
        assert max(r.chunks for r in results) > 1  # the budget cut the long prompts into chunks
        for result in results:
            _check(tiny, result, list(result.request.tokens))


@pytest.mark.parametrize("tokens, turn, message", [
    ([], 0, "empty prompt"),
    ([1, 2, VOCAB], 0, "outside the vocabulary"),
    ([-1, 2], 0, "outside the vocabulary"),
    ([1, 2.5], 0, "integers"),
    ([1] * 1025, 0, "exceeds the model's context"),
    ([1, 2], -1, "turn must be a non-negative integer"),
])
def test_bad_input_is_refused_and_disturbs_nothing(tiny_models, tokens, turn, message):
    tiny = tiny_models["gpt_oss"]
    engine = _engine(tiny, None)
    good = _tokens(50)
    engine.submit(PrefillRequest(good))
    with pytest.raises(PrefillError, match=message):
        engine.submit(PrefillRequest(tokens, turn=turn))
    (result,) = engine.run()
    _check(tiny, result, good)


def test_a_foreign_namespace_is_refused(tiny_models):
    engine = _engine(tiny_models["qwen3"], None)
    wrong = Namespace("some/other-model", engine.layout, BLOCK, "tenant")
    with pytest.raises(PrefillError, match="does not match this model"):
        engine.submit(PrefillRequest(_tokens(20), namespace=wrong))
    right = engine.namespace("tenant")
    engine.submit(PrefillRequest(_tokens(20), namespace=right))
    assert engine.pending == 1


def test_requests_wait_for_kv_pages(tiny_models):
    tiny = tiny_models["qwen3"]
    engine = _engine(tiny, None, kv_pages=8)
    with pytest.raises(PrefillError, match="needs 9 KV pages"):
        engine.submit(PrefillRequest(_tokens(130)))
    prompts = [_tokens(100, seed=s) for s in (1, 2)]  # 7 pages each: the second waits for the first
    for prompt in prompts:
        engine.submit(PrefillRequest(prompt))
    first = []
    while not first:
        first = engine.step()
    with pytest.raises(KVCapacityError, match="release"):
        engine.run()
    first[0].kv.release()
    (second,) = engine.run()
    _check(tiny, second, prompts[1])


def test_a_shared_prefix_gets_its_window_kept_for_the_next_request(tiny_models, daemons):
    # the first request stores a system prompt; the second finds it without a window state, recomputes,
    # and keeps the window at the shared boundary; the third resumes there exactly
    tiny = tiny_models["gpt_oss"]
    (daemon,) = daemons(1)
    system = _tokens(64, seed=4)
    prompts = [system + _tokens(40, seed=s) for s in (5, 6, 7)]
    with _client(daemon) as client:
        engine = _engine(tiny, client, store_windows=False)
        engine.prefill(PrefillRequest(prompts[0][:64])).kv.release()  # e.g. a warm-up of the system prompt
        client.write_behind.flush()
        engine.windows.tier = type(engine.windows.tier)(engine.config.window_tier_bytes)  # as if lost
        second = engine.prefill(PrefillRequest(prompts[1]))
        assert second.path == WINDOW_MISSING
        _check(tiny, second, prompts[1])
        third = engine.prefill(PrefillRequest(prompts[2]))
        assert third.path == CACHED and third.loaded_tokens == 64
        _check(tiny, third, prompts[2])


def test_a_block_corrupt_on_ssd_is_recomputed_and_the_logits_hold(tiny, daemons):
    from tests.kvstore.client.test_load import corrupt_on_disk

    (daemon,) = daemons(1, "--hot-tier-bytes", "0")
    conversation = _tokens(TURNS[2], seed=8)
    with _client(daemon) as client:
        engine = _engine(tiny, client)
        engine.prefill(PrefillRequest(conversation[:TURNS[1]], session_id="s")).kv.release()
        assert client.write_behind.flush()
    daemon.stop()
    blocks = engine.namespace().blocks(conversation)
    corrupt_on_disk(daemon.data_dir, blocks[3].key, layer_index=0)
    daemon.start()
    with _client(daemon) as client:
        engine.client = client
        result = engine.prefill(PrefillRequest(conversation, session_id="s"))
        assert result.path == LOAD_FAILED and result.stored_tokens == (TURNS[1] // BLOCK) * BLOCK
        # a dense model resumes after the last good block; a hybrid one has no window there: from scratch
        assert result.loaded_tokens == (0 if engine.window_tier is not None else 3 * BLOCK)
        assert client.stats.miss_causes["checksum"] >= 1
        _check(tiny, result, conversation)


def test_bfloat16_kv_round_trips_through_the_store(tiny_models, daemons):
    tiny = tiny_models["qwen3"]
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[1], seed=9)
    config = PrefillConfig(block_tokens=BLOCK, kv_pages=64, cost=COST, step_budget_s=0.5)
    with _client(daemon) as client:
        engine = PrefillEngine.from_pretrained(tiny.path, client, config, dtype=torch.bfloat16)
        assert engine.layout.dtype == "bfloat16"
        cold = engine.prefill(PrefillRequest(conversation))
        cold.kv.release()
        assert client.write_behind.flush()
        warm = engine.prefill(PrefillRequest(conversation))
        warm.kv.release()
        assert warm.path == CACHED and warm.loaded_tokens == (TURNS[1] - 1) // BLOCK * BLOCK
        assert (warm.logits - cold.logits).abs().max() < 0.05  # bf16, computed in other chunks
        assert warm.first_token == cold.first_token


@pytest.mark.parametrize("first, second", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["float32 first", "bfloat16 first"])
def test_float32_and_bfloat16_engines_sharing_a_daemon_never_read_each_others_kv(tiny, daemons, first, second):
    # one model, one model identity, one daemon: the KV's dtype is part of the namespace (KVLayout.dtype), so
    # an engine of the other dtype finds nothing of a prompt the first stored and computes it cold; each
    # engine's next turn resumes from its own dtype's blocks (and, on a hybrid model, its own window record)
    (daemon,) = daemons(1)
    conversation = _tokens(TURNS[2], seed=13)
    config = PrefillConfig(block_tokens=BLOCK, kv_pages=64, cost=COST, step_budget_s=0.5)

    def engine(dtype: torch.dtype, client: KVClient) -> PrefillEngine:
        return PrefillEngine.from_pretrained(tiny.path, client, config, dtype=dtype)

    with _client(daemon) as client:  # no host tier: every lookup and load asks the daemon
        engines = {dtype: engine(dtype, client) for dtype in (first, second)}
        assert engines[first].model_id == engines[second].model_id
        assert engines[first].namespace().digest != engines[second].namespace().digest
        prompt, stored = conversation[:TURNS[1]], TURNS[1] // BLOCK
        results = {}
        for dtype in (first, second):
            result = results[dtype] = engines[dtype].prefill(PrefillRequest(prompt, session_id="s"))
            assert (result.path, result.stored_tokens, result.loaded_tokens) == (COLD, 0, 0), dtype
            assert len(result.blocks) == stored
            result.kv.release()
            assert client.write_behind.flush()
        # both copies are on the daemon, under different keys
        keys = {dtype: {block.key for block in result.blocks} for dtype, result in results.items()}
        assert not keys[first] & keys[second]
        assert [client.lookup(list(result.blocks)) for result in results.values()] == [stored, stored]
        assert (results[torch.float32].logits - tiny.logits(prompt)[-1]).abs().max().item() <= TOLERANCE
        for dtype in (first, second):  # the next turn on a fresh engine of each dtype: its own blocks, its own window
            result = engine(dtype, client).prefill(PrefillRequest(conversation, session_id="s"))
            assert (result.path, result.loaded_tokens, result.sources) == (CACHED, stored * BLOCK,
                                                                           {"daemon": stored}), dtype
            if tiny.kind == "gpt_oss":
                assert result.window_source == "store"
            if dtype == torch.float32:
                _check(tiny, result, conversation)
            else:  # bf16 KV loaded from its own blocks: as close to the reference as bf16 computes (measured
                #      <= 0.08 on these models, whose logits spread ~0.8; fp32 bytes read as bf16 would be noise)
                assert (result.logits - tiny.logits(conversation)[-1]).abs().max().item() <= 0.2
                result.kv.release()
