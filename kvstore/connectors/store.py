"""What every engine plug-in needs of the store: a client config from the engine's own settings, and a
client made on first use (so a plug-in imports, and an engine starts, before any daemon is reachable)."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path

from kvstore.client import ClientConfig, KVClient, StoreClient
from kvstore.client.config import security_from_environment

# the settings a plug-in reads from its engine's config (a JSON flag, a YAML file), each optional
SETTINGS = ("servers", "tenant", "traffic_class", "timeout_s", "token_file", "tls_ca", "tls_cert", "tls_key",
            "tls_server_name", "model_id")


def client_config(settings: Mapping[str, object], where: str, **fields) -> ClientConfig:
    """The client config of a plug-in: `servers` ("host:port,...") or $KVSTORE_SERVERS; `timeout_s`, the
    deadline of each call; security from the engine's settings (`token_file`, never a token itself, which
    would show in a command line; `tls_*` paths) over the KVSTORE_* variables. `where` names the settings
    in errors ("remote_storage_plugin.kvstore.", "--hicache-storage-backend-extra-config "); `fields` are
    further ClientConfig fields the plug-in sets itself."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"{where}: unknown kvstore settings {unknown}; known: {list(SETTINGS)}")
    servers = str(settings.get("servers") or os.environ.get("KVSTORE_SERVERS", ""))
    security = security_from_environment()
    for name in ("tls_ca", "tls_cert", "tls_key", "tls_server_name"):
        if settings.get(name):
            security[name] = str(settings[name])
    if settings.get("token_file"):
        path = Path(str(settings["token_file"]))
        try:
            security["token"] = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"{where}token_file: cannot read {path}: {exc.strerror}") from None
    if not servers.strip():
        raise ValueError(f"{where}servers (or $KVSTORE_SERVERS) must list the daemons as host:port,...")
    timeout_s = settings.get("timeout_s", 5.0)
    if not isinstance(timeout_s, int | float | str):
        raise ValueError(f"{where}timeout_s must be a number of seconds, got {timeout_s!r}")
    return ClientConfig(tuple(s.strip() for s in servers.split(",") if s.strip()),
                        timeout_s=float(timeout_s), **security, **fields)


class LazyClient:
    """A store client (a KVClient) connected on first use, shared by an engine's threads."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._client: StoreClient | None = None
        self._lock = threading.Lock()

    def get(self) -> StoreClient:
        with self._lock:
            if self._client is None:
                self._client = KVClient(self.config)
            return self._client

    @property
    def existing(self) -> StoreClient | None:
        """The client if it was made; None before the first use."""
        return self._client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
