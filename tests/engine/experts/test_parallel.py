"""Expert parallelism across real gloo ranks (spawned processes on loopback): the MoE layers equal the
single-process ones, greedy decoding is identical, and rebalancing while decoding changes no token.

Marked `experts` (make test-experts): each case starts 2 or 4 processes that import torch."""

from __future__ import annotations

import pytest

from engine.experts.launch import run_ranks
from engine.model.decoder import Decoder
from tests.engine.experts import ranks as rank_main
from tests.engine.greedy import greedy

pytestmark = pytest.mark.experts

PROMPTS = [[5, 17, 300, 41, 2, 99, 123], [7, 7, 8], [400, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
REPLY_TOKENS = 12


@pytest.mark.parametrize("ranks, redundant", [(2, 0), (2, 2), (4, 4)])
def test_moe_layers_equal_the_single_process_layers_before_and_after_weights_move(tiny_models, ranks, redundant):
    path = tiny_models["gpt_oss"].path
    results = run_ranks(rank_main.moe_layer, ranks, path, redundant, timeout_s=120)
    for result in results:
        assert result["before"] < 1e-5 and result["after"] < 1e-5, result
    assert results[0]["slots_changed"] > 0, "the skewed plan moved experts"
    assert sum(result["received"] for result in results) > 0, "weights travelled between ranks"
    if redundant:
        assert all(row[0] > 1 for row in results[0]["replicas"]), "the hot expert got replicas"


@pytest.mark.parametrize("ranks, redundant, rebalance_every", [(2, 2, 0), (4, 4, 0), (2, 2, 3), (4, 4, 3)])
def test_greedy_decoding_is_identical_to_one_process(tiny_models, ranks, redundant, rebalance_every):
    path = tiny_models["gpt_oss"].path
    alone = Decoder.from_pretrained(path, "float32")
    expected = [greedy(alone, PROMPTS[rank], REPLY_TOKENS) for rank in range(ranks)]
    results = run_ranks(rank_main.greedy, ranks, path, PROMPTS, REPLY_TOKENS, redundant, rebalance_every,
                        timeout_s=120)
    assert [result["reply"] for result in results] == expected
    if rebalance_every:
        assert len(results[0]["changed"]) == REPLY_TOKENS // rebalance_every
