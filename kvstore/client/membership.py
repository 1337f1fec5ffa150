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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvstore.etcd import Etcd, EtcdError, parse_url

log = logging.getLogger(__name__)

SCHEMES = ("dns", "dns+srv", "etcd")


class MembershipError(Exception):
    """The members could not be learnt now (resolver or etcd unreachable); the last ones known stay."""


@dataclass(frozen=True, slots=True, order=True)
class Member:
    name: str  # "host:port": identity for placement and the name TLS verifies
    address: str  # "host:port" to connect to


Members = tuple[Member, ...]


def is_target(servers: str) -> bool:
    """Whether `servers` is a discovery target (dns:, dns+srv:, etcd:) rather than a list of addresses."""
    return "://" in servers


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

    def __init__(self, target: str, refresh_s: float, timeout_s: float) -> None:
        parts = urlsplit(target)
        self.srv = parts.scheme == "dns+srv"
        self.refresh_s, self.timeout_s = refresh_s, timeout_s
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

    def __init__(self, target: str, timeout_s: float) -> None:
        endpoints, self.prefix = parse_url(target)
        self.etcd = Etcd(endpoints, timeout_s)
        self.revision = 0
        self.registered: dict[str, str] = {}

    def resolve(self) -> Members:
        try:
            self.registered, self.revision = self.etcd.range_prefix(self.prefix)
        except EtcdError as exc:
            raise MembershipError(str(exc)) from exc
        return self._members()

    def _members(self) -> Members:
        return tuple(sorted(Member(address, address) for address in self.registered.values() if address))

    def follow(self, stop: threading.Event, changed: Callable[[Members], None]) -> None:
        retry_s = 0.2
        while not stop.is_set():
            try:
                for events in self.etcd.watch(self.prefix, self.revision + 1):
                    for kind, key, value in events:
                        if kind == "PUT":
                            self.registered[key] = value or ""
                        else:
                            self.registered.pop(key, None)
                    changed(self._members())
                    retry_s = 0.2
                if stop.is_set():
                    return
                changed(self.resolve())  # the watch ended (compaction, a restarted etcd): read afresh
            except (EtcdError, MembershipError) as exc:
                if stop.is_set():
                    return
                log.warning("etcd watch of %s: %s; retrying in %.1f s", self.prefix, exc, retry_s)
                stop.wait(retry_s)
                retry_s = min(retry_s * 2, 5.0)
                try:
                    changed(self.resolve())
                except MembershipError:
                    pass

    def cancel(self) -> None:
        self.etcd.cancel()


def source(servers: tuple[str, ...], refresh_s: float, timeout_s: float) -> Static | Dns | EtcdMembers:
    """Where the members come from, for `ClientConfig.servers`; ValueError for a malformed target."""
    if len(servers) != 1 or not is_target(servers[0]):
        return Static(servers)
    target = servers[0]
    scheme = urlsplit(target).scheme
    if scheme in ("dns", "dns+srv"):
        return Dns(target, refresh_s, timeout_s)
    if scheme == "etcd":
        return EtcdMembers(target, timeout_s)
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
