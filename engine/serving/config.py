"""A decode instance's one config, and its command line (`python -m engine.serving.instance --help`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.decode import DecodeConfig
from kvstore.client.config import ClientConfig, add_security_flags, security_settings

MAX_MESSAGE_BYTES = 2**20  # a 1 MiB request holds a prompt of >200k token ids: past these models' contexts
SECURITY_FILES = ("auth_tokens", "tls_cert", "tls_key", "tls_client_ca")


@dataclass(frozen=True)
class InstanceConfig:
    model: Path  # a model directory: config.json and safetensors weights
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, announced on the READY line
    kv_pages: int = 512
    block_tokens: int = 256
    max_running: int = 64
    prefill_tokens_per_step: int = 2048
    threads: int = 1  # torch threads: several instances share a machine's cores, so one each by default
    max_message_bytes: int = MAX_MESSAGE_BYTES  # largest request received; past it, RESOURCE_EXHAUSTED
    # Generate calls held at once, running or queued, in all and for one principal (a token's name, else the
    # peer's address: a router is one principal); past either, RESOURCE_EXHAUSTED at once. A queued call holds
    # its prompt, so these bound the instance's memory; the per-principal share leaves room for the others
    max_calls: int = 512
    max_calls_per_principal: int = 256
    exit_on_stdin_eof: bool = False  # shut down when stdin ends: children started on a pipe die with their parent
    speculative: bool = True  # DecodeConfig.speculative: n-gram drafts verified on the DSpark schedule, lossless
    servers: tuple[str, ...] = ()  # the store's daemons (host:port); none: no store
    # Security, as the daemon's (kvstore/server/config.py): a token file, TLS, and mutual TLS
    auth_tokens: Path | None = None  # TOML token file (kvstore/server/auth.py); None: no authentication
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key, the port speaks TLS only
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # PEM CA bundle; set: clients must present a certificate it signed
    # The instance as a client of secured daemons (with servers): the store client's settings and meaning
    store_token: str | None = field(default=None, repr=False)  # never shown
    store_tls_ca: str | None = None
    store_tls_cert: str | None = None
    store_tls_key: str | None = None
    store_tls_server_name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", Path(self.model))
        if not self.model.is_dir():
            raise ValueError(f"InstanceConfig: model must be a model directory (config.json + weights), "
                             f"got {self.model}")
        for name in ("kv_pages", "block_tokens", "max_running", "prefill_tokens_per_step", "threads",
                     "max_message_bytes", "max_calls", "max_calls_per_principal"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"InstanceConfig: {name} must be an integer >= 1, got {value!r}")
        if self.max_calls_per_principal > self.max_calls:
            raise ValueError(f"InstanceConfig: max_calls_per_principal ({self.max_calls_per_principal}) is a share "
                             f"of max_calls ({self.max_calls}): it must not exceed it")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"InstanceConfig: port must be an integer in [0, 65535], got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"InstanceConfig: host must be a non-empty string, got {self.host!r}")
        for name in ("exit_on_stdin_eof", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"InstanceConfig: {name} must be True or False, got {getattr(self, name)!r}")
        object.__setattr__(self, "servers", tuple(self.servers))
        if not all(isinstance(s, str) for s in self.servers):
            raise ValueError(f"InstanceConfig: servers must be host:port addresses or a discovery target, "
                             f"got {self.servers!r}")
        for name in SECURITY_FILES:
            if (value := getattr(self, name)) is not None:
                object.__setattr__(self, name, Path(value))
                if not getattr(self, name).is_file():
                    raise ValueError(f"InstanceConfig: {name}: {value} is not a readable file")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("InstanceConfig: tls_cert and tls_key go together: give both (PEM files) or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("InstanceConfig: tls_client_ca (mutual TLS) needs tls_cert and tls_key as well")
        if self.servers:
            try:
                self.store_client()  # checks the store client's settings (servers: host:port or a target)
            except ValueError as exc:
                raise ValueError(f"InstanceConfig: {exc}") from None

    @property
    def loopback_only(self) -> bool:
        return self.host in ("localhost", "::1") or self.host.startswith("127.")

    def store_client(self) -> ClientConfig:
        """The config of the instance's client of the store (its servers)."""
        return ClientConfig(self.servers, token=self.store_token, tls_ca=self.store_tls_ca,
                            tls_cert=self.store_tls_cert, tls_key=self.store_tls_key,
                            tls_server_name=self.store_tls_server_name)

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig(max_running=self.max_running, prefill_tokens_per_step=self.prefill_tokens_per_step,
                            kv_pages=self.kv_pages, block_tokens=self.block_tokens, speculative=self.speculative)


