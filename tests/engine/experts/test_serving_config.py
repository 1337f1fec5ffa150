"""Expert parallelism in the decode engine's config: what is refused, before any process is started. Fast; part of
make test (the served replies across real ranks: test_serving.py, make test-experts)."""

from __future__ import annotations

import pytest
import torch

from engine.decode import DecodeConfig, DecodeEngine
from engine.experts.decoder import ExpertParallelConfig
from engine.model.decoder import Decoder

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fields, message", [
    ({"expert_ranks": 0}, "expert_ranks must be an integer >= 1"),
    ({"expert_ranks": True}, "expert_ranks must be an integer >= 1"),
    ({"expert_ranks": 2, "experts": {"redundant_slots": 2}}, "experts must be an ExpertParallelConfig"),
    ({"experts": ExpertParallelConfig(rebalance_every=4)}, "needs expert_ranks > 1"),
])
def test_bad_expert_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**fields)


def test_a_dense_model_or_experts_that_do_not_divide_are_refused(tiny_models):
    config = DecodeConfig(speculative=False, kv_pages=4, expert_ranks=2)
    with pytest.raises(ValueError, match="dense MLP"):
        DecodeEngine(Decoder.from_pretrained(tiny_models["qwen3"].path, torch.float32), None, config)
    moe = Decoder.from_pretrained(tiny_models["gpt_oss"].path, torch.float32)
    with pytest.raises(ValueError, match="do not divide among 3 ranks"):  # 4 experts
        DecodeEngine(moe, None, DecodeConfig(speculative=False, kv_pages=4, expert_ranks=3))
    DecodeEngine(moe, None, DecodeConfig(speculative=False, kv_pages=4, expert_ranks=1)).close()  # one process
