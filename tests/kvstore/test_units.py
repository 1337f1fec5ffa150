"""kvstore/units.py: the one parser of sizes and durations, for the daemon's config and the CLIs."""

from __future__ import annotations

import argparse
import ast
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.units import (
    DURATION_UNITS,
    MAX_SIZE,
    SIZE_UNITS,
    UnitError,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)

pytestmark = pytest.mark.unit
PACKAGE = Path(__file__).resolve().parents[2] / "kvstore"

SIZE_FACTORS = {"B": 1, "kB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
                "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
DURATION_FACTORS = {"s": 1, "m": 60, "h": 60 * 60, "d": 24 * 60 * 60}


def test_the_suffixes_are_the_ones_documented():
    assert SIZE_UNITS == SIZE_FACTORS and DURATION_UNITS == DURATION_FACTORS


@pytest.mark.parametrize("suffix", SIZE_FACTORS)
def test_every_size_suffix_in_any_case(suffix):
    factor = SIZE_FACTORS[suffix]
    for spelling in (suffix, suffix.lower(), suffix.upper()):
        assert parse_size(f"3{spelling}") == 3 * factor
        assert parse_size(f" 3 {spelling} ") == 3 * factor
        assert parse_size(f"1.5{spelling}") == 3 * factor // 2


@pytest.mark.parametrize("suffix", DURATION_FACTORS)
def test_every_duration_suffix_in_any_case(suffix):
    factor = DURATION_FACTORS[suffix]
    for spelling in (suffix, suffix.upper()):
        assert parse_duration(f"7{spelling}") == 7 * factor
        assert parse_duration(f"\t7 {spelling}\n") == 7 * factor
        assert parse_duration(f"0.5{spelling}") == factor / 2


@pytest.mark.parametrize("value, size", [
    ("4096", 4096), (4096, 4096), (0, 0), ("0", 0), ("-0", 0), ("+5", 5), (1.5e9, 1_500_000_000),
    ("1.5KiB", 1536), ("0.3KiB", 307), (".5kB", 500), ("5.", 5), ("2 GB", 2_000_000_000),
    ("1234567890123456789", 1234567890123456789),  # past 2**53: exact, no float in between
    (str(MAX_SIZE), MAX_SIZE),
])
def test_sizes(value, size):
    assert parse_size(value) == size and isinstance(parse_size(value), int)


@pytest.mark.parametrize("value, seconds", [
    ("90", 90.0), (90, 90.0), (2.5, 2.5), ("0", 0.0), ("1.5h", 5400.0), ("10m", 600.0), (" 3d ", 259200.0),
])
def test_durations(value, seconds):
    assert parse_duration(value) == seconds and isinstance(parse_duration(value), float)


@pytest.mark.parametrize("value, words", [
    ("12XB", ["'12XB'", "unknown suffix 'XB'", "KiB", "MiB", "GiB", "TiB", "kB", "MB", "GB", "TB"]),
    ("5 mibs", ["unknown suffix 'mibs'"]),
    ("lots", ["'lots' is not a size", "e.g. '512MiB'"]),
    ("", ["'' is not a size"]),
    ("1e9", ["'1e9' is not a size"]),
    ("1_000", ["is not a size"]),
    ("1 000", ["is not a size"]),
    ("GiB", ["'GiB' is not a size"]),
    ("nan", ["is not a size"]),
    ("-1", ["'-1'", "cannot be negative"]),
    ("-1GiB", ["'-1GiB'", "cannot be negative"]),
    (-1, ["-1", "cannot be negative"]),
    (-0.5, ["cannot be negative"]),
    (math.inf, ["inf is not a size"]),
    (math.nan, ["nan is not a size"]),
    (True, ["True is not a size"]),  # a TOML boolean
    ([1], ["[1] is not a size"]),  # a TOML array
    ("\u0661\u0662", ["is not a size"]),  # Arabic-Indic digits: only 0-9 are digits here
    (MAX_SIZE + 1, ["too large a size", str(MAX_SIZE)]),
    ("9" * 400, ["too large a size", "..."]),
    ("8EiB", ["unknown suffix 'EiB'"]),
])
def test_bad_sizes_name_the_value_and_what_to_write(value, words):
    with pytest.raises(ValueError) as caught:
        parse_size(value)
    for word in words:
        assert word in str(caught.value)
    assert len(str(caught.value)) < 300  # a long value is cut short in the message


@pytest.mark.parametrize("value, words", [
    ("soon", ["'soon' is not a duration", "s, m, h, d", "e.g. '90s'"]),
    ("3w", ["'3w'", "unknown suffix 'w'", "s, m, h, d"]),
    ("10ms", ["unknown suffix 'ms'"]),
    ("", ["is not a duration"]),
    ("inf", ["'inf' is not a duration"]),
    ("-5s", ["'-5s'", "cannot be negative"]),
    (-1, ["cannot be negative"]),
    (-0.1, ["cannot be negative"]),
    (math.inf, ["not a finite duration"]),
    (math.nan, ["not a finite duration"]),
    (10**400, ["not a finite duration"]),
    ("9" * 400 + "d", ["not a finite duration"]),
    (False, ["False is not a duration"]),
    ({"a": 1}, ["is not a duration"]),
])
def test_bad_durations_name_the_value_and_what_to_write(value, words):
    with pytest.raises(ValueError) as caught:
        parse_duration(value)
    for word in words:
        assert word in str(caught.value)


def test_argparse_shows_the_message_itself():
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--size", type=parse_size)
    parser.add_argument("--ttl", type=parse_duration)
    assert parser.parse_args(["--size", "2MiB", "--ttl", "1m"]) == argparse.Namespace(size=2 * 2**20, ttl=60.0)
    with pytest.raises(argparse.ArgumentError, match="unknown suffix 'XB'"):
        parser.parse_args(["--size", "12XB"])
    with pytest.raises(argparse.ArgumentError, match="cannot be negative"):
        parser.parse_args(["--ttl=-3d"])
    assert issubclass(UnitError, ValueError)


@pytest.mark.parametrize("size, text", [(0, "0"), (1, "1"), (1000, "1kB"), (1024, "1KiB"), (1536, "1536"),
                                        (64 * 2**30, "64GiB"), (2**40, "1TiB"), (3 * 10**9, "3GB")])
def test_format_size(size, text):
    assert format_size(size) == text


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (0.5, "0.5s"), (1e-05, "0.00001s"), (90, "90s"),
                                           (600.0, "10m"), (3600, "1h"), (7 * 86400, "7d"), (1.25, "1.25s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1KiB"])
def test_format_size_refuses_what_is_no_byte_count(bad):
    with pytest.raises(ValueError):
        format_size(bad)


@pytest.mark.parametrize("bad", [-1, math.inf, math.nan, False, "1h"])
def test_format_duration_refuses_what_is_no_duration(bad):
    with pytest.raises(ValueError):
        format_duration(bad)


@given(st.integers(0, MAX_SIZE))
def test_a_formatted_size_reads_back(size):
    assert parse_size(format_size(size)) == size


@given(st.floats(0, 1e15, allow_nan=False))
def test_a_formatted_duration_reads_back(seconds):
    assert parse_duration(format_duration(seconds)) == seconds


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_units_import_only_the_standard_library():
    modules = imported_modules(PACKAGE / "units.py")
    assert "math" in modules  # the walk found the imports
    assert {name.split(".")[0] for name in modules} <= set(sys.stdlib_module_names) | {"__future__"}


def test_the_analytics_cli_takes_its_units_from_kvstore_units():
    for path in sorted((PACKAGE / "analytics").glob("*.py")):
        assert not any(name.startswith("kvstore.server") for name in imported_modules(path)), path
    assert "kvstore.units" in imported_modules(PACKAGE / "analytics" / "cli.py")
