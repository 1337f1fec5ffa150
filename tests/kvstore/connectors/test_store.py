"""The plug-ins' client config from an engine's settings (kvstore/connectors/store.py)."""

from __future__ import annotations

import pytest

from kvstore.connectors.store import LazyClient, client_config


def test_settings_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_SERVERS", "10.0.0.9:1")
    monkeypatch.setenv("KVSTORE_TOKEN", "from-env")
    monkeypatch.setenv("KVSTORE_TLS_SERVER_NAME", "env-name")
    token = tmp_path / "token"
    token.write_text("from-file\n")
    config = client_config({"servers": "a:1, b:2", "token_file": str(token), "timeout_s": "0.5"}, "x.")
    assert config.servers == ("a:1", "b:2")
    assert config.token == "from-file" and config.timeout_s == 0.5
    assert config.tls_server_name == "env-name"  # what the settings leave out comes from KVSTORE_*
    assert client_config({}, "x.").servers == ("10.0.0.9:1",)


@pytest.mark.parametrize("settings, message", [
    ({"server": "a:1"}, "unknown kvstore settings \\['server'\\]"),
    ({"servers": ""}, "x.servers \\(or \\$KVSTORE_SERVERS\\)"),
    ({"servers": "a:1", "token_file": "/no/such/file"}, "x.token_file: cannot read"),
    ({"servers": "a"}, "is not host:port"),
    ({"servers": "a:1", "tls_ca": "/no/such/ca.pem"}, "tls_ca"),
])
def test_bad_settings_name_what_is_wrong(settings, message, monkeypatch):
    monkeypatch.delenv("KVSTORE_SERVERS", raising=False)
    with pytest.raises(ValueError, match=message):
        client_config(settings, "x.")


def test_the_client_is_made_on_first_use_only(monkeypatch):
    monkeypatch.delenv("KVSTORE_SERVERS", raising=False)
    lazy = LazyClient(client_config({"servers": "127.0.0.1:9"}, "x."))  # nothing listens there
    assert lazy._client is None
    client = lazy.get()
    assert lazy.get() is client
    lazy.close()
    assert lazy._client is None
    lazy.close()  # twice is harmless
