"""The client's one config."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvstore.client.membership import Dns, EtcdMembers, Static, is_target, source

_DISCOVERED_DAEMONS = 8  # the pool's automatic size when the daemons are discovered, not listed


def check_addresses(servers: tuple[str, ...]) -> None:
    """A ValueError naming a daemon listed without its port (or a port that is no number), for a list of
    host:port daemons; a discovery target is checked where it is followed."""
    if servers and not is_target(servers[0]):
        for server in servers:
            host, _, port = server.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"server {server!r} is not host:port: give each daemon's gRPC port, as in "
                                 f"{(host or server).strip('[]') or '127.0.0.1'}:50051 (kvstore-server's default)")


@dataclass(frozen=True, slots=True)
class ClientConfig:
    # "host:port" of every daemon, or one discovery target: dns:///NAME:PORT, dns+srv:///NAME or
    # etcd://HOST:PORT/PREFIX (kvstore/client/membership.py), followed as daemons join and leave
    servers: tuple[str, ...]
    membership_refresh_s: float = 5.0  # how often DNS is asked again (etcd is watched)
    handoff_s: float = 600.0  # after a daemon joins, moved keys are looked for on their previous owners this long
    timeout_s: float = 5.0  # deadline of every data call (Get, Put)
    lookup_timeout_s: float = 1.0  # deadline of control calls (Lookup, Touch, Delete, Stats)
    put_chunk_bytes: int = 4 * 2**20
    max_message_bytes: int = 65 * 2**20  # largest Get part accepted (a whole block plus room)
    down_backoff_s: float = 0.5  # a failed daemon is skipped this long, doubling per failure ...
    max_down_backoff_s: float = 5.0  # ... up to this
    transport: str = "auto"  # "auto": the daemon's raw-TCP data channel when it has one; "grpc": gRPC only
    host_tier_bytes: int = 0  # the client's host-DRAM tier; 0: none
    host_block_bytes: int = 0  # payload bytes of one slot of the host tier (the engine's block size)
    host_tier_pinned: bool = False  # allocate the host tier in pinned memory (CUDA engines; needs torch)
    write_behind_bytes: int = 256 * 2**20  # bound of the queue of saves not yet stored
    # Blocks `prefetch` may have queued or in flight into the host tier, at most (a host slot each); more are
    # refused (counted). 0: no prefetches.
    prefetch_bytes: int = 64 * 2**20
    shared_memory: str = "auto"  # lend shared buffers to daemons: "auto": on this host; "on": always; "off"
    # The client's one thread pool: data-channel calls, load workers, the write-behind queue. 0: two per
    # daemon plus two, room for two loads (a host-tier worker and one per daemon each) at once; at least 2.
    worker_threads: int = 0
    # Security (docs/operations.md, "Running a secured cluster"): what daemons with tokens and TLS expect.
    token: str | None = None  # bearer token sent with every call; never logged
    tls_ca: str | None = None  # PEM CA bundle that signed the daemons' certificates; set: speak TLS
    tls_cert: str | None = None  # PEM client certificate and key, for daemons that require mutual TLS
    tls_key: str | None = None
    tls_server_name: str | None = None  # the name the daemons' certificates carry, if not their address
    # An etcd:// target's etcd: over TLS (its CA; a client certificate where etcd requires one), and as one
    # of etcd's users (a read-only role is enough for clients). Without these, etcd is plain HTTP.
    etcd_tls_ca: str | None = None
    etcd_tls_cert: str | None = None
    etcd_tls_key: str | None = None
    etcd_user: str | None = None
    etcd_password: str | None = None  # never logged
    # Discovered daemons (DNS, etcd) are used only while there are at most this many; more is taken for a
    # hostile or broken answer and the daemons known before stay in use (kvstore/client/membership.py).
    max_members: int = 1024

    def __post_init__(self) -> None:
        servers = self.servers.split(",") if isinstance(self.servers, str) else list(self.servers)
        servers = [s.strip() for s in servers if s.strip()]
        if any(is_target(s) for s in servers):  # an etcd target lists its endpoints with commas
            servers = [",".join(servers)]
        object.__setattr__(self, "servers", tuple(servers))
        if not self.servers:
            raise ValueError("ClientConfig.servers must list at least one daemon as host:port, or name a "
                             "dns:///, dns+srv:/// or etcd:// target")
        check_addresses(self.servers)
        if len(set(self.servers)) != len(self.servers):
            raise ValueError(f"servers lists a daemon twice: {self.servers}")
        for name in ("timeout_s", "lookup_timeout_s", "down_backoff_s", "max_down_backoff_s",
                     "membership_refresh_s", "handoff_s"):
            if not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"ClientConfig.{name} must be positive, got {getattr(self, name)}")
        if self.shared_memory not in ("auto", "on", "off"):
            raise ValueError(f"ClientConfig.shared_memory must be 'auto', 'on' or 'off', got {self.shared_memory!r}")
        if self.transport not in ("auto", "grpc"):
            raise ValueError(f"ClientConfig.transport must be 'auto' or 'grpc', got {self.transport!r}")
        if self.host_tier_bytes and not 0 < self.host_block_bytes <= self.host_tier_bytes:
            raise ValueError("a host tier needs host_block_bytes, the engine's block payload size, "
                             "between 1 and host_tier_bytes")
        for prefix in ("", "etcd_"):
            if (getattr(self, prefix + "tls_cert") is None) != (getattr(self, prefix + "tls_key") is None):
                raise ValueError(f"ClientConfig.{prefix}tls_cert and {prefix}tls_key go together (mutual TLS)")
            if getattr(self, prefix + "tls_cert") is not None and getattr(self, prefix + "tls_ca") is None:
                raise ValueError(f"ClientConfig.{prefix}tls_cert needs {prefix}tls_ca: a client certificate is "
                                 "only sent over TLS")
        for name in ("tls_ca", "tls_cert", "tls_key", "etcd_tls_ca", "etcd_tls_cert", "etcd_tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"ClientConfig.{name}: {path} is not a readable file")
        if (self.etcd_user is None) != (self.etcd_password is None) or self.etcd_user == "":
            raise ValueError("ClientConfig.etcd_user and etcd_password go together, and the user has a name")
        etcd_settings = [name for name in ("etcd_tls_ca", "etcd_tls_cert", "etcd_tls_key", "etcd_user")
                         if getattr(self, name) is not None]
        if etcd_settings and not self.servers[0].startswith("etcd://"):
            raise ValueError(f"ClientConfig.{', '.join(etcd_settings)}: for an etcd://HOST:PORT/PREFIX servers "
                             f"target only, not {self.servers[0]!r}")
        if isinstance(self.max_members, bool) or not isinstance(self.max_members, int) or self.max_members < 1:
            raise ValueError(f"ClientConfig.max_members must be a whole number of daemons, at least 1, "
                             f"got {self.max_members!r}")
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ValueError("ClientConfig.token must be a non-empty token without whitespace")
        if self.worker_threads == 1 or self.worker_threads < 0:
            raise ValueError("ClientConfig.worker_threads must be 0 (automatic) or at least 2: a write-behind "
                             "put waits on the pool for its data-channel call")
        if self.put_chunk_bytes < 1 or self.max_message_bytes < 1 or self.write_behind_bytes < 1:
            raise ValueError("ClientConfig.put_chunk_bytes, max_message_bytes, write_behind_bytes must be positive")
        if isinstance(self.prefetch_bytes, bool) or not isinstance(self.prefetch_bytes, int) or self.prefetch_bytes < 0:
            raise ValueError(f"ClientConfig.prefetch_bytes must be a whole number of bytes, at least 0 (0: no "
                             f"prefetches), got {self.prefetch_bytes!r}")
        self.members()  # a malformed target fails here, with its message

    def members(self) -> Static | Dns | EtcdMembers:
        """Where the daemons come from: the static list, DNS or etcd (kvstore/client/membership.py)."""
        return source(self)

    @property
    def pool_threads(self) -> int:
        """The size of the client's thread pool (`worker_threads`, or the automatic size)."""
        daemons = _DISCOVERED_DAEMONS if is_target(self.servers[0]) else len(self.servers)
        return self.worker_threads or 2 * (daemons + 1)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata of every call: the bearer token, if any."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def __repr__(self) -> str:  # the token and etcd's password stay out of logs and tracebacks
        secret = ("token", "etcd_password")
        shown = {f: getattr(self, f) for f in self.__dataclass_fields__ if f not in secret}
        fields = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        hidden = ", ".join(f"{f}={'***' if getattr(self, f) else None}" for f in secret)
        return f"ClientConfig({fields}, {hidden})"


