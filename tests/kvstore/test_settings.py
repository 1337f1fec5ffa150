"""kvstore/settings.py: one way to configure every process. Flags, variables and TOML keys are generated from
a config dataclass; each layer wins over the one before; a bad value or an unknown key is refused by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvstore.settings import Command, unit

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Sample:
    name: str  # required: no default
    port: int = 7  # a port
    # a switch, off
    loud: bool = False
    chunk_bytes: int = 1024  # a size
    wait_s: float = 1.0  # a duration
    keys: dict[str, str] = field(default_factory=dict)  # a table
    peers: tuple[str, ...] = ()  # a list
    cert: Path | None = None  # an optional path


COMMAND = Command(Sample, "sample", "A sample process.", "SAMPLE_", aliases={"keys": "key"},
                  metavars={"keys": "KEY=OWNER"})


def test_a_flag_per_field_each_with_its_help_and_the_switch_both_ways():
    text = COMMAND.parser().format_help()
    for flag, words in [("--name", ""), ("--port", "a port (default: 7)"), ("--loud", "a switch, off"),
                        ("--no-loud", "the same as --loud=false"), ("--chunk-bytes SIZE", "a size"),
                        ("--wait-s DURATION", "a duration"), ("--keys KEY=OWNER, --key KEY=OWNER", "a table"),
                        ("--peers", "a list"), ("--cert PATH", "an optional path"), ("--config FILE", "TOML")]:
        assert flag in text and words in " ".join(text.split()), flag
    assert "SAMPLE_<NAME>" in text


@pytest.mark.parametrize(("argv", "loud"), [(["--loud"], True), (["--no-loud"], False), (["--loud", "false"], False),
                                           (["--loud=yes"], True), (["--loud", "--port", "9"], True), ([], False)])
def test_a_switch_is_a_bare_flag_or_takes_a_word(argv, loud):
    assert COMMAND.load(["--name", "n", *argv], environ={}).loud is loud


def test_values_are_parsed_by_type_and_name():
    config = COMMAND.load(["--name", "n", "--chunk-bytes", "2KiB", "--wait-s", "2m", "--key", "a=x", "--key", "b=y,c=z",
                           "--peers", "h:1,h:2", "--cert", "off"], environ={})
    assert (config.chunk_bytes, config.wait_s, config.cert) == (2048, 120.0, None)
    assert config.keys == {"a": "x", "b": "y", "c": "z"} and config.peers == ("h:1", "h:2")
    assert unit("max_bytes_per_peer") == "size" and unit("grace_s") == "duration" and unit("seconds") is None


def test_precedence_defaults_toml_env_flags(tmp_path):
    toml = tmp_path / "sample.toml"
    toml.write_text('name = "file"\nport = 1\nchunk_bytes = "1MiB"\npeers = ["a:1", "b:2"]\n[keys]\nk = "v"\n')
    config = COMMAND.load(["--config", str(toml), "--port", "3"], environ={"SAMPLE_PORT": "2", "SAMPLE_NAME": "env"})
    assert (config.name, config.port, config.chunk_bytes, config.wait_s) == ("env", 3, 2**20, 1.0)
    assert config.peers == ("a:1", "b:2") and config.keys == {"k": "v"}
    config = COMMAND.load([], environ={"SAMPLE_CONFIG": str(toml)}, fallback={"port": 0, "wait_s": "5s"})
    assert (config.name, config.port, config.wait_s) == ("file", 1, 5.0)  # the fallback lies under the file


@pytest.mark.parametrize(("argv", "environ", "message"), [
    ([], {}, "name is required: give --name, SAMPLE_NAME or name in the config file"),
    (["--name", "n", "--port", "seven"], {}, "setting port"),
    (["--name", "n", "--loud", "maybe"], {}, "setting loud: expected true or false"),
    (["--name", "n"], {"SAMPLE_CHUNK_BYTES": "lots"}, "setting chunk_bytes"),
    (["--name", "n", "--key", "no-owner"], {}, "--key takes KEY=OWNER, got 'no-owner'"),
])
def test_bad_values_are_refused_by_name(argv, environ, message):
    with pytest.raises(ValueError, match=message):
        COMMAND.load(argv, environ=environ)


def test_the_file_is_refused_for_an_unknown_key_a_wrong_type_or_bad_toml(tmp_path):
    toml = tmp_path / "sample.toml"
    for text, message in [('name = "n"\nprot = 1\n', "unknown setting 'prot'"),
                          ('name = "n"\nport = true\n', "setting port: expected a whole number"),
                          ('name = 5\n', "setting name: expected a string"),
                          ('name = "n"\nport = [\n', "not valid TOML")]:
        toml.write_text(text)
        with pytest.raises(ValueError, match=message):
            COMMAND.load(["--config", str(toml)], environ={})
    with pytest.raises(ValueError, match="does not exist"):
        COMMAND.load(["--config", str(tmp_path / "nope.toml")], environ={})


def test_parse_exits_as_for_a_bad_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        COMMAND.parse(["--name", "n", "--port", "seven"], environ={})
    assert exit_.value.code == 2 and "setting port" in capsys.readouterr().err


def test_a_field_without_help_is_refused():
    @dataclass
    class Bare:
        undocumented: int = 1

    with pytest.raises(ValueError, match="undocumented"):
        Command(Bare, "bare", "", "BARE_").parser()
    assert "--undocumented" in Command(Bare, "bare", "", "BARE_", descriptions={"undocumented": "now"}).parser(
    ).format_help()
