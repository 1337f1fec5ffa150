"""`kvstore-api`'s command line: every option explained, bad values refused by name, the old name still works."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engine.api.server import parse_args

pytestmark = pytest.mark.unit

BIN = Path(sys.executable).parent


def test_every_option_has_help_text(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: kvstore-api")
    options = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert len(options) >= 10
    for line in text.split("options:")[1].split("\n  --")[2:]:  # each option's entry, past --help
        name, _, rest = line.partition("  ")
        assert rest.strip(), f"--{name} has no help text"


def test_options_reach_the_config():
    config = parse_args(["--servers", "127.0.0.1:1,127.0.0.1:2", "--api-key", "k1=alice", "--block-tokens", "32",
                         "--max-running", "4", "--kv-pages", "9", "--tokenize-workers", "1", "--chunk-cost", "1,2,0",
                         "--metrics-key", "ops", "--fair-reserve", "1"])
    assert config.servers == ("127.0.0.1:1", "127.0.0.1:2") and config.api_keys == {"k1": "alice"}
    assert (config.block_tokens, config.max_running, config.kv_pages, config.tokenize_workers) == (32, 4, 9, 1)
    assert config.chunk_cost == (1.0, 2.0, 0.0)
    assert config.metrics_keys == ("ops",) and config.reserve == 1
    assert config.speculative and config.sps_profile is None  # on by default, its profile measured or cached
    profile = ",".join(str(0.01 * (i + 1)) for i in range(9))
    assert parse_args(["--sps-profile", profile]).sps_profile == tuple(0.01 * (i + 1) for i in range(9))
    assert parse_args(["--speculative"]).speculative and not parse_args(["--no-speculative"]).speculative


@pytest.mark.parametrize("args, message", [
    (["--api-key", "no-tenant"], "--api-key takes KEY=TENANT"),
    (["--chunk-cost", "1,2"], "three numbers"),
    (["--max-running", "0"], "max_running must be >= 1"),
    (["--sps-profile", "0.1,0.2"], "sps_profile takes 9 seconds"),  # one per B of the grid
    (["--sps-profile", "0.2,0.1,0.3,0.4,0.5,0.6,0.7,0.8,0.9"], "non-decreasing"),
    (["--sps-profile", "0,0.1,0.3,0.4,0.5,0.6,0.7,0.8,0.9"], "positive"),
    (["--port", "70000"], "port must lie in"),
    (["--max-running", "4", "--fair-reserve", "4"], "fair_reserve must lie in"),
])
def test_bad_values_are_refused_by_name(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("kvstore-serve", path=str(BIN)) is None, reason="not installed (make install)")
def test_the_old_name_still_runs_and_says_it_is_going():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    old = subprocess.run([str(BIN / "kvstore-serve"), "--help"], capture_output=True, text=True, timeout=120, env=env)
    new = subprocess.run([str(BIN / "kvstore-api"), "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert old.returncode == new.returncode == 0
    assert "kvstore-serve is now kvstore-api" in old.stderr and "is now" not in new.stderr
    words = " ".join(old.stdout.split()).replace("usage: kvstore-serve", "usage: kvstore-api")
    assert words == " ".join(new.stdout.split())  # the same options, wrapped to the name's width


def test_a_flag_for_every_setting():
    import dataclasses

    from engine.api.config import COMMAND, ApiConfig

    text = COMMAND.parser().format_help()
    for f in dataclasses.fields(ApiConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
    assert "--no-speculative" in text and "KVSTORE_API_<NAME>" in text


def test_precedence_defaults_toml_env_flags(tmp_path):
    toml = tmp_path / "api.toml"
    toml.write_text('port = 8100\nmax_running = 8\nservers = ["127.0.0.1:1"]\nidle_s = {chat = "5m"}\n'
                    'speculative = false\n[api_keys]\nk1 = "alice"\n')
    config = parse_args(["--config", str(toml), "--port", "8300"],
                        environ={"KVSTORE_API_PORT": "8200", "KVSTORE_API_MAX_RUNNING": "6"})
    assert (config.port, config.max_running, config.kv_pages) == (8300, 6, 1024)  # flag, env over file, default
    assert config.servers == ("127.0.0.1:1",) and config.api_keys == {"k1": "alice"}
    assert config.idle_s == {"chat": 300.0} and not config.speculative
    assert parse_args(["--speculative"], environ={"KVSTORE_API_CONFIG": str(toml)}).speculative


@pytest.mark.parametrize("toml, message", [
    ("max_runing = 4\n", "unknown setting 'max_runing'"),
    ("max_running = 'many'\n", "setting max_running"),
    ("chunk_cost = [1, 2]\n", "three numbers"),
])
def test_a_bad_config_file_is_refused_by_name(tmp_path, capsys, toml, message):
    path = tmp_path / "api.toml"
    path.write_text(toml)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", str(path)], environ={})
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def _api_fails(*args: str) -> str:
    """kvstore-api's one line on stderr for a start-up mistake, which ends it with status 2 before it loads a
    model (kvstore/startup.py)."""
    run = subprocess.run([sys.executable, "-m", "engine.api.server", *args], capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "serving" not in run.stdout
    return lines[0]


def test_a_daemon_without_its_port_is_one_line():
    line = _api_fails("--servers", "127.0.0.1")
    assert "'127.0.0.1' is not host:port" in line and "127.0.0.1:50051" in line


def test_a_model_directory_that_is_not_one_is_one_line(tmp_path):
    line = _api_fails("--model", str(tmp_path / "missing"))
    assert str(tmp_path / "missing") in line and "config.json" in line


def test_a_port_in_use_is_said_before_the_model_loads():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = _api_fails("--port", str(port))
    assert f"127.0.0.1:{port}" in line and "--port" in line and "in use" in line
