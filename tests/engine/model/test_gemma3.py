"""Gemma 3 (text) against transformers' Gemma3ForCausalLM on the same weights: alone, chunked, batched and
through the store; and its config read as transformers reads it, or refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.decoder import Chunk, Decoder
from engine.model.kv import PagePool, RequestKV
from engine.prefill.config import PrefillConfig
from engine.prefill.cost import ChunkCost
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import CACHED, COLD, PrefillRequest
from kvstore.client import ClientConfig, KVClient
from tests.engine.conftest import GEMMA3_WINDOW as WINDOW
from tests.engine.conftest import VOCAB, build_gemma3

RELATIVE = 1e-5  # max abs logit difference over the spread (std) of the reference's logits, fp32
BLOCK = 8  # half the window: blocks and window edges fall at different places

# gemma-3-270m's config.json as published on the Hub (the format before transformers 5)
HUB_270M = {
    "_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640,
    "initializer_range": 0.02, "intermediate_size": 2048,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 18, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0,
    "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 512, "torch_dtype": "bfloat16",
    "transformers_version": "4.55.0.dev0", "use_bidirectional_attention": False, "use_cache": True,
    "vocab_size": 262144,
}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: Decoder, tokens: list[int], cuts: list[int] = ()) -> torch.Tensor:
    """All-position logits (n, vocab), computed in chunks ending at `cuts`."""
    kv = RequestKV(model.config, PagePool(model.config, 64, BLOCK, torch.float32))
    kv.reserve(len(tokens))
    out, start = [], 0
    for end in [*cuts, len(tokens)]:
        out.append(model.forward([Chunk(kv, torch.tensor(tokens[start:end]), start)], all_logits=True)[0])
        start = end
    return torch.cat(out)


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return (ours - reference).abs().max().item() / reference.std().item()


@pytest.mark.unit
@pytest.mark.parametrize("length", [9, WINDOW, WINDOW + 1, 200])  # shorter than, as long as, past the window
def test_logits_match_transformers(tiny_gemma3, length):
    model = Decoder.from_pretrained(tiny_gemma3.path, torch.float32)
    assert model.config.full_layers == [5, 11] and model.config.sliding_window == WINDOW
    tokens = _prompt(length, length)
    reference = tiny_gemma3.logits(tokens)
    assert reference.std() > 1.0  # logits spread widely enough for the tolerance to mean something
    assert _relative_error(_run(model, tokens), reference) <= RELATIVE


@pytest.mark.unit
def test_uneven_chunks_match_transformers(tiny_gemma3):
    # chunks of one token, inside a window, across window and block edges, and longer than the window
    model = Decoder.from_pretrained(tiny_gemma3.path, torch.float32)
    tokens = _prompt(200, 7)
    ours = _run(model, tokens, [1, 7, 16, 17, 33, 50, 51, 120])
    assert _relative_error(ours, tiny_gemma3.logits(tokens)) <= RELATIVE


@pytest.mark.unit
def test_one_step_of_several_requests_matches_each_alone(tiny_gemma3):
    model = Decoder.from_pretrained(tiny_gemma3.path, torch.float32)
    prompts = [_prompt(n, n) for n in (5, 70, WINDOW + 1)]
    pool = PagePool(model.config, 64, BLOCK, torch.float32)
    kvs = [RequestKV(model.config, pool) for _ in prompts]
    for kv, prompt in zip(kvs, prompts):
        kv.reserve(len(prompt))
    last = model.forward([Chunk(kv, torch.tensor(p), 0) for kv, p in zip(kvs, prompts)])
    for logits, prompt in zip(last, prompts):
        assert _relative_error(logits, tiny_gemma3.logits(prompt)[-1]) <= RELATIVE


@pytest.mark.unit
@pytest.mark.parametrize("wrong", [
    {"sliding_window": WINDOW + 1},  # one position more in the window
    {"rope_local_theta": None},  # sliding layers rotated with the global base
    {"query_pre_attn_scalar": None},  # scores scaled by head_dim instead
])
def test_a_wrong_gemma3_detail_is_caught(tiny_gemma3, wrong):
    # the reference check can fail: each detail moves the logits far beyond the tolerance
    right = Decoder.from_pretrained(tiny_gemma3.path, torch.float32)
    model = Decoder(replace(right.config, **wrong), right.w)
    tokens = _prompt(60, 3)
    assert _relative_error(_run(model, tokens), tiny_gemma3.logits(tokens)) > 100 * RELATIVE


@pytest.mark.unit
def test_linear_rope_scaling_of_full_layers_matches_transformers(tmp_path):
    # as the larger Gemma 3 sizes set it: factor 8 on full layers, the sliding layers unscaled
    tiny = build_gemma3(tmp_path / "linear", seed=4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                        num_hidden_layers=6)
    model = Decoder.from_pretrained(tiny.path, torch.float32)
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    tokens = _prompt(80, 4)
    assert _relative_error(_run(model, tokens, [30]), tiny.logits(tokens)) <= RELATIVE


@pytest.mark.unit
@pytest.mark.parametrize("dropped, changes", [
    ((), {}),
    (("layer_types",), {"sliding_window_pattern": 3}),  # the pattern decides
    ((), {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 20000.0}),
])
def test_config_reads_as_transformers_reads_it(dropped, changes):
    import transformers

    raw = {name: value for name, value in HUB_270M.items() if name not in dropped} | changes
    ours = ModelConfig.from_dict(raw)
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "torch_dtype")})
    assert list(ours.layer_types) == theirs.layer_types
    assert ours.sliding_window == theirs.sliding_window == 512
    assert ours.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert ours.rope_local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.rope_scaling.get("factor") == theirs.rope_parameters["full_attention"].get("factor")
    assert (ours.query_pre_attn_scalar, ours.tie_word_embeddings) == (theirs.query_pre_attn_scalar, True)
    assert (ours.head_dim, ours.num_kv_heads, ours.embedding_scale) == (256, 1, 640 ** 0.5)


@pytest.mark.unit
@pytest.mark.parametrize("field, value", [
    ("final_logit_softcapping", 30.0),
    ("attn_logit_softcapping", 50.0),
    ("use_bidirectional_attention", True),
    ("hidden_activation", "gelu"),
    ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
])
def test_what_the_engine_does_not_implement_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field if field != "rope_parameters" else "sliding_attention"):
        ModelConfig.from_dict(HUB_270M | {field: value})


@pytest.mark.integration
def test_through_the_store_cold_then_warm_from_host_and_from_a_restarted_daemon(tiny_gemma3, daemons):
    # turns that resume inside the first window, just past it and far past it; then the daemon restarts and
    # the last turn's prefix comes from its SSD while the window state comes from the engine's window tier
    (daemon,) = daemons(1)
    config = PrefillConfig(block_tokens=BLOCK, kv_pages=64, cost=ChunkCost(a=1e-7, b=1e-3, c=1e-3),
                           step_budget_s=0.05)  # small steps: the longer turns are cut into chunks
    conversation = _prompt(150, 9)
    turns = [10, WINDOW + 3, 60, 150]

    def check(result, length):
        reference = tiny_gemma3.logits(conversation[:length])[-1]
        assert _relative_error(result.logits, reference) <= RELATIVE
        assert result.first_token == int(reference.argmax())
        result.kv.release()

    engine = PrefillEngine.from_pretrained(tiny_gemma3.path, None, config, torch.float32)
    host = {"host_tier_bytes": 64 * engine.block_bytes, "host_block_bytes": engine.block_bytes}
    with KVClient(ClientConfig(servers=(daemon.address,), **host)) as client:
        engine.client = client
        for turn, length in enumerate(turns[:-1]):
            result = engine.prefill(PrefillRequest(conversation[:length], session_id="s"))
            previous = turns[turn - 1] // BLOCK if turn else 0
            assert (result.path, result.loaded_tokens) == ((CACHED, previous * BLOCK) if turn else (COLD, 0))
            assert result.sources == ({"host": previous} if turn else {})
            check(result, length)
            assert client.write_behind.flush()
    daemon.stop()
    daemon.start()
    with KVClient(ClientConfig(servers=(daemon.address,))) as client:
        engine.client = client
        result = engine.prefill(PrefillRequest(conversation, session_id="s"))
        assert result.path == CACHED and result.sources == {"daemon": turns[2] // BLOCK}
        assert result.chunks > 1  # the step budget cut the rest of the prompt
        check(result, turns[-1])
