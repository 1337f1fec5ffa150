"""Properties of the daemon's config (kvstore/server/config.py): whatever an operator writes in a flag,
an environment variable or the TOML file, the result is a ValueError that says what to change, or a
config the daemon can act on."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.server.config import ServerConfig, load_config

pytestmark = pytest.mark.unit
PROPERTY = settings(max_examples=200, deadline=None)

FIELDS = {field.name: field.type for field in dataclasses.fields(ServerConfig)}
PATH_FIELDS = sorted(name for name, kind in FIELDS.items() if "Path" in kind)
NAMES = st.sampled_from(sorted(FIELDS))
# What an operator might type: numbers with and without units, words, junk, and the edges of each.
TYPED = st.one_of(
    st.integers(-2**70, 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["", "off", "none", "0", "-1", "1e9", "1.5GiB", "64MiB", "3d", "90s", "12h", "nan", "inf",
                     "9" * 400, "1_000", " 7 ", "agent=3d,chat=7d", "chat", "lru", "fsync", "os", "DEBUG",
                     "loud", "127.0.0.1", "agent=3d,chat", "=", ",", "x=", "chat=0"]),
    st.text(max_size=30),
)

# Junk alone is refused nearly always, which leaves the accepted side of the property untried; each name is
# also given its default, spelt as an operator would, so that mixes of sound and unsound values are accepted too.
DEFAULTS = {name: value for name, value in dataclasses.asdict(ServerConfig()).items()
            if value is not None and not isinstance(value, dict | list | tuple)}


def spelt(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def typed_for(name: str) -> st.SearchStrategy[tuple[str, str]]:
    plausible = [st.just(spelt(DEFAULTS[name]))] * 2 if name in DEFAULTS else []
    return st.tuples(st.just(name), st.one_of(TYPED, *plausible))


def toml_for(name: str) -> st.SearchStrategy[tuple[str, object]]:
    default = DEFAULTS.get(name)
    plausible = [st.just(str(default) if isinstance(default, Path) else default)] * 2 if name in DEFAULTS else []
    return st.tuples(st.just(name), st.one_of(toml_values, *plausible))


def a_valid_config(config: ServerConfig) -> None:
    """What the daemon relies on once a config has been accepted."""
    assert isinstance(config.data_dir, Path) and isinstance(config.host, str)
    assert logging.getLevelName(config.log_level.upper()) != f"Level {config.log_level.upper()}", \
        f"log_level {config.log_level!r} is not a level the daemon can log at"
    for name, kind in FIELDS.items():
        value = getattr(config, name)
        if kind in ("int", "int | None") and value is not None:
            assert isinstance(value, int) and value >= 0, f"{name}={value!r}"
        if kind == "float":
            assert isinstance(value, float) and not math.isnan(value), f"{name}={value!r}"
    assert all(isinstance(k, str) and ttl > 0 for k, ttl in config.classes.items())
    assert 0 < config.low_watermark < config.high_watermark <= 1


def accepted_or_explained(build) -> bool:
    """Whether the config was accepted (and then valid); a refusal must explain itself."""
    try:
        config = build()
    except ValueError as exc:
        assert str(exc), "a refusal must say what to change"
        return False
    a_valid_config(config)
    return True


# A property that holds for a loader refusing everything proves nothing about the configs it accepts: each test
# counts the examples that were accepted and checked, and requires this many.
MIN_ACCEPTED = 5


def check_enough_accepted(outcomes: Counter[bool]) -> None:
    assert outcomes[True] >= MIN_ACCEPTED, f"only {outcomes[True]} of {sum(outcomes.values())} examples accepted"


def without_files(name: str) -> bool:
    return name not in ("config", "auth_tokens", "tls_cert", "tls_key", "tls_client_ca")


def test_any_flags_or_environment_give_a_valid_config_or_a_value_error():
    outcomes: Counter[bool] = Counter()

    @PROPERTY
    @given(st.lists(NAMES.filter(without_files).flatmap(typed_for), max_size=4).map(dict), st.data())
    def flags_or_environment(values, data):
        with tempfile.TemporaryDirectory() as scratch:
            values = {"data_dir": scratch, **values}
            if data.draw(st.booleans()):
                argv = [f"--{name.replace('_', '-')}={value}" for name, value in values.items()]
                outcomes[accepted_or_explained(lambda: load_config(argv, environ={}))] += 1
            else:
                environ = {f"KVSTORE_{name.upper()}": value.replace("\x00", "") for name, value in values.items()}
                outcomes[accepted_or_explained(lambda: load_config([], environ=environ))] += 1

    flags_or_environment()
    check_enough_accepted(outcomes)


toml_scalars = st.one_of(st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True),
                         st.booleans(), st.text(max_size=20), TYPED)
toml_values = st.recursive(toml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=3)), max_leaves=6)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def test_any_toml_values_give_a_valid_config_or_a_value_error():
    outcomes: Counter[bool] = Counter()

    @PROPERTY
    @given(st.lists(NAMES.filter(without_files).flatmap(toml_for), max_size=4).map(dict))
    def toml_file(values):
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "kvstore.toml"
            values = {"data_dir": scratch, **values}
            path.write_text("".join(f"{name} = {toml_value(value)}\n" for name, value in values.items()))
            outcomes[accepted_or_explained(lambda: load_config(["--config", str(path)], environ={}))] += 1

    toml_file()
    check_enough_accepted(outcomes)


def test_any_numbers_in_the_dataclass_give_a_valid_config_or_a_value_error():
    outcomes: Counter[bool] = Counter()

    @PROPERTY
    @given(st.dictionaries(st.sampled_from(sorted(n for n, k in FIELDS.items() if k in ("int", "int | None"))),
                           st.one_of(st.integers(-2**64, 2**64), st.integers(0, 2**40)), max_size=4),
           st.dictionaries(st.sampled_from(sorted(n for n, k in FIELDS.items() if k == "float")),
                           st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1e6)),
                           max_size=4))
    def numbers(ints, floats):
        with tempfile.TemporaryDirectory() as scratch:
            outcomes[accepted_or_explained(lambda: ServerConfig(data_dir=Path(scratch), **ints, **floats))] += 1

    numbers()
    check_enough_accepted(outcomes)


def test_the_defaults_are_a_valid_config():
    a_valid_config(ServerConfig())
