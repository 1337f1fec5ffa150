"""Converting a Gemma 3 GGUF file, once, into the engine's model folder.

A GGUF holds quantised weights under llama.cpp's names, the config and the tokenizer as metadata. The
engine, and `transformers` as its reference, read a folder instead: `config.json`, `model.safetensors`,
`tokenizer.json` and `tokenizer_config.json` (with the chat template). Converting dequantises every tensor
to fp32 and renames it, rebuilds the tokenizer with transformers' GGUF converter (most of the minute it
takes), and writes the folder into a cache keyed by the file's sha256, atomically: a conversion killed
half-way leaves no entry. Later loads find the entry and read it in seconds.

    folder = convert(path_to_gguf)    # the converted folder; `python -m engine.checkpoints` on the command line

fp32, not bf16: a dequantised weight is an fp16 scale times a small integer (plus an fp16 offset), which
fp32 holds exactly and bf16 does not, so the folder computes the same logits as the GGUF itself.
Needs the `models` extra (gguf, transformers); the engine reading the folder needs neither.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvstore import faults

FORMAT = 1  # of the converted folder; bump it when what is written changes, and old entries are rebuilt
DTYPE = "float32"
CACHE_ENV = "KVSTORE_MODEL_CACHE"
SOURCE_FILE = "source.json"  # written last: its presence with the right digest and format marks a whole entry
FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", SOURCE_FILE)
INSTALL_HINT = "pip install -e '.[models]' (make install does)"

Progress = Callable[[str], None]

# llama.cpp's Gemma 3 names -> transformers' Gemma3ForCausalLM names, inside `blk.N.` / `model.layers.N.`
_LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}

# Every `gemma3.*` key the conversion reads; another one describes something it would silently drop.
_ARCH_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "attention.sliding_window", "rope.scaling.type",
    "rope.scaling.factor",
})

# What llama.cpp hard-codes for Gemma 3, and so no GGUF states: the RoPE base of sliding layers, one full
# layer in six, the tanh GELU.
_LOCAL_ROPE_BASE = 10_000.0
_SLIDING_PATTERN = 6

# Gemma 3's chat template, text only (the published models' own, less the image parts); used where the
# GGUF carries none, as the packaged one does not.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- else -%}
                {{ raise_exception("Only text content is supported") }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """Where converted models live: `cache_dir`, else $KVSTORE_MODEL_CACHE, else ~/.cache/kvstore/models."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser().absolute()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().absolute()
    return Path.home() / ".cache" / "kvstore" / "models"


def entry_name(gguf_name: str, sha256: str) -> str:
    """The cache entry's folder name: the file's name and its digest, so no two files share an entry."""
    return f"{Path(gguf_name).name.removesuffix('.gguf')}-{sha256[:16]}"


def find_converted(gguf_name: str, sha256: str, cache_dir: Path | str | None = None) -> Path | None:
    """The whole, current-format entry converted from the file with this name and sha256, or None."""
    entry = cache_root(cache_dir) / entry_name(gguf_name, sha256)
    try:
        source = json.loads((entry / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    whole = all((entry / name).is_file() for name in FOLDER_FILES)
    return entry if whole and source.get("format") == FORMAT and source.get("gguf_sha256") == sha256 else None


def convert(gguf: Path | str, cache_dir: Path | str | None = None, progress: Progress | None = None) -> Path:
    """The converted folder of the GGUF file `gguf`: from the cache, or converted now and cached.

    Side effects: may write a new cache entry (about 1.1 GB for Gemma 3 270M) under `cache_root(cache_dir)`,
    and removes what killed conversions left there. Conversions into one cache take turns on its lock
    file, so concurrent callers convert a file once and the others then find the entry. Raises ValueError
    naming the file where it is missing, damaged, not Gemma 3, or its tokenizer does not fit its weights."""
    report = progress or _print_progress
    path = Path(gguf)
    _check_magic(path)
    sha256 = sha256_of(path)
    if found := find_converted(path.name, sha256, cache_dir):
        return found
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    entry = root / entry_name(path.name, sha256)
    with _locked(root / ".convert.lock"):
        if found := find_converted(path.name, sha256, cache_dir):  # converted while we waited
            return found
        for stale in root.glob(".*.tmp-*"):  # left by killed conversions, since no other one runs now
            shutil.rmtree(stale, ignore_errors=True)
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=root))
        try:
            _convert_into(path, staging, report)
            _write_json(staging / SOURCE_FILE, {"format": FORMAT, "gguf": path.name, "gguf_sha256": sha256,
                                                "dtype": DTYPE, "seconds": round(time.monotonic() - started, 1)})
            _fsync_tree(staging)
            staging.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache from other users
            if entry.exists():  # an older format's entry: replaced, never half-overwritten
                shutil.rmtree(entry)
            os.rename(staging, entry)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    report(f"converted {path.name} in {time.monotonic() - started:.0f} s -> {entry}")
    return entry


