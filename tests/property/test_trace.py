"""Properties of the Mooncake trace reader (kvstore/analytics/trace.py): any line is a clear error naming
its line, or a request that holds what the format promises."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.analytics.trace import Request, TraceError, parse_line, read_trace

pytestmark = pytest.mark.unit
PROPERTY = settings(max_examples=200, deadline=None)
BLOCK_TOKENS = 512

numbers = st.one_of(st.integers(-2**70, 2**1400), st.floats(allow_nan=True, allow_infinity=True), st.booleans())
json_values = st.recursive(st.one_of(st.none(), numbers, st.text(max_size=10)), lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)


@st.composite
def trace_objects(draw) -> dict:
    """Objects shaped like trace records, each field right, wrong, or missing."""
    length = draw(st.one_of(st.integers(1, 5000), numbers, json_values))
    ids_for = math.ceil(length / BLOCK_TOKENS) if isinstance(length, int) and 0 < length < 10**6 else 1
    record = {
        "timestamp": draw(st.one_of(st.integers(0, 2**40), numbers, json_values)),
        "input_length": length,
        "output_length": draw(st.one_of(st.integers(0, 4096), numbers, json_values)),
        "hash_ids": draw(st.one_of(st.lists(st.integers(-2**63, 2**64), min_size=ids_for, max_size=ids_for),
                                   st.lists(st.one_of(numbers, json_values), max_size=4), json_values)),
        "traffic_class": draw(st.one_of(st.sampled_from(["chat", "agent"]), json_values)),
    }
    dropped = draw(st.lists(st.sampled_from(sorted(record)), max_size=2))
    return {k: v for k, v in record.items() if k not in dropped}


lines = st.one_of(
    trace_objects().map(json.dumps),  # json.dumps writes NaN/Infinity, which json.loads reads back
    json_values.map(json.dumps),
    st.text(max_size=40),
    st.sampled_from(['{"timestamp": 1e999, "input_length": 1, "hash_ids": [1]}',
                     '{"timestamp": 0, "input_length": 1' + "0" * 400 + ', "hash_ids": [1]}']),
)


def a_valid_request(request: Request) -> None:
    assert isinstance(request.timestamp_ms, int) and request.timestamp_ms >= 0
    assert isinstance(request.input_length, int) and request.input_length >= 1
    assert isinstance(request.output_length, int) and request.output_length >= 0
    assert len(request.hash_ids) == -(-request.input_length // BLOCK_TOKENS)
    assert all(isinstance(h, int) for h in request.hash_ids)
    assert isinstance(request.traffic_class, str) and request.traffic_class
    assert 0 < request.block_tokens(len(request.hash_ids) - 1, BLOCK_TOKENS) <= BLOCK_TOKENS


@PROPERTY
@given(lines)
def test_any_line_is_a_value_error_or_a_valid_request(line):
    try:
        request = parse_line(line, BLOCK_TOKENS)
    except ValueError as exc:
        assert str(exc)
        return
    a_valid_request(request)


@PROPERTY
@given(st.lists(st.one_of(lines.map(str.encode), st.binary(max_size=30)), min_size=1, max_size=6), st.booleans())
def test_any_file_gives_requests_or_an_error_naming_its_line(raw_lines, skip_bad):
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "trace.jsonl"
        path.write_bytes(b"\n".join(line.replace(b"\n", b" ").replace(b"\r", b" ") for line in raw_lines) + b"\n")
        errors: list[str] = []
        try:
            requests = list(read_trace(path, BLOCK_TOKENS, skip_bad=skip_bad, errors=errors))
        except TraceError as exc:
            assert not skip_bad and f"{path}:{exc.line}: " in str(exc) and 1 <= exc.line <= len(raw_lines)
            return
        for request in requests:
            a_valid_request(request)
        assert len(requests) + len(errors) <= len(raw_lines)
