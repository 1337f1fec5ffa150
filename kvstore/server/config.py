"""The daemon's one config: defaults < TOML file < KVSTORE_* environment < command-line flags (kvstore/settings.py
generates them from `ServerConfig`; each field's comment is its flag's help).

Every field is validated in `__post_init__` with a message that says what to change. Sizes accept
"64MiB"/"1GB"/plain bytes, durations "3d"/"12h"/"90s"/plain seconds (kvstore/units.py, the one parser of both).
deploy/kvstore.toml lists every field; kvstore/server/config_example.py writes it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.eviction import POLICIES
from kvstore.record import CLASS_NAME_BYTES
from kvstore.settings import Command
from kvstore.units import parse_duration, parse_size  # noqa: F401  (kvstore.server.config.parse_size stays importable)

if TYPE_CHECKING:
    from kvstore.etcd import EtcdAccess

UNIX_PATH_MAX = 107  # sun_path is 108 bytes, NUL included

# "handoff": the records a prefill process hands a decode process (engine/prefill/handoff.py), read within seconds;
# "window": a session's latest sliding-window state (engine/window/record.py), worth keeping while it is active;
# "encoder": an image's vision encoder outputs (engine/vision/stage.py), reused while the image is
DEFAULT_DATA_DIR = Path("./data")  # relative: under the working directory; the daemon says so at start-up
DEFAULT_CLASSES = {"agent": 3 * 86400.0, "chat": 7 * 86400.0, "handoff": 600.0, "window": 3600.0, "encoder": 86400.0}


@dataclass(slots=True)
class ServerConfig:
    data_dir: Path = DEFAULT_DATA_DIR
    host: str = "127.0.0.1"
    port: int = 50051  # 0: the OS picks one; see port_file
    port_file: Path | None = None  # written with the bound port once serving
    metrics_port: int | None = None  # Prometheus /metrics; off: none, 0: the OS picks one
    metrics_host: str = "127.0.0.1"  # /metrics is plain HTTP without tokens: loopback unless set otherwise
    data_port: int | None = 50052  # raw-TCP bulk data channel; off: none (gRPC only), 0: the OS picks one
    # The data channel on a Unix socket, for clients on this host and the only path to shared memory;
    # relative to data_dir unless absolute; off: none. At most 107 bytes as an absolute path (sun_path).
    data_socket: Path | None = Path("data.sock")

    capacity_bytes: int = 64 * 2**30
    high_watermark: float = 0.95
    # The most of the budget one tenant's blocks may hold; past it that tenant's own least recently used
    # blocks go, so one tenant cannot evict another's. 1.0: no quota (a lone tenant may use it all).
    tenant_max_share: float = 1.0
    low_watermark: float = 0.85
    segment_bytes: int = 256 * 2**20
    compaction_min_garbage: float = 0.5  # compact a sealed segment once this share of it is dead
    hot_tier_bytes: int = 256 * 2**20
    header_cache_bytes: int = 64 * 2**20  # record headers kept in memory, so a cold read is one device request; 0: off
    # Promotion (docs/design.md section 5): blocks engines will read soon (Advise continues=true, Lookup with
    # promote) are copied from SSD into the DRAM tier while no Get is served. The most bytes of promoted blocks
    # not yet read the tier holds at once; "off" (unset): a quarter of hot_tier_bytes; 0: no promotion.
    promote_bytes: int | None = None
    promote_queue_keys: int = 4096  # blocks waiting to be promoted, at most; more are dropped (counted)
    # A promoted block not read within this long stops being held for its read: its part of promote_bytes is
    # freed (counted wasted); the block stays in the DRAM tier as any other entry.
    promote_max_age_s: float = 60.0
    # lru, s3fifo, sieve, prefix-lfu, prefix-reuse or adaptive (kvstore/eviction/; adaptive is the one
    # recommended: never below LRU across the measured workloads; lru stays the default until the fault
    # suite has run with adaptive, see docs/performance.md)
    eviction_policy: str = "lru"
    # Hot prefixes (docs/design.md, "Hot blocks"): a block read at least hot_reads times within about
    # hot_window_s is announced hot, and clients keep hot_replicas copies of it, reading any; 1: no copies.
    hot_replicas: int = 1
    hot_reads: int = 32  # reads of one block within about hot_window_s that make it hot
    hot_window_s: float = 10.0  # the window reads are counted in (a rate spans one to two of them)
    access_log: Path | None = None  # a compact line per block read or stored, for `kvstore analytics log`
    access_log_max_bytes: int = 256 * 2**20  # then it is rotated once, to <access_log>.1

    classes: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_CLASSES))  # name -> TTL seconds
    default_class: str = "chat"
    expiry_bucket_s: float = 3600.0  # segments are bucketed by expiry time at this granularity
    sweep_interval_s: float = 10.0
    access_flush_interval_s: float = 5.0
    # The scrub (docs/operations.md, "Scrub"): every record the index points at is read back into the daemon's
    # own memory and checked, at most this many bytes a second; a corrupt block is dropped (counted). 0: no scrub.
    scrub_bytes_per_s: int = 32 * 2**20
    scrub_pause_s: float = 60.0  # rest between scrub passes, and before the first (start-up's reads come first)
    # Verify (a client's report of blocks that failed its checks; docs/operations.md, "Scrub") re-reads them: each
    # principal's checks are held to this many record bytes a second, at most one second of it saved up; keys past
    # it are passed over (counted, not an error; the client's next report is checked once the budget refills).
    verify_bytes_per_s: int = 32 * 2**20
    # A block checked this recently (and not moved since) is not read again for a report: the answer is that
    # check's. 0: every report is checked.
    verify_recheck_s: float = 60.0

    durability: str = "os"  # "os": page cache, survives a process crash; "fsync": synced before ack
    # Records at least this large are appended with O_DIRECT, 4 KiB-aligned, through a reused buffer, so
    # a put does not wait for fresh page-cache pages (docs/performance.md); 0: every append is buffered.
    direct_io_min_bytes: int = 1 * 2**20
    lmdb_map_bytes: int = 1 * 2**30
    lmdb_max_map_bytes: int = 1 * 2**40

    max_block_bytes: int = 64 * 2**20
    max_message_bytes: int = 16 * 2**20
    max_inflight_put_bytes: int = 512 * 2**20
    max_keys_per_request: int = 65536
    max_concurrent_rpcs: int = 256
    max_region_bytes: int = 4 * 2**30  # largest shared-memory region a same-host client may lend
    io_threads: int = 8
    grace_s: float = 5.0
    data_frame_timeout_s: float = 30.0  # a data-channel client stalled inside a frame this long is dropped
    data_idle_timeout_s: float = 60.0  # a data connection silent between frames this long is closed
    max_data_connections: int = 512  # data-channel connections at once (TCP and Unix socket together)
    max_data_connections_per_peer: int = 64  # of them from one address (TCP) or one user (Unix socket)
    max_unfinished_frame_bytes: int = 256 * 2**20  # bytes held daemon-wide for frames still arriving
    # What one caller may hold (docs/operations.md, "Limits"): a principal is a token, or a peer without tokens.
    max_inflight_put_bytes_per_principal: int = 256 * 2**20  # of max_inflight_put_bytes, one principal's share
    put_record_timeout_s: float = 60.0  # a record must arrive whole this long after its PutHead (both transports)
    max_concurrent_rpcs_per_principal: int = 128  # of max_concurrent_rpcs, the gRPC calls one principal has open
    max_concurrent_rpcs_per_connection: int = 64  # gRPC calls open on one connection (HTTP/2 concurrent streams)
    rpc_stream_timeout_s: float = 30.0  # a gRPC stream whose client sends (Put) or takes (Get) nothing this long ends
    max_grpc_send_bytes: int = 256 * 2**20  # memory held daemon-wide for gRPC Get payloads clients have not taken
    max_grpc_send_bytes_per_principal: int = 128 * 2**20  # of it, one principal's share
    max_grpc_connections: int = 4096  # gRPC connections at once; fewer if the descriptor limit leaves less room
    grpc_handshake_timeout_s: float = 10.0  # a gRPC connection must finish TLS and the HTTP/2 preface within this
    grpc_connection_idle_s: float = 300.0  # a gRPC connection without a call this long is closed (GOAWAY)
    fd_reserve: int = 1024  # descriptors no connection may take: segment files, the index, logs
    log_level: str = "INFO"
    # Shut down as on SIGTERM when stdin ends: a daemon started on a pipe ends with its parent, however
    # the parent ends (kvstore/server/process.py starts every child so).
    exit_on_stdin_eof: bool = False

    # Membership in etcd (docs/deployment.md): "etcd://HOST:2379/PREFIX" registers this daemon under PREFIX
    # while it serves, for clients given the same target; None: clients list the daemons or use DNS.
    register: str | None = None
    advertise: str | None = None  # "host:port" clients reach this daemon at; default: host and port, if specific
    register_ttl_s: float = 10.0  # the lease: a daemon that dies leaves the membership this long after
    # A secured etcd (docs/operations.md): TLS, a client certificate where etcd asks for one, an etcd user
    etcd_tls_ca: Path | None = None  # PEM CA that signed etcd's server certificate: register over TLS
    etcd_tls_cert: Path | None = None  # PEM client certificate for etcd --client-cert-auth (with etcd_tls_key)
    etcd_tls_key: Path | None = None  # its PEM key
    etcd_user: str | None = None  # one of etcd's users, whose role may write the prefix
    etcd_password_file: Path | None = None  # its password, in a file (a flag's value is public on the host)
    # After SIGTERM, a registered daemon leaves the membership at once and serves on this long before its
    # drain, so clients copy the blocks they read from it to their new owners (docs/operations.md).
    leave_drain_s: float = 0.0

    # Security (docs/operations.md, "Running a secured cluster"). Off by default for loopback development.
    auth_tokens: Path | None = None  # TOML token file (kvstore/server/auth.py); None: no authentication
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key, gRPC and the data channel speak TLS
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # PEM CA bundle; when set, clients must present a certificate it signed

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def promote_budget_bytes(self) -> int:
        """`promote_bytes`, or where it is unset a quarter of the DRAM tier; 0: no promotion."""
        return self.hot_tier_bytes // 4 if self.promote_bytes is None else self.promote_bytes

    @property
    def loopback_only(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.port_file is not None:
            self.port_file = Path(self.port_file)
        if self.access_log is not None:
            self.access_log = Path(self.access_log)
        if self.data_socket is not None:
            self.data_socket = Path(os.path.abspath(self.data_dir / self.data_socket))
            if "\x00" in str(self.data_socket):
                raise ValueError("data_socket must be a path without NUL bytes")
            if len(os.fsencode(self.data_socket)) > UNIX_PATH_MAX:
                raise ValueError(f"data_socket {self.data_socket} is longer than the {UNIX_PATH_MAX} bytes a Unix "
                                 "socket path may have; set data_socket to a shorter absolute path (or 'off')")
        for name in ("auth_tokens", "tls_cert", "tls_key", "tls_client_ca"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, Path(value))
                if not _is_file(getattr(self, name)):
                    raise ValueError(f"{name}: {value} is not a readable file")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both (PEM files) or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key as well")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(POLICIES)}, got {self.eviction_policy!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535 (0 lets the OS choose), got {self.port}")
        for name in ("metrics_port", "data_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be 0..65535, or 'off', got {value}")
        if not 0 < self.tenant_max_share <= 1:
            raise ValueError(f"tenant_max_share must be in (0, 1], the most of the budget one tenant may hold; "
                             f"got {self.tenant_max_share}")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError(
                f"need 0 < low_watermark < high_watermark <= 1, got {self.low_watermark} and {self.high_watermark}"
            )
        if not 0 < self.compaction_min_garbage < 1:
            raise ValueError(f"compaction_min_garbage must be in (0, 1), got {self.compaction_min_garbage}")
        if self.durability not in ("os", "fsync"):
            raise ValueError(f"durability must be 'os' or 'fsync', got {self.durability!r}")
        if not self.classes:
            raise ValueError("classes must name at least one traffic class with its TTL, e.g. chat = '7d'")
        classes = {}
        for name, ttl in self.classes.items():
            try:
                classes[name] = parse_duration(ttl)
            except ValueError as exc:
                raise ValueError(f"TTL of class {name!r}: {exc}") from None
        self.classes = classes
        for name, ttl in self.classes.items():
            if not name or len(name.encode()) > CLASS_NAME_BYTES:
                raise ValueError(f"traffic class names are 1..{CLASS_NAME_BYTES} bytes, got {name!r}")
            if ttl <= 0:
                raise ValueError(f"TTL of class {name!r} must be positive, got {ttl}")
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of the classes {sorted(self.classes)}")
        for name in ("capacity_bytes", "segment_bytes", "max_block_bytes", "max_message_bytes",
                     "max_inflight_put_bytes", "lmdb_map_bytes", "max_keys_per_request", "max_region_bytes",
                     "max_concurrent_rpcs", "io_threads", "access_log_max_bytes", "max_data_connections",
                     "max_data_connections_per_peer", "max_unfinished_frame_bytes", "hot_replicas", "hot_reads",
                     "verify_bytes_per_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.direct_io_min_bytes < 0:
            raise ValueError(f"direct_io_min_bytes must be >= 0 (0: no direct I/O), got {self.direct_io_min_bytes}")
        if self.scrub_bytes_per_s < 0:
            raise ValueError(f"scrub_bytes_per_s must be >= 0 (0 turns the scrub off), got {self.scrub_bytes_per_s}")
        if self.header_cache_bytes < 0:
            raise ValueError(f"header_cache_bytes must be >= 0 (0: headers are read from the files), "
                             f"got {self.header_cache_bytes}")
        if self.hot_tier_bytes < 0:
            raise ValueError(f"hot_tier_bytes must be >= 0 (0 disables the DRAM tier), got {self.hot_tier_bytes}")
        if self.promote_bytes is not None and self.promote_bytes < 0:
            raise ValueError(f"promote_bytes must be >= 0 (0: no promotion; off: a quarter of hot_tier_bytes), "
                             f"got {self.promote_bytes}")
        if self.promote_queue_keys < 1:
            raise ValueError(f"promote_queue_keys must be positive (promote_bytes = 0 turns promotion off), "
                             f"got {self.promote_queue_keys}")
        if not 0 <= self.verify_recheck_s < math.inf:
            raise ValueError(f"verify_recheck_s must be >= 0 seconds (0: every report is checked), "
                             f"got {self.verify_recheck_s}")
        if self.lmdb_max_map_bytes < self.lmdb_map_bytes:
            raise ValueError("lmdb_max_map_bytes must be >= lmdb_map_bytes")
        if self.max_block_bytes > self.max_inflight_put_bytes:
            raise ValueError("max_inflight_put_bytes must be >= max_block_bytes, or no block could ever be put")
        if self.max_block_bytes > self.max_unfinished_frame_bytes:
            raise ValueError("max_unfinished_frame_bytes must be >= max_block_bytes, or no block could ever arrive "
                             "on the data channel")
        if self.max_data_connections_per_peer > self.max_data_connections:
            raise ValueError("max_data_connections_per_peer must be <= max_data_connections")
        for name in ("expiry_bucket_s", "sweep_interval_s", "access_flush_interval_s", "grace_s",
                     "data_frame_timeout_s", "data_idle_timeout_s", "hot_window_s", "scrub_pause_s",
                     "promote_max_age_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        self._check_caller_limits()
        self._check_registration()
        if not isinstance(self.exit_on_stdin_eof, bool):
            raise ValueError(f"exit_on_stdin_eof must be true or false, got {self.exit_on_stdin_eof!r}")
        if not isinstance(self.log_level, str) or self.log_level.upper() not in logging.getLevelNamesMapping():
            raise ValueError(f"log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got {self.log_level!r}")

    def _check_registration(self) -> None:
        # Checked with or without `register`: a config accepted now must not turn invalid when it is added.
        if not 0 <= self.leave_drain_s < math.inf:
            raise ValueError(f"leave_drain_s must be >= 0 seconds, got {self.leave_drain_s}")
        if not 1 <= self.register_ttl_s < math.inf:
            raise ValueError(f"register_ttl_s must be at least 1 second (etcd leases are whole seconds), "
                             f"got {self.register_ttl_s}")
        if (self.etcd_tls_cert is None) != (self.etcd_tls_key is None):
            raise ValueError("etcd_tls_cert and etcd_tls_key go together (mutual TLS)")
        if self.etcd_tls_cert is not None and self.etcd_tls_ca is None:
            raise ValueError("etcd_tls_cert needs etcd_tls_ca: a client certificate is only sent over TLS")
        if (self.etcd_user is None) != (self.etcd_password_file is None) or self.etcd_user == "":
            raise ValueError("etcd_user and etcd_password_file go together, and the user has a name")
        for name in ("etcd_tls_ca", "etcd_tls_cert", "etcd_tls_key", "etcd_password_file"):
            path = getattr(self, name)
            if path is not None and not _is_file(Path(path)):
                raise ValueError(f"{name}: {path} is not a readable file")
        if self.register is None:
            return
        from kvstore.etcd import parse_url

        parse_url(self.register)  # ValueError with the shape it wants
        if self.advertise is None and (self.host in ("0.0.0.0", "::", "") or self.port == 0):
            raise ValueError("register needs advertise=host:port: the address clients reach this daemon at "
                             f"(host {self.host!r} and port {self.port} name no single address)")
        advertise = self.advertised
        host, _, port = advertise.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"advertise must be host:port, got {advertise!r}")

    def etcd_access(self) -> EtcdAccess:
        """How registration reaches etcd: an `kvstore.etcd.EtcdAccess` from the etcd_* settings."""
        from kvstore.etcd import EtcdAccess

        password = Path(self.etcd_password_file).read_text().strip() if self.etcd_password_file else None
        string = lambda path: None if path is None else str(path)
        return EtcdAccess(string(self.etcd_tls_ca), string(self.etcd_tls_cert), string(self.etcd_tls_key),
                          self.etcd_user, password)

    @property
    def advertised(self) -> str:
        """The address registered in etcd: `advertise`, or host:port."""
        return self.advertise or f"{self.host}:{self.port}"

    def _check_caller_limits(self) -> None:
        """The limits on what one caller may hold (kvstore/server/limits.py)."""
        for name in ("max_inflight_put_bytes_per_principal", "max_concurrent_rpcs_per_principal",
                     "max_concurrent_rpcs_per_connection", "max_grpc_send_bytes", "max_grpc_send_bytes_per_principal",
                     "max_grpc_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_inflight_put_bytes_per_principal < self.max_block_bytes:
            raise ValueError("max_inflight_put_bytes_per_principal must be >= max_block_bytes, or no block could "
                             "ever be put; raise it or lower max_block_bytes")
        if self.max_concurrent_rpcs_per_connection > self.max_concurrent_rpcs:
            raise ValueError("max_concurrent_rpcs_per_connection must be <= max_concurrent_rpcs")
        if self.fd_reserve < 64:
            raise ValueError(f"fd_reserve must be at least 64 (the daemon's own files), got {self.fd_reserve}")
        for name in ("put_record_timeout_s", "rpc_stream_timeout_s", "grpc_handshake_timeout_s",
                     "grpc_connection_idle_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")


# The help of each field whose definition has no comment of its own (the others' comment is their help).
DESCRIPTIONS = {
    "data_dir": "segment files, the LMDB index and the LOCK file (docs/operations.md, \"On disk\")",
    "host": "the address gRPC and the TCP data channel listen on",
    "capacity_bytes": "budget for segment files on disk; eviction starts at high_watermark of it",
    "high_watermark": "eviction starts when live blocks fill this share of capacity_bytes",
    "low_watermark": "... and frees blocks until they are back under this share",
    "segment_bytes": "an open segment file is sealed at this size and a new one started",
    "hot_tier_bytes": "DRAM tier in front of the segment files; 0: off",
    "default_class": "the traffic class of a put that names none (one of [classes])",
    "sweep_interval_s": "the background pass (expire, evict, compact) runs at least this often",
    "access_flush_interval_s": "last-access times are written to the index at most this often",
    "lmdb_map_bytes": "the index's LMDB map to begin with; it doubles as it fills",
    "lmdb_max_map_bytes": "... up to this, past which puts fail with the index full",
    "max_block_bytes": "the largest record (one block's header and payload) a put may store",
    "max_message_bytes": "the largest gRPC message the daemon receives",
    "max_inflight_put_bytes": "bytes of records being put, daemon-wide; a put past it waits a little, then is refused",
    "max_keys_per_request": "the most keys one request may name",
    "max_concurrent_rpcs": "gRPC calls open at once, daemon-wide (not the health check); one more is refused",
    "io_threads": "threads doing the blocking disk and index work",
    "grace_s": "on SIGTERM or SIGINT, how long open calls get to finish",
    "log_level": "DEBUG, INFO, WARNING, ERROR or CRITICAL",
    "tls_key": "the PEM private key of tls_cert",
}


def _classes(value: Any) -> dict[str, Any]:
    """Traffic class -> TTL as written: "agent=3d,chat=7d" or a TOML table (ServerConfig parses the TTLs)."""
    if isinstance(value, str):
        value = dict(item.split("=", 1) for item in value.split(",") if item)
    return {str(k).strip(): v for k, v in dict(value).items()}


COMMAND = Command(ServerConfig, "kvstore-server", "The kvstore storage daemon.", "KVSTORE_",
                  descriptions=DESCRIPTIONS, metavars={"classes": "NAME=TTL,..."}, parsers={"classes": _classes})


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Build the config from flags (`argv`), the environment and the TOML file named by --config."""
    return COMMAND.load(argv, environ)


def _is_file(path: Path) -> bool:
    """Path.is_file, False rather than OSError for a name the OS refuses to look up (ENAMETOOLONG, EACCES on
    a parent): a config naming such a file is refused with a message, not a traceback."""
    try:
        return path.is_file()
    except OSError:
        return False
