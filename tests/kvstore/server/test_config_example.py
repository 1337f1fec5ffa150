"""deploy/kvstore.toml lists every setting, loads as the daemon loads it, and is what
kvstore/server/config_example.py writes from ServerConfig."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from kvstore.server import config_example
from kvstore.server.config import ServerConfig, load_config

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "kvstore.toml"
FIELDS = [field.name for field in dataclasses.fields(ServerConfig)]


def test_the_committed_file_is_what_the_generator_writes():
    assert EXAMPLE.read_text() == config_example.render(), \
        "deploy/kvstore.toml is stale: run .venv/bin/python -m kvstore.server.config_example deploy/kvstore.toml"


def test_it_sets_every_setting_and_nothing_else():
    with EXAMPLE.open("rb") as f:
        written = tomllib.load(f)
    assert sorted(set(FIELDS) - set(written)) == [], "settings missing from deploy/kvstore.toml"
    assert sorted(set(written) - set(FIELDS)) == [], "deploy/kvstore.toml names settings ServerConfig lacks"


def test_it_loads_as_the_daemon_loads_it_to_the_defaults_but_the_deployments():
    loaded = load_config(["--config", str(EXAMPLE)], environ={})
    assert loaded == ServerConfig(**config_example.settings())
    defaults = ServerConfig()
    for name in FIELDS:
        if name not in config_example.DEPLOYMENT and name != "data_socket":  # data_socket lies in data_dir
            assert getattr(loaded, name) == getattr(defaults, name), name
    assert loaded.data_socket == Path("/data") / defaults.data_socket.name
    for name, value in config_example.DEPLOYMENT.items():
        assert value != getattr(defaults, name), f"DEPLOYMENT[{name!r}] is the default"
        assert getattr(loaded, name) == value, name


def test_each_setting_has_a_comment_above_it():
    lines = EXAMPLE.read_text().splitlines()
    for name in FIELDS:
        (row,) = [i for i, line in enumerate(lines) if line.startswith((f"{name} = ", f"[{name}]"))]
        assert lines[row - 1].startswith("# ") and len(lines[row - 1]) > 4, name


def test_check_fails_on_a_stale_file_and_passes_on_a_fresh_one(tmp_path, capsys):
    fresh = tmp_path / "kvstore.toml"
    assert config_example.main([str(fresh)]) == 0
    assert config_example.main(["--check", str(fresh)]) == 0
    assert config_example.main(["--check", str(EXAMPLE)]) == 0
    fresh.write_text("".join(line for line in fresh.read_text().splitlines(True) if not line.startswith("io_threads")))
    assert config_example.main(["--check", str(fresh)]) == 1
    assert "run that" in capsys.readouterr().err
    assert config_example.main(["--check", str(tmp_path / "missing.toml")]) == 1


def test_a_field_without_a_comment_stops_the_generator(monkeypatch):
    descriptions = dict(config_example.DESCRIPTIONS)
    del descriptions["host"]
    descriptions["no_such_setting"] = "stale"
    monkeypatch.setattr(config_example, "DESCRIPTIONS", descriptions)
    with pytest.raises(ValueError) as caught:
        config_example.render()
    assert "host: give it a comment" in str(caught.value)
    assert "DESCRIPTIONS['no_such_setting']: ServerConfig has no such field" in str(caught.value)


def test_a_description_that_repeats_the_source_comment_is_refused(monkeypatch):
    monkeypatch.setattr(config_example, "DESCRIPTIONS", {**config_example.DESCRIPTIONS, "port": "again"})
    with pytest.raises(ValueError, match="DESCRIPTIONS\\['port'\\]: the field's comment in ServerConfig is used"):
        config_example.descriptions()


@dataclasses.dataclass
class Sample:
    # two lines
    # above a
    a: int = 1  # and a's own
    b: int = 2

    # above c, after a blank line
    c: int = 3
    d: dict = dataclasses.field(default_factory=dict)  # d's own
    # a comment after the last field belongs to none


def test_source_comments_take_the_lines_above_and_the_one_beside():
    assert config_example.source_comments(Sample) == {
        "a": ["two lines", "above a", "and a's own"],
        "c": ["above c, after a blank line"],
        "d": ["d's own"],
    }


def test_every_value_is_written_as_the_loader_reads_it_back(tmp_path):
    # each setting alone, through the same loader: what the generator writes is what the field held
    for name, value in config_example.settings().items():
        if isinstance(value, dict):
            continue
        path = tmp_path / f"{name}.toml"
        path.write_text(f"{name} = {config_example.toml_value(name, value)}\n")
        expected = ServerConfig(**{name: value})
        assert getattr(load_config(["--config", str(path)], environ={}), name) == getattr(expected, name), name


def test_the_loopback_example_loads_and_stays_on_this_machine():
    config = load_config(["--config", str(EXAMPLE.with_name("kvstore-loopback.toml"))], environ={})
    assert config.loopback_only and config.metrics_host == "127.0.0.1"
    assert not config.data_dir.is_absolute() and config.capacity_bytes == 8 * 2**30