def _convert_into(path: Path, out: Path, report: Progress) -> None:
    """Write the folder's files for the GGUF at `path` into the empty folder `out`."""
    reader = _read(path)
    metadata = _metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture != "gemma3":
        raise ValueError(f"{path}: general.architecture is {architecture!r}; the engine converts only Gemma 3 "
                         "('gemma3') GGUF files. Use a Gemma 3 GGUF, or give the engine a folder of safetensors "
                         "weights and config.json")
    config = gemma3_config(metadata, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    _check_tensors(path, tensors, config)
    _check_vocabulary(path, metadata, config)
    _write_json(out / "config.json", config)

    save_file = _require("safetensors.numpy").save_file

    weights: dict[str, np.ndarray] = {}
    for done, (name, tensor) in enumerate(sorted(tensors.items()), 1):
        weights[_hf_name(name)] = _dequantised(tensor)
        if done % 40 == 0 or done == len(tensors):
            report(f"dequantising {path.name}: {done}/{len(tensors)} tensors")
    report(f"writing {out.name}/model.safetensors ({sum(w.nbytes for w in weights.values()) / 2**30:.2f} GiB)")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    del weights
    faults.hit("gguf_convert.after_weights")
    report("building the tokenizer from the GGUF vocabulary (about a minute on 2 cores)")
    _write_tokenizer(path, out, metadata, config["vocab_size"])


def gemma3_config(metadata: dict, path: Path | str) -> dict:
    """transformers' Gemma3TextConfig, as config.json, from a Gemma 3 GGUF's metadata.

    Sets every field the engine reads, even where it equals the class default: a default is one
    checkpoint's value and would silently apply to another."""
    unknown = sorted(key for key in metadata if key.startswith("gemma3.") and key[len("gemma3."):] not in _ARCH_KEYS)
    if unknown:
        raise ValueError(f"{path}: GGUF metadata {', '.join(unknown)} describes what the converter does not "
                         "implement; the engine refuses what it would ignore. Use a plain Gemma 3 text GGUF")

    def key(name: str, default: float | None = None) -> float:  # each key read here is a number (int or float)
        value = metadata.get(f"gemma3.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata gemma3.{name} is missing; the file is incomplete, "
                             "convert it again from the original checkpoint")
        return value

    layers, hidden, heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length"))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{path}: key_length {head_dim} differs from value_length "
                         f"{metadata['gemma3.attention.value_length']}; Gemma 3 has one head_dim")
    full_rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base"))}
    factor = float(metadata.get("gemma3.rope.scaling.factor", 1.0))
    scaling = metadata.get("gemma3.rope.scaling.type", "linear" if factor != 1.0 else "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{path}: gemma3.rope.scaling.type {scaling!r} is not Gemma 3's (linear or none)")
    if scaling == "linear" and factor != 1.0:  # the larger Gemma 3 models stretch their full layers' RoPE
        full_rope = {"rope_type": "linear", "rope_theta": full_rope["rope_theta"], "factor": factor}
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv")),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden/heads) for the 62-layer 27B alone
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % _SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_parameters": {"full_attention": full_rope,
                            "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_BASE}},
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": True,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "dtype": DTYPE,
    }


