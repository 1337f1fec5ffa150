"""Who the daemons are, and following them as they change: a static list, DNS, or etcd.

`ClientConfig.servers` names them; the DNS form follows gRPC's name syntax (grpc/grpc doc/naming.md):

    host:port,host:port                    a static list
    dns:///NAME:PORT                       the A/AAAA records of NAME, each at PORT (the system's resolver)
    dns://RESOLVER[:53]/NAME:PORT          ... asking that resolver
    dns+srv:///_grpc._tcp.NAME             SRV records: each target and port (a Kubernetes headless Service)
    etcd://HOST:2379[,HOST:2379]/PREFIX    daemons registered under PREFIX (kvstore-server --register)

A member has a name, which places keys (rendezvous, kvstore/client/placement.py) and which TLS checks,
and an address to connect to. They differ only for SRV records: the name is the stable pod name
(kvstore-0.kvstore.ns.svc.cluster.local:50051), which keeps its keys when the pod comes back with a new
IP, and the address is what the same resolver says that name is now.

What DNS or etcd says is not taken on trust (`Admission`): at most `max_members` daemons, and a discovered
daemon receives blocks only once it has answered as a daemon of this cluster. A static list is the
operator's own word and is used as written.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import grpc

from kvstore.etcd import Etcd, EtcdAccess, EtcdError, parse_url
from kvstore.proto import method, pb

if TYPE_CHECKING:
    from kvstore.client.config import ClientConfig

log = logging.getLogger(__name__)

SCHEMES = ("dns", "dns+srv", "etcd")


class MembershipError(Exception):
    """The members could not be learnt now (resolver or etcd unreachable, or an answer not to be used);
    the last ones known stay."""


@dataclass(frozen=True, slots=True, order=True)
class Member:
    name: str  # "host:port": identity for placement and the name TLS verifies
    address: str  # "host:port" to connect to


Members = tuple[Member, ...]


def is_target(servers: str) -> bool:
    """Whether `servers` is a discovery target (dns:, dns+srv:, etcd:) rather than a list of addresses."""
    return "://" in servers


# host:port as a member's address: a host name or IPv4 address, or an IPv6 address in brackets.
# Nothing else reaches gRPC, which would read "unix:/path" or "dns:///name" as targets of their own.
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


class Admission:
    """Which of the daemons DNS or etcd lists receive blocks: at most `max_members` of them (more is an
    answer not to be used: MembershipError), and each only once it has answered Info as a daemon of this
    cluster, asked as its Shard will ask (over TLS verified by the client's CA against the member's name,
    with the client's token). One that fails is left out, logged when it first fails (not while it keeps
    failing), and checked again each time the members are read; one that passed is not asked again while
    it stays listed.

    Only TLS proves who answers: the member must hold a certificate of the client's CA for its name. A
    token proves nothing about the daemon (an impostor accepts any token, and receives it); it only leaves
    out honest daemons of other clusters, which refuse it. Without TLS the check keeps out what is not a
    kvstore daemon, such as another service's port (docs/operations.md, "Many daemons")."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.admitted: set[Member] = set()
        self.refused: dict[Member, str] = {}  # member -> why it failed its last check

    def __call__(self, members: Iterable[Member]) -> Members:
        listed = set(members)
        if len(listed) > self.config.max_members:
            raise MembershipError(f"{len(listed)} daemons listed, more than max_members "
                                  f"({self.config.max_members}): not used")
        self.admitted &= listed  # one that leaves is checked again if it comes back: its address may be another's then
        verdicts = _check(listed - self.admitted, self.config)
        self.admitted |= {member for member, why in verdicts.items() if why is None}
        refused = {member: why for member, why in verdicts.items() if why is not None}
        new = sorted((member, why) for member, why in refused.items() if member not in self.refused)
        if new:  # once per member, not at every read of the members
            log.warning("left out %d daemon(s) that did not answer as daemons of this cluster (checked again "
                        "at each read of the members): %s%s", len(new),
                        "; ".join(f"{member.name} ({why})" for member, why in new[:5]),
                        f"; and {len(new) - 5} more" if len(new) > 5 else "")
        self.refused = refused
        return tuple(sorted(self.admitted))


