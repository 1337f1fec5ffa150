"""The vLLM KV connector built by vLLM's own factory: the scheduler side on real vLLM Requests and
SchedulerOutputs, the worker side on CPU KV tensors (vLLM's CPU attention layout) through a real
ForwardContext, over a real daemon (`make test-connectors` and `make test-vllm`, in the vLLM venvs):
one group of full-attention layers, and a sliding-window hybrid's groups under vLLM's hybrid manager."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks a platform
pytest.importorskip("vllm", reason="the vLLM venv: make test-connectors")
torch = pytest.importorskip("torch")

from tests.connectors.vllm_harness import Engine, layer_name, vllm_request  # noqa: E402

pytestmark = pytest.mark.connectors

BLOCK = 16
MISS_DEADLINE_S = 30.0  # a hang guard on waits that a dead daemon ends: the client's own deadlines end them first


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fill(engine: Engine, block_ids: list[int] | list[list[int]], seed: int):
    """`compute(layer)`: the attention layer writing new KV into its pages of `block_ids` (its group's,
    where there are several)."""
    generator = torch.Generator().manual_seed(seed)

    def compute(layer: int) -> None:
        ids = block_ids[engine.group_of(layer)] if isinstance(block_ids[0], list) else block_ids
        pages = engine.kv[layer][ids]
        engine.kv[layer][ids] = torch.randn(pages.shape, generator=generator).to(pages.dtype)

    return compute


def _saved(engine: Engine, tokens: list[int], seed: int, salt: str | None = None) -> list[bytes]:
    """A cold prefill of `tokens` through `engine`: its full blocks' KV, as saved (and flushed)."""
    request = vllm_request(f"save-{seed}", tokens, salt)
    block_ids = engine.allocate(-(-len(tokens) // BLOCK))
    external, meta = engine.schedule(request, block_ids)
    assert external == 0 and meta.loads == []
    assert [(s.first, s.block_ids[0]) for s in meta.saves] == [(0, block_ids[: len(tokens) // BLOCK])]
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
    assert [(t.first, t.block_ids[0]) for t in meta.loads] == [(0, block_ids[:5])]
    assert reader.forward(meta) == set()
    assert reader.pages(block_ids[:5]) == stored

    # vLLM's own prefix cache holds the first block: only the four after it are loaded
    partial = Engine(daemon.address, "org/model")
    block_ids = partial.allocate(6)
    external, meta = partial.schedule(vllm_request("p", tokens), block_ids, num_computed_tokens=BLOCK)
    assert external == 4 * BLOCK and [(t.first, t.block_ids[0]) for t in meta.loads] == [(1, block_ids[1:5])]
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
    # a caller's cache_salt is not a tenant: a deployment whose tenant is "tenant-a" reads none of it
    deployment = Engine(daemon.address, "org/model", tenant="tenant-a")
    assert deployment.schedule(vllm_request("d", tokens), deployment.allocate(4))[0] == 0
    # and within a tenant, the caller's salt still keys its blocks apart
    _saved(deployment, tokens, seed=2)
    for salt, expected in [(None, 3 * BLOCK), ("tenant-a", 0), ("other", 0)]:
        assert deployment.schedule(vllm_request(f"t{salt}", tokens, salt), deployment.allocate(4))[0] == expected
    deployment.close()


@pytest.mark.kills_daemons  # left dead on purpose: a dead daemon is what it tests
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
    assert reader.forward(meta) == set(block_ids[:4]), "every block that did not arrive is reported to vLLM"
    later = Engine(daemon.address, "org/model")
    assert later.schedule(vllm_request("l", tokens), later.allocate(5))[0] == 0  # a lookup: a miss
    later.worker.flush(MISS_DEADLINE_S)  # its saves went nowhere, without an exception
    reader.close()
    later.close()


# -- a sliding-window hybrid under vLLM's hybrid KV-cache manager ----------------------------------------

WINDOW = 2 * BLOCK  # tokens; a resume reads the window layers of the cdiv(WINDOW - 1, BLOCK) = 2 blocks before it
HYBRID = {"layers": 3, "window_layers": (1,), "sliding_window": WINDOW}
FULL_LAYERS, WINDOW_LAYERS = [0, 2], [1]


def _hybrid_ids(engine: Engine, blocks: int, resume: int = 0) -> list[list[int]]:
    """A request's block ids per group, as vLLM's hybrid manager allocates them for a resume at `resume`
    blocks: the window group's blocks before the window are the null block."""
    window_start = max(0, resume - 2)
    return [engine.allocate(blocks), [0] * window_start + engine.allocate(blocks - window_start)]


def test_a_hybrid_prompts_first_chunk_ending_before_its_window_saves_full_blocks_alone(daemons):
    """Chunked prefill: a step that ends before the prompt's last window begins has no window blocks to save
    (a negative count of them once raised out of save_kv_layer, into vLLM's forward pass)."""
    (daemon,) = daemons(1)
    tokens = _tokens(10 * BLOCK + 1, 9)
    writer = Engine(daemon.address, "org/hybrid", **HYBRID)
    ids = _hybrid_ids(writer, 11)
    _, meta = writer.schedule(vllm_request("w", tokens), ids, chunk=4 * BLOCK)
    (save,) = meta.saves
    assert (save.first, save.end, save.window_first) == (0, 4, 4)
    assert writer.forward(meta, _fill(writer, ids, seed=9)) == set()
    assert writer.worker.flush(30)
    writer.close()
    reader = Engine(daemon.address, "org/hybrid", **HYBRID)
    external, _ = reader.schedule(vllm_request("r", tokens), _hybrid_ids(reader, 11, resume=4))
    assert external == 0, "four full blocks and no window: nothing to resume from exactly"
    reader.close()


def test_a_hybrid_stores_full_blocks_and_each_prompt_end_window_and_resumes_exactly(daemons):
    (daemon,) = daemons(1)
    tokens = _tokens(6 * BLOCK + 3, 6)
    writer = Engine(daemon.address, "org/hybrid", **HYBRID)
    ids = _hybrid_ids(writer, 7)
    external, meta = writer.schedule(vllm_request("w", tokens), ids)
    assert external == 0 and not writer.asynchronous
    (save,) = meta.saves
    assert (save.first, save.end, save.window_first) == (0, 6, 3), "window layers of the last 3 blocks only"
    assert writer.forward(meta, _fill(writer, ids, seed=6)) == set()
    assert writer.worker.flush(30)
    full = writer.pages(ids[0][:6], FULL_LAYERS)
    window = writer.pages(ids[1][3:6], WINDOW_LAYERS)
    writer.close()

    reader = Engine(daemon.address, "org/hybrid", **HYBRID)
    ids = _hybrid_ids(reader, 7, resume=6)
    external, meta = reader.schedule(vllm_request("r", tokens), ids)
    assert external == 6 * BLOCK and reader.asynchronous, "several groups: the load is asynchronous"
    (load,) = meta.loads
    assert (load.first, load.end, load.window_first) == (0, 6, 4)
    reader.forward(meta)
    assert reader.receive() == ({"r"}, set())
    assert reader.pages(ids[0][:6], FULL_LAYERS) == full
    assert reader.pages(ids[1][4:6], WINDOW_LAYERS) == window[1:], "the window the resume's next token reads"
    reader.close()

    # a longer prompt resumes at the stored prompt's end; one that leaves it inside its window, one block
    # earlier; one that leaves it before the stored window has no exact state to resume from: a miss
    for name, other, resume in [("next-turn", tokens + _tokens(BLOCK, 8), 6),
                                ("diverges-in-window", tokens[: 5 * BLOCK] + _tokens(2 * BLOCK, 9), 5),
                                ("diverges-before", tokens[: 3 * BLOCK] + _tokens(3 * BLOCK, 10), 0)]:
        engine = Engine(daemon.address, "org/hybrid", **HYBRID)
        external, _ = engine.schedule(vllm_request(name, other), _hybrid_ids(engine, 8, resume=resume))
        assert external == resume * BLOCK, name
        engine.close()


@pytest.mark.kills_daemons  # left dead on purpose: a dead daemon is what it tests
def test_a_hybrid_load_that_fails_is_reported_for_recomputation(daemons):
    (daemon,) = daemons(1)
    tokens = _tokens(4 * BLOCK + 1, 11)
    writer = Engine(daemon.address, "org/hybrid", **HYBRID)
    ids = _hybrid_ids(writer, 5)
    _, meta = writer.schedule(vllm_request("w", tokens), ids)
    writer.forward(meta, _fill(writer, ids, seed=11))
    assert writer.worker.flush(30)
    writer.close()
    reader = Engine(daemon.address, "org/hybrid", **HYBRID)
    external, meta = reader.schedule(vllm_request("r", tokens), _hybrid_ids(reader, 5, resume=4))
    assert external == 4 * BLOCK
    daemon.kill()  # after the lookup found the blocks, before the load
    reader.forward(meta)
    assert reader.receive() == ({"r"}, {"r"}), "finished and failed: vLLM recomputes the prompt"
    reader.close()


def test_groups_the_connector_cannot_store_exactly_are_refused_at_start(daemons):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvstore.connectors.vllm_connector import stored_groups

    def config(*specs):
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([layer_name(i)], spec) for i, spec in enumerate(specs)])

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float16,))
    with pytest.raises(ValueError, match="MambaSpec"):
        stored_groups(config(full, mamba))
    with pytest.raises(ValueError, match="head size"):
        stored_groups(config(FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, head_size_v=4,
                                               dtype=torch.float16)))
    # the hybrid manager off: one group whose layers keep a window, stored whole, every layer every block
    whole = stored_groups(config(FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16,
                                                   sliding_window=32)))
    assert whole.full_layers == (layer_name(0),) and whole.window_layers == () and not whole.hybrid