_SECURITY_FLAGS = {"token": "KVSTORE_TOKEN", "tls_ca": "KVSTORE_TLS_CA", "tls_cert": "KVSTORE_TLS_CERT",
                   "tls_key": "KVSTORE_TLS_KEY", "tls_server_name": "KVSTORE_TLS_SERVER_NAME"}


def security_from_environment() -> dict:
    """The ClientConfig fields the KVSTORE_* variables give: for clients that take no flags (engine plug-ins)."""
    return {name: os.environ[variable] for name, variable in _SECURITY_FLAGS.items() if os.environ.get(variable)}


def add_security_flags(parser, prefix: str = "") -> None:
    """--token, --tls-ca, --tls-cert, --tls-key, --tls-server-name for a command-line client of a secured
    cluster; each defaults to its KVSTORE_* environment variable (a token in a flag shows in `ps`). A
    `prefix` ("store-": --store-token, ...) keeps them apart from a server's own TLS flags."""
    group = parser.add_argument_group("secured daemons (docs/operations.md)")
    for name, variable in _SECURITY_FLAGS.items():
        group.add_argument("--" + prefix + name.replace("_", "-"), dest=_dest(prefix, name),
                           default=os.environ.get(variable), help=f"default: ${variable}")


def security_settings(args, prefix: str = "") -> dict:
    """The ClientConfig fields the flags of `add_security_flags` gave."""
    return {name: getattr(args, _dest(prefix, name)) for name in _SECURITY_FLAGS
            if getattr(args, _dest(prefix, name), None)}


def _dest(prefix: str, name: str) -> str:
    return prefix.replace("-", "_") + name