def _check(members: set[Member], config: ClientConfig) -> dict[Member, str | None]:
    """Info asked of every member at once, each within `lookup_timeout_s`: None for one that answered as
    a kvstore daemon, otherwise why not."""
    verdicts: dict[Member, str | None] = {m: "its address is not host:port" for m in members if not _valid(m.address)}
    try:
        credentials = _credentials(config)
    except OSError as exc:  # a CA or key file gone since start: every check fails, and the follower lives on
        return {**verdicts, **{m: f"reading the client's TLS files: {exc}" for m in members if m not in verdicts}}
    calls = []
    try:
        for member in members - verdicts.keys():
            channel = _channel(member, config, credentials)
            info = channel.unary_unary(method("Info"), pb.InfoRequest.SerializeToString, pb.InfoResponse.FromString)
            calls.append((member, channel, info.future(pb.InfoRequest(), timeout=config.lookup_timeout_s,
                                                       metadata=config.metadata)))
        for member, _, call in calls:
            try:
                answer = call.result()
            except grpc.RpcError as exc:
                verdicts[member] = f"{exc.code().name}: {exc.details()}"
            else:
                verdicts[member] = None if answer.version else "its Info names no version"
    finally:
        for _, channel, _ in calls:
            channel.close()
    return verdicts


def _valid(address: str) -> bool:
    match = _HOST_PORT.fullmatch(address)
    return match is not None and 0 < int(match.group(1)) < 65536


def _credentials(config: ClientConfig) -> grpc.ChannelCredentials | None:
    """The client's TLS credentials (the same files as its Shards'), None without TLS."""
    if config.tls_ca is None:
        return None
    files: dict[str, bytes | None] = {}
    for name in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(config, name)
        if path is None:
            files[name] = None
        else:
            with open(path, "rb") as f:
                files[name] = f.read()
    return grpc.ssl_channel_credentials(files["tls_ca"], files["tls_key"], files["tls_cert"])