# -- this project's prefill engine and vLLM's CPU pages ---------------------------------------------------

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


def test_the_prefill_engine_and_vllms_cpu_pages_never_meet(daemons, prefill):
    """The engine's page is [2, block, heads, head_dim]; vLLM's CPU attention keeps [heads, block, 2 * head_dim]:
    the same bytes in another order. The page layout is in the namespace, so neither reads the other's."""
    from engine.prefill.request import COLD, PrefillRequest
    from kvstore.client import ClientConfig, KVClient

    (daemon,) = daemons(1)
    with KVClient(ClientConfig((daemon.address,))) as client:
        engine = prefill(client)
        tokens = _tokens(4 * BLOCK + 7, 4)
        result = engine.prefill(PrefillRequest(tokens))
        assert result.path == COLD
        client.write_behind.flush()
        result.kv.release()
        vllm = _vllm_like(daemon, engine)
        external, _ = vllm.schedule(vllm_request("v", tokens), vllm.allocate(5))
        assert external == 0, "vLLM's CPU pages are not the engine's: no hit"
        other = _tokens(3 * BLOCK + 2, 5)
        _saved(vllm, other, seed=5)
        result = engine.prefill(PrefillRequest(other))
        assert result.path == COLD, "the engine does not read vLLM's CPU pages"
        result.kv.release()
        assert vllm.schedule(vllm_request("again", other), vllm.allocate(4))[0] == 3 * BLOCK  # vLLM's own: a hit
        vllm.close()
