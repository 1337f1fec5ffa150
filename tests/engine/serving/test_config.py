"""A decode instance's command line (engine/serving/config.py): generated from InstanceConfig as the daemon's
and kvstore-api's are (kvstore/settings.py), with the block size every engine process shares by default."""

from __future__ import annotations

import dataclasses

import pytest

from engine.serving.config import COMMAND, InstanceConfig, parse_args

pytestmark = pytest.mark.unit


def test_a_flag_for_every_setting():
    text = COMMAND.parser().format_help()
    for f in dataclasses.fields(InstanceConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
    assert "--no-speculative" in text and "--no-exit-on-stdin-eof" in text and "KVSTORE_DECODE_<NAME>" in text


def test_precedence_defaults_toml_env_flags(tmp_path):
    toml = tmp_path / "decode.toml"
    toml.write_text(f'model = "{tmp_path}"\nport = 9100\nmax_running = 8\nexit_on_stdin_eof = true\n'
                    'servers = "127.0.0.1:1,127.0.0.1:2"\n')
    config = parse_args(["--config", str(toml), "--port", "9300", "--no-speculative"],
                        environ={"KVSTORE_DECODE_PORT": "9200", "KVSTORE_DECODE_MAX_RUNNING": "6"})
    assert (config.model, config.port, config.max_running, config.threads) == (tmp_path, 9300, 6, 1)
    assert config.exit_on_stdin_eof and not config.speculative
    assert config.servers == ("127.0.0.1:1", "127.0.0.1:2")


def test_the_store_settings_default_to_the_store_clients_variables(tmp_path):
    environ = {"KVSTORE_TOKEN": "from-client", "KVSTORE_TLS_CA": "ca.pem"}
    config = parse_args(["--model", str(tmp_path)], environ=environ)
    assert (config.store_token, config.store_tls_ca) == ("from-client", "ca.pem")
    config = parse_args(["--model", str(tmp_path), "--store-token", "from-flag"],
                        environ={**environ, "KVSTORE_DECODE_STORE_TLS_CA": "mine.pem"})
    assert (config.store_token, config.store_tls_ca) == ("from-flag", "mine.pem")
    assert "from-flag" not in repr(config)


@pytest.mark.parametrize("argv, message", [
    ([], "model is required: give --model, KVSTORE_DECODE_MODEL"),
    (["--model", "/no/such/dir"], "model must be a model directory"),
    (["--port", "70000"], "port must be an integer in [0, 65535]"),
    (["--max-calls", "4", "--max-calls-per-principal", "8"], "must not exceed it"),
    (["--exit-on-stdin-eof", "maybe"], "setting exit_on_stdin_eof: expected true or false"),
])
def test_bad_values_are_refused_by_name(tmp_path, capsys, argv, message):
    argv = argv if not argv or argv[0] == "--model" else ["--model", str(tmp_path), *argv]
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv, environ={})
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unknown_key_in_the_file_is_refused(tmp_path, capsys):
    toml = tmp_path / "decode.toml"
    toml.write_text(f'model = "{tmp_path}"\nblock_token = 64\n')
    with pytest.raises(SystemExit):
        parse_args(["--config", str(toml)], environ={})
    assert "unknown setting 'block_token'" in capsys.readouterr().err


def test_every_engine_process_stores_blocks_of_one_size_by_default(tmp_path):
    # the block size is part of the store's namespace: processes that differ in it share no cached block
    from engine.api.config import ApiConfig
    from engine.decode import DecodeConfig
    from engine.prefill import PrefillConfig
    from engine.prefill.config import BLOCK_TOKENS

    sizes = {ApiConfig().block_tokens, InstanceConfig(model=tmp_path).block_tokens, PrefillConfig().block_tokens,
             DecodeConfig().block_tokens, parse_args(["--model", str(tmp_path)], environ={}).block_tokens}
    assert sizes == {BLOCK_TOKENS}


def test_started_instances_get_switches_both_ways(tmp_path):
    from engine.serving.processes import instance_args

    args = instance_args(tmp_path, speculative=False, exit_on_stdin_eof=True)
    config = parse_args(args[3:], environ={})
    assert not config.speculative and config.exit_on_stdin_eof