def _channel(member: Member, config: ClientConfig, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    """A channel to `member`; TLS verifies the member's name, as its Shard's channel does."""
    options: list[tuple[str, int | str]] = [("grpc.enable_retries", 0)]
    if credentials is None:
        return grpc.insecure_channel(member.address, options=options)
    server_name = config.tls_server_name or (member.name.rpartition(":")[0].strip("[]")
                                             if member.name != member.address else None)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(member.address, credentials, options=options)


class Static:
    follows = False

    def __init__(self, addresses: tuple[str, ...]) -> None:
        self.members = tuple(Member(a, a) for a in addresses)

    def resolve(self) -> Members:
        return self.members

    def follow(self, stop: threading.Event, changed: Callable[[Members], None]) -> None:
        pass


class Dns:
    """A or SRV records, asked again every `refresh_s` (a headless Service's records change as pods do)."""

    follows = True

    def __init__(self, target: str, config: ClientConfig) -> None:
        parts = urlsplit(target)
        self.srv = parts.scheme == "dns+srv"
        self.refresh_s, self.timeout_s = config.membership_refresh_s, config.lookup_timeout_s
        self.admit = Admission(config)
        name = parts.path.lstrip("/")
        if self.srv:
            self.name, self.port = name, None
        else:
            self.name, _, port = name.rpartition(":")
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{target!r}: a dns:/// target ends in :PORT, the daemons' gRPC port")
            self.port = int(port)
        if not self.name:
            raise ValueError(f"{target!r} names no DNS name")
        self.nameserver: tuple[str, int] | None = None
        if parts.netloc:
            host, _, port = parts.netloc.rpartition(":") if ":" in parts.netloc else (parts.netloc, "", "53")
            if not port.isdigit():
                raise ValueError(f"{target!r}: the resolver is HOST[:PORT]")
            self.nameserver = (host.strip("[]"), int(port))

    def _resolver(self):
        import dns.resolver  # only clients that ask DNS load it

        resolver = dns.resolver.Resolver(configure=self.nameserver is None)
        if self.nameserver is not None:
            resolver.nameservers, resolver.port = [self.nameserver[0]], self.nameserver[1]
        resolver.lifetime = self.timeout_s
        resolver.cache = None  # every refresh asks again: a record's TTL is not when pods change
        return resolver

    def resolve(self) -> Members:
        return self.admit(self._listed())

    def _listed(self) -> Members:
        import dns.exception
        import dns.resolver

        resolver = self._resolver()
        try:
            if not self.srv:
                return tuple(sorted(Member(f"{ip}:{self.port}", f"{_bracket(ip)}:{self.port}")
                                    for ip in _addresses(resolver, self.name)))
            members = []
            for record in resolver.resolve(self.name, "SRV"):
                host = record.target.to_text(omit_final_dot=True)
                try:
                    ips = _addresses(resolver, host)
                except dns.exception.DNSException:
                    ips = []  # connect by name: the system's resolver may know it
                address = f"{_bracket(ips[0])}:{record.port}" if ips else f"{host}:{record.port}"
                members.append(Member(f"{host}:{record.port}", address))
            return tuple(sorted(set(members)))
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return ()  # a Service with no ready pods publishes no records: no daemons now
        except dns.exception.DNSException as exc:
            raise MembershipError(f"DNS {self.name}: {exc}") from exc

    def follow(self, stop: threading.Event, changed: Callable[[Members], None]) -> None:
        while not stop.wait(self.refresh_s):
            try:
                changed(self.resolve())
            except MembershipError as exc:
                log.warning("keeping the daemons known: %s", exc)


def _addresses(resolver, name: str) -> list[str]:
    """The A and AAAA records of `name`; a resolver that fails one kind (some refuse AAAA) is not asked again."""
    import dns.exception
    import dns.resolver

    found, failure = [], None
    for kind in ("A", "AAAA"):
        try:
            found += [record.to_text() for record in resolver.resolve(name, kind)]
        except dns.resolver.NoAnswer:
            pass
        except dns.exception.DNSException as exc:
            if isinstance(exc, dns.resolver.NXDOMAIN) or failure is None:
                failure = exc
    if not found and failure is not None:
        raise failure
    return found


def _bracket(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


class EtcdMembers:
    """The daemons registered under a prefix, each key `PREFIX<address>` held by its daemon's lease: a daemon
    that stops or dies drops out when its lease ends. A watch delivers changes as they happen."""

    follows = True

    def __init__(self, target: str, config: ClientConfig) -> None:
        endpoints, self.prefix = parse_url(target)
        self.etcd = Etcd(endpoints, config.lookup_timeout_s,
                         EtcdAccess(config.etcd_tls_ca, config.etcd_tls_cert, config.etcd_tls_key,
                                    config.etcd_user, config.etcd_password))
        self.refresh_s = config.membership_refresh_s
        self.admit = Admission(config)
        self.revision = 0
        self.registered: dict[str, str] = {}

    def resolve(self) -> Members:
        self.revision = 0  # until a read succeeds and is used: the follower reads again before it watches
        try:
            self.registered, revision = self.etcd.range_prefix(self.prefix)
        except EtcdError as exc:
            raise MembershipError(str(exc)) from exc
        members = self._members()
        self.revision = revision
        return members

    def _members(self) -> Members:
        return self.admit(Member(address, address) for address in self.registered.values() if address)

    def follow(self, stop: threading.Event, changed: Callable[[Members], None]) -> None:
        retry_s = 0.2
        while not stop.is_set():
            try:
                if not self.revision:  # the last read failed (or broke off): a watch starts from a good one
                    changed(self.resolve())
                    retry_s = 0.2
                # While a listed daemon is left out, the watch ends after membership_refresh_s without news,
                # and reading the range again checks it again.
                waiting = bool(self.admit.refused)
                for events in self.etcd.watch(self.prefix, self.revision + 1, self.refresh_s if waiting else None):
                    for kind, key, value in events:
                        if kind == "PUT":
                            self.registered[key] = value or ""
                        else:
                            self.registered.pop(key, None)
                    changed(self._members())
                    if self.admit.refused and not waiting:
                        break  # one was left out just now: a watch that wakes to check it again
                if stop.is_set():
                    return
                changed(self.resolve())  # the watch ended (compaction, a restarted etcd, a quiet spell): read afresh
            except (EtcdError, MembershipError) as exc:
                if stop.is_set():
                    return
                log.warning("etcd watch of %s: %s; retrying in %.1f s", self.prefix, exc, retry_s)
                self.revision = 0
                stop.wait(retry_s)
                retry_s = min(retry_s * 2, 5.0)

    def cancel(self) -> None:
        self.etcd.cancel()


def source(config: ClientConfig) -> Static | Dns | EtcdMembers:
    """Where the members come from, for `config.servers`; ValueError for a malformed target."""
    servers = config.servers
    if len(servers) != 1 or not is_target(servers[0]):
        return Static(servers)
    target = servers[0]
    scheme = urlsplit(target).scheme
    if scheme in ("dns", "dns+srv"):
        return Dns(target, config)
    if scheme == "etcd":
        return EtcdMembers(target, config)
    raise ValueError(f"{target!r}: servers is host:port,... or a target of scheme {', '.join(SCHEMES)}")


class Follower:
    """A thread that tells `changed` each new set of members (a static list never changes: no thread)."""

    def __init__(self, members: Static | Dns | EtcdMembers, known: Members,
                 changed: Callable[[Members], None]) -> None:
        self.members = members
        self._stop = threading.Event()
        self._last = known
        self._changed = changed
        self._thread = threading.Thread(target=members.follow, args=(self._stop, self._tell),
                                        name="kvstore-membership", daemon=True)
        self._thread.start()

    def _tell(self, members: Members) -> None:
        if members != self._last:
            self._last = members
            self._changed(members)

    def stop(self) -> None:
        self._stop.set()
        if isinstance(self.members, EtcdMembers):
            self.members.cancel()
        self._thread.join(timeout=2.0)
