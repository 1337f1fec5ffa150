"""A seeded family of generated request traces, to check eviction policies on traffic we have no trace of.

Every kind is built from the shape of the Mooncake conversation trace (`traces/conversation_trace.jsonl`):
prompt lengths, growth between turns, the gaps between turns, turns per conversation and reply lengths
are drawn from its empirical distributions (`TraceShape.from_requests`), not fitted. What differs
between kinds is the structure of the prefixes and of the sessions:

* `chat`: sessions behind a few short shared system prompts, turns as in the trace;
* `agent`: loops of tool calls behind a long shared tool-definition prefix: many steps, each adding a
  tool's output, seconds apart (the trace's gaps scaled by 1/20: a tool answers faster than a person);
* `rag`: many users asking about a few hundred long documents (Zipf popularity, s = 1), each behind
  one shared system prompt; a question of a block or two, follow-ups as in the trace;
* `trees`: thousands of independent prefix trees (no shared root): a long private context each (the
  trace's longer prompts, doubled), a few branching questions on it; fewer, longer requests;
* `mix`: a share of each of the above, interleaved in time.

Hash ids name prefixes (as in the Mooncake format): a block shared by two prompts has one id only when
everything before it is shared too. Every prompt ends in a partial block of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvstore.analytics.trace import CONVERSATION_TRACE, Request, read_trace

BLOCK_TOKENS = 512
KINDS = ("chat", "agent", "rag", "trees", "mix")
DURATION_S = 3600.0


@dataclass(frozen=True)
class TraceShape:
    """Empirical distributions of a trace, to sample from."""

    first_blocks: np.ndarray  # full blocks of a conversation's first prompt
    growth_blocks: np.ndarray  # full blocks a later turn adds to the previous prompt
    turn_gaps_s: np.ndarray  # seconds from a turn to the next one of its conversation
    turns: np.ndarray  # requests per conversation
    output_lengths: np.ndarray

    @staticmethod
    def from_requests(requests: Iterable[Request], block_tokens: int = BLOCK_TOKENS) -> TraceShape:
        """A later request continues the conversation whose last full block its prompt holds (as in
        `trace.conversation_turns`; first blocks are skipped: they are system prompts shared by all)."""
        requests = list(requests)
        tips: dict[int, int] = {}  # last full block of a prompt -> that request
        root: list[int] = []  # per request, the first request of its conversation
        first, growth, gaps = [], [], []
        for number, request in enumerate(requests):
            full = request.hash_ids[: request.input_length // block_tokens]
            parent = None
            for key in full[1:]:
                parent = tips.get(key, parent)
            if parent is None:
                first.append(len(full))
                root.append(number)
            else:
                previous = requests[parent]
                growth.append(len(full) - previous.input_length // block_tokens)
                gaps.append((request.timestamp_ms - previous.timestamp_ms) / 1000)
                root.append(root[parent])
            if len(full) > 1:
                tips[full[-1]] = number
        turns = np.bincount(np.asarray(root))
        return TraceShape(np.asarray(first), np.maximum(np.asarray(growth), 0), np.asarray(gaps, dtype=float),
                          turns[turns > 0], np.asarray([r.output_length for r in requests]))


@lru_cache(maxsize=1)
def conversation_shape() -> TraceShape:
    return TraceShape.from_requests(read_trace(CONVERSATION_TRACE))


class _Builder:
    """Hash ids and requests of one workload."""

    def __init__(self, rng: np.random.Generator, shape: TraceShape) -> None:
        self.rng, self.shape = rng, shape
        self._shared: dict = {}
        self._next = 0
        self.requests: list[Request] = []

    def new(self, count: int) -> list[int]:
        """`count` blocks no other prompt has."""
        ids = list(range(self._next, self._next + count))
        self._next += count
        return ids

    def shared(self, label, count: int) -> list[int]:
        """The `count` blocks of a shared prefix named `label` (the whole prefix up to them)."""
        for i in range(count):
            if (label, i) not in self._shared:
                self._shared[label, i] = self.new(1)[0]
        return [self._shared[label, i] for i in range(count)]

    def sample(self, values: np.ndarray, low: int = 0, high: int | None = None) -> int:
        value = int(values[self.rng.integers(len(values))])
        return max(low, value if high is None else min(value, high))

    def gap(self, scale: float = 1.0) -> float:
        return float(self.shape.turn_gaps_s[self.rng.integers(len(self.shape.turn_gaps_s))]) * scale

    def request(self, time_s: float, blocks: list[int], traffic_class: str) -> None:
        partial = int(self.rng.integers(1, BLOCK_TOKENS))
        self.requests.append(Request(int(time_s * 1000), len(blocks) * BLOCK_TOKENS + partial,
                                     self.sample(self.shape.output_lengths), tuple(blocks + self.new(1)),
                                     traffic_class))

    def conversation(self, time_s: float, prefix: list[int], traffic_class: str, turns: int,
                     gap_scale: float = 1.0, growth_low: int = 0) -> None:
        """Turns that each extend the previous prompt."""
        blocks = list(prefix)
        for turn in range(turns):
            if turn:
                blocks += self.new(self.sample(self.shape.growth_blocks, low=growth_low, high=64))
                time_s += self.gap(gap_scale)
            self.request(time_s, blocks, traffic_class)


def _chat(b: _Builder, sessions: int) -> None:
    prompts = [int(b.rng.integers(1, 5)) for _ in range(4)]  # a few system prompts of 1-4 blocks
    for _ in range(sessions):
        prompt = int(b.rng.integers(len(prompts)))
        prefix = b.shared(("system", prompt), prompts[prompt]) + b.new(b.sample(b.shape.first_blocks, 1, 200))
        b.conversation(b.rng.uniform(0, DURATION_S), prefix, "chat", b.sample(b.shape.turns, 1, 30))


def _agent(b: _Builder, sessions: int) -> None:
    tools = [int(b.rng.integers(8, 25)) for _ in range(3)]  # three agents, 8-24 blocks of tool definitions
    for _ in range(sessions):
        agent = int(b.rng.integers(len(tools)))
        prefix = b.shared(("tools", agent), tools[agent]) + b.new(b.sample(b.shape.first_blocks, 1, 32))
        b.conversation(b.rng.uniform(0, DURATION_S), prefix, "agent", int(b.rng.integers(5, 41)),
                       gap_scale=1 / 20, growth_low=1)


def _rag(b: _Builder, sessions: int, documents: int = 300) -> None:
    long = b.shape.first_blocks[b.shape.first_blocks >= 8]
    lengths = [b.sample(long, high=400) for _ in range(documents)]
    popularity = 1.0 / np.arange(1, documents + 1)
    popularity /= popularity.sum()
    system = b.shared(("rag-system",), 2)
    for _ in range(sessions):
        doc = int(b.rng.choice(documents, p=popularity))
        prefix = system + b.shared(("document", doc), lengths[doc]) + b.new(int(b.rng.integers(1, 3)))
        b.conversation(b.rng.uniform(0, DURATION_S), prefix, "chat", b.sample(b.shape.turns, 1, 3))


def _trees(b: _Builder, sessions: int) -> None:
    long = b.shape.first_blocks[b.shape.first_blocks >= np.median(b.shape.first_blocks)]
    for _ in range(sessions):
        context = b.new(2 * b.sample(long, high=200))  # a private root: no block shared with another tree
        start = b.rng.uniform(0, DURATION_S)
        for _ in range(int(b.rng.integers(1, 4))):  # questions branching from the context
            start += b.gap()
            b.conversation(start, context + b.new(int(b.rng.integers(1, 3))), "chat", b.sample(b.shape.turns, 1, 3))


# sessions per kind for the default size, chosen so that each has a few thousand requests
_DEFAULT_SESSIONS = {"chat": 2500, "agent": 200, "rag": 2500, "trees": 1500}
_MIX = {"chat": 0.3, "agent": 0.3, "rag": 0.2, "trees": 0.2}


def generate(kind: str, seed: int = 0, scale: float = 1.0, shape: TraceShape | None = None) -> list[Request]:
    """The requests of a `kind` workload over an hour, in time order; `scale` multiplies its sessions."""
    if kind not in KINDS:
        raise ValueError(f"unknown workload {kind!r}; choose one of {', '.join(KINDS)}")
    builder = _Builder(np.random.default_rng(seed), shape or conversation_shape())
    shares = _MIX if kind == "mix" else {kind: 1.0}
    for part, share in shares.items():
        sessions = max(1, round(_DEFAULT_SESSIONS[part] * share * scale))
        {"chat": _chat, "agent": _agent, "rag": _rag, "trees": _trees}[part](builder, sessions)
    builder.requests.sort(key=lambda r: r.timestamp_ms)
    return builder.requests


def write_trace(requests: Iterable[Request], path: Path | str) -> None:
    """Write requests in the Mooncake format (with `traffic_class`), for `kvstore analytics replay`."""
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids),
                                "traffic_class": r.traffic_class}) + "\n")
