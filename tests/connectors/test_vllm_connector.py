"""The vLLM KV connector built by vLLM's own factory: the scheduler side on real vLLM Requests and
SchedulerOutputs, the worker side on CPU KV tensors through a real ForwardContext, over a real daemon
(`make test-connectors`, in the vLLM venv); and block sharing with this project's prefill engine."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks a platform
pytest.importorskip("vllm", reason="the vLLM venv: make test-connectors")
torch = pytest.importorskip("torch")

from tests.connectors.vllm_harness import Engine, vllm_request  # noqa: E402

pytestmark = pytest.mark.connectors

BLOCK = 16
MISS_DEADLINE_S = 30.0  # a dead daemon must answer within the client's deadline, not hang (a hang guard)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fill(engine: Engine, block_ids: list[int], seed: int):
    """`compute(layer)`: the attention layer writing new KV into its pages of `block_ids`."""
    generator = torch.Generator().manual_seed(seed)

    def compute(layer: int) -> None:
        pages = engine.kv[layer][block_ids]
        engine.kv[layer][block_ids] = torch.randn(pages.shape, generator=generator).to(pages.dtype)

    return compute


def _saved(engine: Engine, tokens: list[int], seed: int, salt: str | None = None) -> list[bytes]:
    """A cold prefill of `tokens` through `engine`: its full blocks' KV, as saved (and flushed)."""
    request = vllm_request(f"save-{seed}", tokens, salt)
    block_ids = engine.allocate(-(-len(tokens) // BLOCK))
    external, meta = engine.schedule(request, block_ids)
    assert external == 0 and meta.loads == []
    assert [(s.first, s.block_ids) for s in meta.saves] == [(0, block_ids[: len(tokens) // BLOCK])]
    assert engine.forward(meta, _fill(engine, block_ids, seed)) == set()
    assert engine.worker.flush(30)
    engine.scheduler.request_finished(request, block_ids)
    return engine.pages(block_ids[: len(tokens) // BLOCK])


def test_a_prompt_saved_through_the_connector_loads_back_the_same_kv_bytes(daemons):
    (daemon,) = daemons(1)
    tokens = _tokens(5 * BLOCK + 3, 1)
    writer = Engine(daemon.address, "org/model")
    stored = _saved(writer, tokens, seed=1)
    writer.close()

    reader = Engine(daemon.address, "org/model")  # another vLLM: its KV cache is empty
    request = vllm_request("r", tokens)
    block_ids = reader.allocate(6)
    external, meta = reader.schedule(request, block_ids)
    assert external == 5 * BLOCK and meta.saves == []  # every full block is in the store already
    assert [(t.first, t.block_ids) for t in meta.loads] == [(0, block_ids[:5])]
    assert reader.forward(meta) == set()
    assert reader.pages(block_ids[:5]) == stored

    # vLLM's own prefix cache holds the first block: only the four after it are loaded
    partial = Engine(daemon.address, "org/model")
    block_ids = partial.allocate(6)
    external, meta = partial.schedule(vllm_request("p", tokens), block_ids, num_computed_tokens=BLOCK)
    assert external == 4 * BLOCK and [(t.first, t.block_ids) for t in meta.loads] == [(1, block_ids[1:5])]
    assert partial.forward(meta) == set()
    assert partial.pages(block_ids[1:5]) == stored[1:] and not partial.kv[0][block_ids[0]].any()

    # a prompt of whole blocks: its last token is computed by vLLM, so the last block is not offered
    exact = Engine(daemon.address, "org/model")
    external, _ = exact.schedule(vllm_request("e", tokens[: 5 * BLOCK]), exact.allocate(5))
    assert external == 4 * BLOCK
    for engine in (reader, partial, exact):
        engine.close()


def test_salts_models_and_layouts_keep_blocks_apart(daemons):
    (daemon,) = daemons(1)
    tokens = _tokens(3 * BLOCK + 1, 2)
    writer = Engine(daemon.address, "org/model")
    _saved(writer, tokens, seed=2, salt="tenant-a")
    writer.close()
    for model, salt, heads in [("org/model", "tenant-b", 2), ("org/model", None, 2), ("org/other", "tenant-a", 2),
                               ("org/model", "tenant-a", 4)]:
        other = Engine(daemon.address, model, heads=heads)
        external, meta = other.schedule(vllm_request("o", tokens, salt), other.allocate(4))
        assert external == 0 and meta.loads == [], (model, salt, heads)
        other.close()
    same = Engine(daemon.address, "org/model")
    assert same.schedule(vllm_request("s", tokens, "tenant-a"), same.allocate(4))[0] == 3 * BLOCK
    same.close()


def test_a_dead_daemon_mid_request_is_a_miss(daemons):
    (daemon,) = daemons(1)
    tokens = _tokens(4 * BLOCK + 5, 3)
    writer = Engine(daemon.address, "org/model")
    _saved(writer, tokens, seed=3)
    writer.close()
    reader = Engine(daemon.address, "org/model")
    block_ids = reader.allocate(5)
    external, meta = reader.schedule(vllm_request("r", tokens), block_ids)
    assert external == 4 * BLOCK
    daemon.kill()  # after the lookup found the blocks, before the forward pass loads them
    started = time.monotonic()
    assert reader.forward(meta) == set(block_ids[:4]), "every block that did not arrive is reported to vLLM"
    later = Engine(daemon.address, "org/model")
    assert later.schedule(vllm_request("l", tokens), later.allocate(5))[0] == 0  # a lookup: a miss
    later.worker.flush(MISS_DEADLINE_S)  # its saves went nowhere, without an exception
    assert time.monotonic() - started < MISS_DEADLINE_S
    reader.close()
    later.close()


# -- this project's prefill engine and vLLM share blocks ------------------------------------------------

QWEN3 = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 1024,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.fixture
def prefill(tmp_path):
    from engine.checkpoints.random_model import write_random_model
    from engine.prefill.config import PrefillConfig
    from engine.prefill.cost import ChunkCost
    from engine.prefill.engine import PrefillEngine

    write_random_model(tmp_path / "qwen3", QWEN3)

    def make(client):
        config = PrefillConfig(block_tokens=BLOCK, kv_pages=64, cost=ChunkCost(a=1e-7, b=1e-3, c=1e-3))
        return PrefillEngine.from_pretrained(tmp_path / "qwen3", client, config)  # float32 on the CPU

    return make


def _vllm_like(daemon, engine) -> Engine:
    """A vLLM of the prefill engine's model: its model identity, layers, heads, head size, dtype, block size."""
    mc = engine.model.config
    return Engine(daemon.address, engine.model_id, layers=len(mc.full_layers), heads=mc.num_kv_heads,
                  head_dim=mc.head_dim, dtype=torch.float32)


def _engine_pages(engine, result, blocks: int) -> list[bytes]:
    return [engine._payload(page) for page in result.kv.block_table[:blocks]]


def test_the_prefill_engine_and_the_connector_hit_each_others_blocks(daemons, prefill):
    from engine.prefill.request import CACHED, COLD, PrefillRequest
    from kvstore.client import ClientConfig, KVClient

    (daemon,) = daemons(1)
    with KVClient(ClientConfig((daemon.address,))) as client:
        engine = prefill(client)
        # the engine writes, vLLM reads
        tokens = _tokens(4 * BLOCK + 7, 4)
        result = engine.prefill(PrefillRequest(tokens))
        assert result.path == COLD
        client.write_behind.flush()
        expected = _engine_pages(engine, result, 4)
        result.kv.release()
        vllm = _vllm_like(daemon, engine)
        block_ids = vllm.allocate(5)
        external, meta = vllm.schedule(vllm_request("v", tokens), block_ids)
        assert external == 4 * BLOCK, "vLLM hits the engine's blocks"
        assert vllm.forward(meta) == set()
        assert vllm.pages(block_ids[:4]) == expected

        # vLLM writes, the engine reads
        other = _tokens(3 * BLOCK + 2, 5)
        stored = _saved(vllm, other, seed=5)
        result = engine.prefill(PrefillRequest(other))
        assert result.path == CACHED and result.loaded_tokens == 3 * BLOCK, "the engine hits vLLM's blocks"
        assert _engine_pages(engine, result, 3) == stored
        result.kv.release()
        vllm.close()
