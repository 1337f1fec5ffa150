"""Membership that changes: daemons found in etcd and DNS, followed by a running client without a restart.

Against real peers on loopback: Debian's etcd (daemons register under leases, clients watch) and
dnsmasq (A records re-read on SIGHUP; SRV records of a headless-Service shape).
"""

import base64
import datetime
import ipaddress
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.client.membership import Member, MembershipError
from kvstore.client.placement import place
from kvstore.etcd import Etcd, EtcdAccess, EtcdError, prefix_end
from kvstore.server.process import DaemonProcess
from tests.clean_stop import stop_clean
from tests.peers import DnsServer, EtcdServer, die_with_parent, free_port, stop
from tests.pki import make_pki
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.multihost]  # real etcd and dnsmasq: make test-multihost

NS = Namespace("membership-test", KVLayout(num_layers=2, kv_heads=1, head_dim=16, dtype="float16"), block_tokens=16)


def conversation(n_blocks: int, seed: int):
    tokens = [seed * 1_000_000 + i for i in range(n_blocks * NS.block_tokens)]
    return [(b, os.urandom(NS.block_bytes)) for b in NS.blocks(tokens)]


def config(servers: str, **extra) -> ClientConfig:
    return ClientConfig(servers, timeout_s=2.0, lookup_timeout_s=1.0, down_backoff_s=0.1, max_down_backoff_s=0.3,
                        **extra)


def members(client: KVClient) -> set[str]:
    return set(client._async.shards)


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def dns(tmp_path):
    server = DnsServer(tmp_path)
    yield server
    server.stop()


@pytest.mark.kills_daemons  # first[0] is killed to see its lease end
def test_etcd_daemons_join_and_leave_a_running_client(daemons, etcd):
    target = f"etcd://{etcd.endpoint}/kvstore/members"
    register = ["--register", target, "--register-ttl-s", "2"]
    first = daemons(2, *register)
    with KVClient(config(target)) as client:
        wait_for(lambda: members(client) == {d.address for d in first}, "the client seeing both registered daemons")
        items = conversation(40, seed=1)
        assert client.put(items, NS.num_layers).stored == 40
        blocks = [b for b, _ in items]

        joined = daemons(1, *register)[0]  # a third daemon: the running client starts using it
        wait_for(lambda: joined.address in members(client), "the client seeing the joining daemon")
        assert client._async.stats.membership_changes >= 1
        moved = [b for b in blocks if place(b.key, sorted(members(client))) == joined.address]
        assert 0 < len(moved) < len(blocks)  # only its share of the keys moved
        stayed = [b for b in blocks if b not in moved]
        with KVClient(ClientConfig((joined.address,))) as direct:
            assert direct.present(moved) == [False] * len(moved)  # the new owner starts empty ...
            assert client.lookup(blocks) == len(blocks)  # ... and the moved blocks are found on their old owners
            assert [bytes(d.payload) for d in client.get(blocks)] == [p for _, p in items]
            wait_for(lambda: client.stats.handed_off == len(moved), "the moved blocks copied to their new owner")
            assert direct.present(moved) == [True] * len(moved)
        assert client.lookup(blocks) == len(blocks)

        joined.stop()  # a clean stop revokes its lease: it leaves at once, not a TTL later
        wait_for(lambda: joined.address not in members(client), "the stopped daemon leaving", timeout_s=3.0)
        assert client.present(stayed) == [True] * len(stayed)  # back with their old owners

        first[0].kill()  # a dead daemon leaves when its lease ends (2 s)
        wait_for(lambda: members(client) == {first[1].address}, "the killed daemon's lease ending", timeout_s=10.0)
        survivors = [b for b in stayed if place(b.key, [d.address for d in first]) == first[1].address]
        assert survivors and client.present(survivors) == [True] * len(survivors)