FIELDS = tuple(f.name for f in dataclasses.fields(InstanceConfig))
STORE_SECURITY = tuple(name for name in FIELDS if name.startswith("store_"))
_HELP = {
    "model": "model directory (config.json + safetensors weights)",
    "host": "address to listen on",
    "port": "port to listen on; 0: a free one, printed on the READY line",
    "kv_pages": "KV pages the engine holds (its KV capacity is pages x block tokens)",
    "block_tokens": "tokens per KV page, and per stored block with --servers",
    "max_running": "sequences decoded at once; more wait for a slot",
    "prefill_tokens_per_step": "prompt tokens one step computes besides the decoding sequences' tokens",
    "threads": "torch threads (several instances on one machine: one each)",
    "max_message_bytes": "largest request accepted; a larger one ends RESOURCE_EXHAUSTED",
    "max_calls": "Generate calls held at once, running or queued; past it a call ends RESOURCE_EXHAUSTED at once",
    "max_calls_per_principal": "of --max-calls, the calls one principal holds (a token's name, else the peer's "
                               "address); past it, RESOURCE_EXHAUSTED",
    "exit_on_stdin_eof": "shut down when stdin ends (a parent holding the pipe died or closed it)",
    "speculative": "speculative decoding: n-gram drafts verified on the DSpark schedule, lossless (default: on; "
                   "its SPS profile is measured at the first start on a machine and cached)",
    "servers": "the store's daemons, host:port,... or a dns:///, dns+srv:/// or etcd:// target (docs/deployment.md): "
               "prompts are prefilled through the store and replies saved; none: prompts are computed here and "
               "nothing is saved",
    "auth_tokens": "TOML token file, as the daemon's (`kvstore token new`): every call needs a token, Generate "
                   "its write verb, Load its read verb; none: no authentication",
    "tls_cert": "PEM certificate chain: the port speaks TLS only (with --tls-key)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: clients must present a certificate it signed (mutual TLS)",
}
STORE_FLAGS = "store-"  # --store-token, --store-tls-ca, ...: the store client's flags, for secured daemons


def parse_args(argv: Sequence[str] | None = None) -> InstanceConfig:
    defaults = {f.name: f.default for f in dataclasses.fields(InstanceConfig)}
    # defaults written out by hand: a formatter that shows every default would show a token from the environment
    parser = argparse.ArgumentParser(prog="python -m engine.serving.instance",
                                     description="A decode instance: a decode engine behind gRPC "
                                                 "(proto/decode.proto). Prints `READY <port>` once serving. The "
                                                 "--store-* flags are the store client's --token and --tls-* "
                                                 "(`kvstore --help`), for daemons that require them.")
    parser.add_argument("--model", required=True, type=Path, metavar="DIR", help=_HELP["model"])
    parser.add_argument("--host", default=defaults["host"], help=f"{_HELP['host']} (default: {defaults['host']})")
    for name in ("port", "kv_pages", "block_tokens", "max_running", "prefill_tokens_per_step", "threads",
                 "max_message_bytes", "max_calls", "max_calls_per_principal"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name],
                            help=f"{_HELP[name]} (default: {defaults[name]})")
    parser.add_argument("--exit-on-stdin-eof", action="store_true", help=_HELP["exit_on_stdin_eof"])
    parser.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=defaults["speculative"],
                        help=_HELP["speculative"])
    parser.add_argument("--servers", default="", metavar="HOST:PORT,...", help=_HELP["servers"])
    for name in SECURITY_FILES:
        parser.add_argument("--" + name.replace("_", "-"), type=Path, default=None, metavar="FILE", help=_HELP[name])
    add_security_flags(parser, STORE_FLAGS)
    parsed = parser.parse_args(argv)
    args = {name: value for name, value in vars(parsed).items() if name not in STORE_SECURITY}
    args["servers"] = tuple(s for s in args["servers"].split(",") if s)
    args.update({"store_" + name: value for name, value in security_settings(parsed, STORE_FLAGS).items()})
    try:
        return InstanceConfig(**args)
    except ValueError as exc:
        parser.error(str(exc))
