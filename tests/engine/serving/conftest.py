"""A tiny random Qwen3 for the serving loop and the decode instances, and waiting without timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.checkpoints.random_model import write_random_model
from tests.waiting import wait_for

VOCAB, CONTEXT, PAGES, BLOCK = 512, 8192, 128, 64
MODEL = {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
         "max_position_embeddings": CONTEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def idle(load) -> dict:
    """Wait until `load()` reports nothing running, queued or held; that load."""
    return wait_for(lambda: (now := load())["running"] + now["waiting"] == 0 and now["kv_tokens"] == 0 and now,
                    "nothing in flight")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serving") / "model"
    write_random_model(path, MODEL)
    return path