def expected_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Every GGUF tensor of a Gemma 3 with this config, by llama.cpp name, with its shape in row-major order."""
    h, d, i_ = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = {"attn_q.weight": (q, h), "attn_k.weight": (kv, h), "attn_v.weight": (kv, h), "attn_output.weight": (h, q),
             "attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,), "attn_norm.weight": (h,),
             "post_attention_norm.weight": (h,), "ffn_norm.weight": (h,), "post_ffw_norm.weight": (h,),
             "ffn_gate.weight": (i_, h), "ffn_up.weight": (i_, h), "ffn_down.weight": (h, i_)}
    shapes = {"token_embd.weight": (config["vocab_size"], h), "output_norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _check_tensors(path: Path, tensors: dict, config: dict) -> None:
    """Every tensor present is one Gemma 3 has, at its shape, and none is missing: nothing is dropped."""
    wanted = expected_tensors(config)
    if unknown := sorted(set(tensors) - set(wanted)):
        what = " (an untied output head, which Gemma 3 does not have)" if "output.weight" in unknown else ""
        raise ValueError(f"{path}: tensors {unknown[:3]}{what} are not part of Gemma 3 as the engine converts it "
                         f"({len(unknown)} in all); the converter refuses what it would drop")
    if missing := sorted(set(wanted) - set(tensors)):
        raise ValueError(f"{path}: {len(missing)} tensors missing, e.g. {missing[:3]}; the file is incomplete")
    for name, shape in wanted.items():
        found = tuple(int(n) for n in reversed(tensors[name].shape))  # GGUF lists dimensions innermost first
        if name == "token_embd.weight" and found[1:] == shape[1:] and found[0] != shape[0]:
            raise ValueError(f"{path}: the tokenizer has {shape[0]} tokens but the embedding (token_embd.weight) "
                             f"has {found[0]} rows: the tokenizer does not belong to these weights. Use the GGUF "
                             "file as published, with its own vocabulary")
        if found != shape:
            raise ValueError(f"{path}: {name} has shape {found}, the file's metadata implies {shape}; "
                             "the file is inconsistent, convert it again from the original checkpoint")


def _check_vocabulary(path: Path, metadata: dict, config: dict) -> None:
    if metadata.get("tokenizer.ggml.model") != "llama":  # llama.cpp's name for a sentencepiece vocabulary
        raise ValueError(f"{path}: tokenizer.ggml.model is {metadata.get('tokenizer.ggml.model')!r}; Gemma 3's "
                         "tokenizer is sentencepiece ('llama'). The tokenizer does not belong to these weights")
    for name in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if len(metadata.get(name) or []) != config["vocab_size"]:
            raise ValueError(f"{path}: {name} has {len(metadata.get(name) or [])} entries for "
                             f"{config['vocab_size']} tokens; the tokenizer metadata is damaged")


def _write_tokenizer(path: Path, out: Path, metadata: dict, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json (holding the chat template), built by transformers' GGUF
    tokenizer converter: the tokenizer the reference itself uses for this file."""
    transformers = _require("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # it warns about each GGUF key it does not map
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    finally:
        transformers.logging.set_verbosity(verbosity)
    if len(tokenizer) != vocab_size:
        raise ValueError(f"{path}: the tokenizer built from the file has {len(tokenizer)} tokens, the weights "
                         f"{vocab_size}: the tokenizer does not belong to these weights")
    tokenizer.chat_template = metadata.get("tokenizer.chat_template") or GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the template inside tokenizer_config.json


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{_LAYER_TENSORS[rest]}"


def _dequantised(tensor) -> np.ndarray:
    """The tensor in fp32, row-major; Gemma's norm weights back to transformers' form."""
    dequantize = _require("gguf").dequantize
    shape = tuple(int(n) for n in reversed(tensor.shape))
    weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)
    # llama.cpp stores 1 + w for an RMSNorm computing x·(1 + w); transformers keeps w (as its own GGUF
    # loader does: the same float32 subtraction, so the same bits)
    return weight - np.float32(1) if tensor.name.endswith("norm.weight") else weight


def _check_magic(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such GGUF file. Install the packaged model with {INSTALL_HINT}, "
                         "or pass the path of a Gemma 3 .gguf file") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read the GGUF file ({error.strerror})") from None
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); it is damaged or "
                         "something else. Download or assemble it again")


def _read(path: Path):
    reader = _require("gguf").GGUFReader
    try:
        return reader(path)
    except Exception as error:  # a damaged file fails anywhere in the parser, with any error type
        raise ValueError(f"{path}: cannot read the GGUF file ({type(error).__name__}: {error}); it is "
                         "truncated or damaged. Download or assemble it again") from None


def _metadata(reader) -> dict:
    """Every metadata field as a Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _require(module: str):
    """A module of the `models` extra, or a ValueError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"converting a GGUF needs {module.split('.')[0]}: {INSTALL_HINT}") from None


def sha256_of(path: Path) -> str:
    """The file's sha256, hex: the cache key (the digest the model package publishes)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def _fsync_tree(folder: Path) -> None:
    for file in folder.iterdir():
        file.chmod(0o644)  # safetensors writes 0o600
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _print_progress(message: str) -> None:
    print(f"[convert] {message}", file=sys.stderr, flush=True)