def test_a_daemon_that_leaves_cleanly_hands_its_blocks_over_while_it_drains(daemons, etcd):
    target = f"etcd://{etcd.endpoint}/kvstore/members"
    daemons(2, "--register", target)
    leaving = daemons(1, "--register", target, "--leave-drain-s", "4")[0]
    with KVClient(config(target)) as client:
        wait_for(lambda: len(members(client)) == 3, "the client seeing three daemons")
        items = conversation(40, seed=8)
        client.put(items, NS.num_layers)
        blocks = [b for b, _ in items]
        on_leaving = [b for b in blocks if place(b.key, sorted(members(client))) == leaving.address]
        assert on_leaving
        leaving.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: leaving.address not in members(client), "the leaving daemon leaving")
        assert client.lookup(blocks) == 40  # the blocks it owned, found on it while it drains
        assert [bytes(d.payload) for d in client.get(blocks)] == [p for _, p in items]
        wait_for(lambda: client.stats.handed_off == len(on_leaving), "its blocks copied to their new owners")
        assert leaving.proc.wait(timeout=20) == 0
        assert client.lookup(blocks) == 40  # on their new owners now


def test_without_a_handoff_the_moved_blocks_miss(daemons, etcd):
    target = f"etcd://{etcd.endpoint}/kvstore/members"
    first = daemons(2, "--register", target)
    with KVClient(config(target, handoff_s=1e-6)) as client:
        wait_for(lambda: len(members(client)) == 2, "the client seeing both daemons")
        items = conversation(40, seed=6)
        client.put(items, NS.num_layers)
        joined = daemons(1, "--register", target)[0]
        wait_for(lambda: joined.address in members(client), "the client seeing the joining daemon")
        blocks = [b for b, _ in items]
        moved = [i for i, b in enumerate(blocks) if place(b.key, sorted(members(client))) == joined.address]
        assert client.lookup(blocks) == moved[0]  # the prefix breaks at its first moved block
        assert client.stats.handed_off == 0 and first


def test_a_client_started_before_any_daemon_finds_them(daemons, etcd):
    target = f"etcd://{etcd.endpoint}/kvstore/members"
    with KVClient(config(target)) as client:
        items = conversation(4, seed=2)
        assert members(client) == set() and client.put(items, NS.num_layers).failed == 4  # misses, no exception
        daemon = daemons(1, "--register", target)[0]
        wait_for(lambda: members(client) == {daemon.address}, "the client seeing the first daemon")
        assert client.put(items, NS.num_layers).stored == 4


def test_etcd_down_keeps_the_daemons_known_and_a_restarted_etcd_is_watched_again(daemons, etcd, caplog):
    caplog.set_level(logging.WARNING, logger="kvstore.client.membership")
    target = f"etcd://{etcd.endpoint}/kvstore/members"
    cluster = daemons(2, "--register", target, "--register-ttl-s", "3")
    with KVClient(config(target)) as client:
        wait_for(lambda: len(members(client)) == 2, "the client seeing both daemons")
        etcd.stop()
        # its watch broken, then fresh reads of the members failed: a third failure logged is past the handling
        # of the first two, where the client would have dropped the daemons
        failed = lambda: [r for r in caplog.records if r.getMessage().startswith("etcd watch of")]  # noqa: E731
        wait_for(lambda: len(members(client)) != 2 or len(failed()) >= 3, "the client failing to reach etcd")
        assert len(members(client)) == 2  # no etcd is no news: the daemons stay in use
        items = conversation(6, seed=3)
        assert client.put(items, NS.num_layers).stored == 6
        etcd.start()
        cluster[0].stop()  # its revoke reaches the restarted etcd, and the client's new watch sees it
        wait_for(lambda: members(client) == {cluster[1].address}, "the leaving daemon gone, seen through a new watch")


def test_dns_a_records_followed_as_they_change(dns, tmp_path):
    cluster, port = [], 0
    try:
        for i, ip in enumerate(("127.0.0.2", "127.0.0.3", "127.0.0.4")):  # one port on three loopback addresses
            daemon = DaemonProcess(tmp_path / f"dns-daemon{i}", tmp_path, ["--host", ip])
            daemon.port = port
            cluster.append(daemon.start())
            port = daemon.port
        dns.set_hosts({"kvstore.test": ["127.0.0.2", "127.0.0.3"]})
        dns.start()
        with KVClient(config(f"dns://{dns.resolver}/kvstore.test:{port}", membership_refresh_s=0.2)) as client:
            assert members(client) == {f"127.0.0.2:{port}", f"127.0.0.3:{port}"}
            items = conversation(20, seed=4)
            assert client.put(items, NS.num_layers).stored == 20
            dns.set_hosts({"kvstore.test": ["127.0.0.2", "127.0.0.3", "127.0.0.4"]})
            wait_for(lambda: len(members(client)) == 3, "the client seeing the third A record")
            blocks = [b for b, _ in items]
            moved = [b for b in blocks if place(b.key, sorted(members(client))) == f"127.0.0.4:{port}"]
            assert 0 < len(moved) < 20 and client.lookup(blocks) == 20  # moved ones found on their old owners
            dns.set_hosts({"kvstore.test": []})  # no records: no daemons, every block a miss
            wait_for(lambda: members(client) == set(), "the records going away")
            assert client.lookup(blocks) == 0
    finally:
        problems = [problem for daemon in cluster for problem in stop_clean(daemon)]
    assert not problems, "\n".join(problems)


