"""A decode instance's one config, and its command line (`python -m engine.serving.instance --help`): flags,
KVSTORE_DECODE_* variables and a TOML file, generated from `InstanceConfig` as the daemon's are
(kvstore/settings.py); each field's comment is its help."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.decode import DecodeConfig
from engine.model.dtype import check_name as check_dtype
from engine.prefill.config import BLOCK_TOKENS, KV_PAGES
from kvstore.client.config import ClientConfig
from kvstore.codec import DEFAULT as DEFAULT_CODEC
from kvstore.codec import codec_named
from kvstore.settings import Command

MAX_MESSAGE_BYTES = 2**20  # a 1 MiB request holds a prompt of >200k token ids: past these models' contexts
SECURITY_FILES = ("auth_tokens", "tls_cert", "tls_key", "tls_client_ca")


@dataclass(frozen=True)
class InstanceConfig:
    model: Path  # the model directory (config.json + safetensors weights)
    # What weights, activations and KV are computed and stored in: auto (bfloat16 where the CPU multiplies it
    # natively, AVX512-BF16 or AMX; else float32), bfloat16 or float32 (the reference). The store's namespace
    # includes it: engines of different dtypes never share cached blocks
    dtype: str = "auto"
    host: str = "127.0.0.1"  # the address to listen on
    port: int = 0  # the port to listen on; 0: a free one, printed on the READY line
    kv_pages: int = KV_PAGES  # KV pages the engine holds (its KV capacity is pages x block tokens)
    # Tokens per KV page, and per stored block with servers; the store's namespace includes it, so a prefill
    # process handing prompts over, or kvstore-api sharing the store, must use the same (engine.prefill.config)
    block_tokens: int = BLOCK_TOKENS
    # The form cached blocks take in the store (kvstore/codec.py: raw, zstd, int8, int4); part of the namespace,
    # so it must match the other processes sharing the store's prompts
    kv_codec: str = DEFAULT_CODEC
    max_running: int = 64  # sequences decoded at once; more wait for a slot
    prefill_tokens_per_step: int = 2048  # prompt tokens one step computes besides the decoding sequences' tokens
    threads: int = 1  # torch threads: several instances share a machine's cores, so one each by default
    max_message_bytes: int = MAX_MESSAGE_BYTES  # largest request received; past it, RESOURCE_EXHAUSTED
    # Generate calls held at once, running or queued; past it a call ends RESOURCE_EXHAUSTED at once. A queued
    # call holds its prompt, so this bounds the instance's memory
    max_calls: int = 512
    # Of max_calls, the calls one principal holds (a token's name, else the peer's address: a router is one
    # principal), leaving room for the others; past it, RESOURCE_EXHAUSTED
    max_calls_per_principal: int = 256
    # Shut down when stdin ends (a parent holding the pipe died or closed it): children started on a pipe die
    # with their parent
    exit_on_stdin_eof: bool = False
    # Speculative decoding (DecodeConfig.speculative): n-gram drafts verified on the DSpark schedule, lossless;
    # its SPS profile is measured at the first start on a machine and cached
    speculative: bool = True
    # The store's daemons, host:port,... or a dns:///, dns+srv:/// or etcd:// target (docs/deployment.md):
    # prompts are prefilled through the store and replies saved; none: prompts are computed here and nothing
    # is saved
    servers: tuple[str, ...] = ()
    # TOML token file, as the daemon's (`kvstore token new`; kvstore/server/auth.py): every call needs a token,
    # Generate its write verb, Load its read verb; none: no authentication
    auth_tokens: Path | None = None
    tls_cert: Path | None = None  # PEM certificate chain: the port speaks TLS only (with tls_key)
    tls_key: Path | None = None  # the PEM private key of tls_cert
    tls_client_ca: Path | None = None  # PEM CA bundle: clients must present a certificate it signed (mutual TLS)
    # The instance as a client of secured daemons (with servers): the store client's token and TLS settings
    # (`kvstore --help`), each by default the client's own variable. The bearer token: $KVSTORE_TOKEN by
    # default, which `ps` does not show as it shows a flag; never shown here
    store_token: str | None = field(default=None, repr=False)
    store_tls_ca: str | None = None  # PEM CA bundle that signed the daemons' certificates; $KVSTORE_TLS_CA by default
    store_tls_cert: str | None = None  # PEM client certificate, for mutual TLS; $KVSTORE_TLS_CERT by default
    store_tls_key: str | None = None  # its PEM key; $KVSTORE_TLS_KEY by default
    # the name the daemons' certificates carry, if not their address; $KVSTORE_TLS_SERVER_NAME by default
    store_tls_server_name: str | None = None

    def __post_init__(self) -> None:
        check_dtype(self.dtype, "InstanceConfig")
        codec_named(self.kv_codec, "InstanceConfig")
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
COMMAND = Command(InstanceConfig, "python -m engine.serving.instance",
                  "A decode instance: a decode engine behind gRPC (proto/decode.proto). Prints `READY <port>` once "
                  "serving.", "KVSTORE_DECODE_",
                  metavars={"model": "DIR", "servers": "HOST:PORT,...", **{name: "FILE" for name in SECURITY_FILES}})


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> InstanceConfig:
    """The config from flags, KVSTORE_DECODE_* variables and the TOML file they name, over the store client's
    KVSTORE_TOKEN, KVSTORE_TLS_* for the store_* settings; a bad one exits 2 with its message."""
    environ = os.environ if environ is None else environ
    client = {name: environ[variable] for name in STORE_SECURITY
              if environ.get(variable := "KVSTORE_" + name.removeprefix("store_").upper())}
    return COMMAND.parse(argv, environ, fallback=client)
