"""The generated workloads: seeded, valid traces, shaped like the conversation trace, each with its structure."""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import numpy as np
import pytest

from kvstore.analytics.trace import read_trace
from kvstore.analytics.workloads import DURATION_S, KINDS, TraceShape, conversation_shape, generate, write_trace

SCALE = 0.1


@pytest.fixture(scope="module")
def workloads() -> dict:
    return {kind: generate(kind, seed=3, scale=SCALE) for kind in KINDS}


def full(request) -> tuple:
    return request.hash_ids[: request.input_length // 512]


def test_seeded(workloads):
    assert generate("mix", seed=3, scale=SCALE) == workloads["mix"]
    assert generate("mix", seed=4, scale=SCALE) != workloads["mix"]
    with pytest.raises(ValueError):
        generate("video")


@pytest.mark.parametrize("kind", KINDS)
def test_valid_traces_in_time_order(workloads, kind, tmp_path):
    requests = workloads[kind]
    assert len(requests) > 50
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in requests)
    assert all(r.input_length % 512 for r in requests)  # every prompt ends in a partial block
    times = [r.timestamp_ms for r in requests]
    assert times == sorted(times) and times[0] >= 0
    tails = [r.hash_ids[-1] for r in requests]
    assert len(set(tails)) == len(tails)  # the partial block is each prompt's own
    write_trace(requests, tmp_path / "w.jsonl")
    assert list(read_trace(tmp_path / "w.jsonl")) == requests


def test_shaped_like_the_conversation_trace():
    trace = conversation_shape()
    chat = TraceShape.from_requests(generate("chat", seed=3, scale=0.3))
    # gaps between turns and growth are drawn from the trace: their medians match it
    assert np.median(chat.turn_gaps_s) == pytest.approx(np.median(trace.turn_gaps_s), rel=0.2)
    assert np.median(chat.output_lengths) == pytest.approx(np.median(trace.output_lengths), rel=0.1)
    assert np.mean(chat.turns) == pytest.approx(np.mean(trace.turns), rel=0.25)
    # agents come back within seconds: their gaps are the trace's / 20
    agent = TraceShape.from_requests(generate("agent", seed=3, scale=0.3))
    assert np.median(agent.turn_gaps_s) == pytest.approx(np.median(trace.turn_gaps_s) / 20, rel=0.3)
    assert np.min(agent.turns) >= 5


def test_chat_sessions_share_a_few_system_prompts(workloads):
    roots = Counter(r.hash_ids[0] for r in workloads["chat"])
    assert len(roots) <= 4 and min(roots.values()) > 1
    # and a later turn extends an earlier prompt of its session
    prompts = {full(r) for r in workloads["chat"]}
    extended = sum(any(full(r)[:n] in prompts for n in range(2, len(full(r)))) for r in workloads["chat"])
    assert extended > 0.2 * len(workloads["chat"])


def test_agents_share_long_tool_prefixes(workloads):
    requests = workloads["agent"]
    assert all(len(full(r)) >= 9 for r in requests)  # 8+ blocks of tools and a task
    by_prefix = Counter(full(r)[:8] for r in requests)
    assert len(by_prefix) <= 3 and all(count > 10 for count in by_prefix.values())


def test_rag_users_share_documents(workloads):
    requests = workloads["rag"]
    assert len({r.hash_ids[0] for r in requests}) == 1  # one system prompt
    users_per_document = Counter(full(r)[2] for r in requests if len(full(r)) > 2)  # a document's first block
    top = users_per_document.most_common(1)[0][1]
    assert top > 0.05 * len(requests)  # Zipf: the most popular document is read by many
    # requests through one document share its whole prefix (2 system blocks, 8+ of the document)
    by_document = defaultdict(list)
    for r in requests:
        by_document[full(r)[2]].append(full(r))
    shared = [len(os.path.commonprefix(prompts)) for prompts in by_document.values() if len(prompts) > 1]
    assert shared and min(shared) >= 10


def test_trees_are_independent_and_long(workloads):
    requests = workloads["trees"]
    roots = defaultdict(list)
    for r in requests:
        roots[r.hash_ids[0]].append(r)
    assert len(roots) == round(1500 * SCALE)  # one tree per session: no block shared between two
    trace_median = np.median(conversation_shape().first_blocks)
    assert np.median([len(full(r)) for r in requests]) > 2 * trace_median  # longer prompts than the trace
    blocks_of = {root: {k for r in rs for k in r.hash_ids} for root, rs in roots.items()}
    seen: set = set()
    for blocks in blocks_of.values():
        assert not blocks & seen
        seen |= blocks
    assert any(len({full(r)[-1] for r in rs}) > 1 for rs in roots.values())  # questions branch from a context


def test_mix_has_every_kind(workloads):
    mix = workloads["mix"]
    assert {r.traffic_class for r in mix} == {"chat", "agent"}
    assert max(r.timestamp_ms for r in mix) < 2 * DURATION_S * 1000
    assert len({r.hash_ids[0] for r in mix}) > round(1500 * 0.2 * SCALE)  # the trees' roots and the shared