def test_dns_srv_members_keep_their_names_and_connect_to_what_they_resolve_to(daemons, dns):
    cluster = daemons(2)
    srv = [("_grpc._tcp.kvstore.ns.test", f"kvstore-{i}.kvstore.ns.test", d.port) for i, d in enumerate(cluster)]
    records = {f"kvstore-{i}.kvstore.ns.test": "127.0.0.1" for i in range(2)}
    dns.start(srv, records)
    with KVClient(config(f"dns+srv://{dns.resolver}/_grpc._tcp.kvstore.ns.test", membership_refresh_s=0.2)) as client:
        names = {f"kvstore-{i}.kvstore.ns.test:{d.port}" for i, d in enumerate(cluster)}
        assert members(client) == names
        assert {s.address for s in client._async.shards.values()} == {d.address for d in cluster}
        items = conversation(20, seed=5)
        assert client.put(items, NS.num_layers).stored == 20
        data = client.get([b for b, _ in items])
        assert [d.payload for d in data] == [p for _, p in items]
        dns.restart(srv[:1], records)  # one pod gone from the Service
        wait_for(lambda: len(members(client)) == 1, "the SRV record going away")


@pytest.mark.parametrize("names, verified", [(("*.kvstore.ns.test",), True), ((), False)])
def test_tls_verifies_an_srv_member_by_its_name_not_the_address_it_resolved_to(daemons, dns, tmp_path, names, verified):
    pki = make_pki(tmp_path / "pki", server_names=names)
    cluster = daemons(2, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    srv = [("_grpc._tcp.kvstore.ns.test", f"kvstore-{i}.kvstore.ns.test", d.port) for i, d in enumerate(cluster)]
    dns.start(srv, {f"kvstore-{i}.kvstore.ns.test": "127.0.0.1" for i in range(2)})
    target = f"dns+srv://{dns.resolver}/_grpc._tcp.kvstore.ns.test"
    with KVClient(config(target, tls_ca=str(pki.ca))) as client:
        items = conversation(8, seed=9)
        summary = client.put(items, NS.num_layers)
        assert (summary.stored, summary.failed) == ((8, 0) if verified else (0, 8))


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_etcd_with_users_serves_members_only_to_a_client_that_logs_in(daemons, etcd):
    prefix = "/kvstore/members/"
    admin = Etcd([etcd.endpoint])
    for path, body in [("/v3/auth/role/add", {"name": "root"}),
                       ("/v3/auth/user/add", {"name": "root", "password": "root-pw"}),
                       ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                       ("/v3/auth/role/add", {"name": "reader"}),
                       ("/v3/auth/role/grant", {"name": "reader", "perm": {
                           "permType": "READ", "key": b64(prefix), "range_end": b64(prefix_end(prefix))}}),
                       ("/v3/auth/user/add", {"name": "engine", "password": "engine-pw"}),
                       ("/v3/auth/user/grant", {"user": "engine", "role": "reader"}),
                       ("/v3/auth/enable", {})]:
        admin.call(path, body)
    root = Etcd([etcd.endpoint], access=EtcdAccess(user="root", password="root-pw"))
    first, second = daemons(2)
    root.put(prefix + first.address, first.address)  # as `kvstore-server --register` would, as a writer
    target = f"etcd://{etcd.endpoint}/kvstore/members"
    with pytest.raises(MembershipError):  # no user: etcd refuses the range
        config(target).members().resolve()
    with pytest.raises(MembershipError):
        config(target, etcd_user="engine", etcd_password="wrong").members().resolve()
    with pytest.raises(EtcdError):  # the reader's role reads, never writes
        Etcd([etcd.endpoint], access=EtcdAccess(user="engine", password="engine-pw")).put(prefix + "x:1", "x:1")
    with KVClient(config(target, etcd_user="engine", etcd_password="engine-pw")) as client:
        assert members(client) == {first.address}
        root.put(prefix + second.address, second.address)  # seen through the watch, which carries the token
        wait_for(lambda: members(client) == {first.address, second.address}, "the client seeing the second daemon")


def etcd_certificates(folder: Path) -> dict[str, Path]:
    """A CA; etcd's certificate for 127.0.0.1, good for client authentication too (etcd 3.4's JSON gateway
    connects to etcd's own gRPC port with it); a client certificate; one of another CA."""
    folder.mkdir(parents=True, exist_ok=True)
    now, day = datetime.datetime.now(datetime.UTC), datetime.timedelta(days=1)
    paths = {}

    def issue(name: str, issuer_key, issuer_name, usages, ca: bool = False, san: bool = False):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - day).not_valid_after(now + day)
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        paths[name] = folder / f"{name}.pem"
        paths[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[name + "_key"] = folder / f"{name}.key"
        paths[name + "_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
        return key, subject

    ca_key, ca_name = issue("ca", None, None, [], ca=True)
    other_key, other_name = issue("other_ca", None, None, [], ca=True)
    issue("etcd", ca_key, ca_name, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], san=True)
    issue("client", ca_key, ca_name, [ExtendedKeyUsageOID.CLIENT_AUTH])
    issue("rogue", other_key, other_name, [ExtendedKeyUsageOID.CLIENT_AUTH])
    return paths


class TlsEtcd:
    """A single-member etcd on loopback that speaks only TLS and requires client certificates of its CA."""

    def __init__(self, folder: Path, certs: dict[str, Path]) -> None:
        self.endpoint = f"127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        self.log = folder / "etcd-tls.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["etcd", "--name", "tls", "--data-dir", str(folder / "etcd-tls"),
                 "--listen-client-urls", f"https://{self.endpoint}", "--advertise-client-urls",
                 f"https://{self.endpoint}", "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"tls={peer}", "--cert-file", str(certs["etcd"]), "--key-file",
                 str(certs["etcd_key"]), "--trusted-ca-file", str(certs["ca"]), "--client-cert-auth"],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self.access = EtcdAccess(ca=str(certs["ca"]), cert=str(certs["client"]), key=str(certs["client_key"]))
        deadline = time.monotonic() + 30  # a hang guard: etcd starts in about a second
        while True:
            try:
                Etcd([self.endpoint], access=self.access).range_prefix("/")
                return
            except EtcdError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    stop(self.proc)
                    raise RuntimeError(f"etcd over TLS did not start:\n{self.log.read_text()}") from None
                time.sleep(0.1)


def test_etcd_over_tls_with_client_certificates(daemons, tmp_path):
    certs = etcd_certificates(tmp_path / "etcd-pki")
    etcd = TlsEtcd(tmp_path, certs)
    try:
        daemon, = daemons(1)
        Etcd([etcd.endpoint], access=etcd.access).put(f"/kvstore/members/{daemon.address}", daemon.address)
        target = f"etcd://{etcd.endpoint}/kvstore/members"
        tls = dict(etcd_tls_ca=str(certs["ca"]), etcd_tls_cert=str(certs["client"]),
                   etcd_tls_key=str(certs["client_key"]))
        assert config(target, **tls).members().resolve() == (Member(daemon.address, daemon.address),)
        rogue = dict(tls, etcd_tls_cert=str(certs["rogue"]), etcd_tls_key=str(certs["rogue_key"]))
        for refused in (config(target), config(target, etcd_tls_ca=str(certs["ca"])), config(target, **rogue)):
            with pytest.raises(MembershipError):
                refused.members().resolve()
        # a daemon registers itself over the same TLS, with the same kind of settings
        flags = [f"--{name.replace('_', '-')}={path}" for name, path in tls.items()]
        joining, = daemons(1, "--register", target, *flags)
        wait_for(lambda: {m.address for m in config(target, **tls).members().resolve()} == {daemon.address,
                                                                                          joining.address},
                 "the daemon registered over TLS")
    finally:
        stop(etcd.proc)
