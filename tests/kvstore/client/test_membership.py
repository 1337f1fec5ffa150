"""Membership that changes: daemons found in etcd and DNS, followed by a running client without a restart.

Against real peers on loopback: Debian's etcd (daemons register under leases, clients watch) and
dnsmasq (A records re-read on SIGHUP; SRV records of a headless-Service shape).
"""

import os
import signal
import time

import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.client.placement import place
from kvstore.server.config import ServerConfig
from kvstore.server.process import DaemonProcess
from tests.peers import DnsServer, EtcdServer
from tests.pki import make_pki

pytestmark = [pytest.mark.integration, pytest.mark.multihost]  # real etcd and dnsmasq: make test-multihost

NS = Namespace("membership-test", KVLayout(num_layers=2, kv_heads=1, head_dim=16, dtype="float16"), block_tokens=16)


def conversation(n_blocks: int, seed: int):
    tokens = [seed * 1_000_000 + i for i in range(n_blocks * NS.block_tokens)]
    return [(b, os.urandom(NS.block_bytes)) for b in NS.blocks(tokens)]


def config(servers: str, **extra) -> ClientConfig:
    return ClientConfig(servers, timeout_s=2.0, lookup_timeout_s=1.0, down_backoff_s=0.1, max_down_backoff_s=0.3,
                        **extra)


def until(condition, timeout_s: float = 15.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        time.sleep(0.05)
    return value


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


def test_etcd_daemons_join_and_leave_a_running_client(daemons, etcd):
    target = f"etcd://{etcd.endpoint}/kvstore/members"
    register = ["--register", target, "--register-ttl-s", "2"]
    first = daemons(2, *register)
    with KVClient(config(target)) as client:
        until(lambda: members(client) == {d.address for d in first}, what="both registered daemons")
        items = conversation(40, seed=1)
        assert client.put(items, NS.num_layers).stored == 40
        blocks = [b for b, _ in items]

        joined = daemons(1, *register)[0]  # a third daemon: the running client starts using it
        until(lambda: joined.address in members(client), what="the joining daemon")
        assert client._async.stats.membership_changes >= 1
        moved = [b for b in blocks if place(b.key, sorted(members(client))) == joined.address]
        assert 0 < len(moved) < len(blocks)  # only its share of the keys moved
        stayed = [b for b in blocks if b not in moved]
        with KVClient(ClientConfig((joined.address,))) as direct:
            assert direct.present(moved) == [False] * len(moved)  # the new owner starts empty ...
            assert client.lookup(blocks) == len(blocks)  # ... and the moved blocks are found on their old owners
            assert [bytes(d.payload) for d in client.get(blocks)] == [p for _, p in items]
            until(lambda: client.stats.handed_off == len(moved), what="the moved blocks copied to their new owner")
            assert direct.present(moved) == [True] * len(moved)
        assert client.lookup(blocks) == len(blocks)

        joined.stop()  # a clean stop revokes its lease: it leaves at once, not a TTL later
        until(lambda: joined.address not in members(client), timeout_s=3.0, what="the stopped daemon leaving")
        assert client.present(stayed) == [True] * len(stayed)  # back with their old owners

        first[0].kill()  # a dead daemon leaves when its lease ends (2 s)
        until(lambda: members(client) == {first[1].address}, timeout_s=10.0, what="the killed daemon's lease ending")
        survivors = [b for b in stayed if place(b.key, [d.address for d in first]) == first[1].address]
        assert survivors and client.present(survivors) == [True] * len(survivors)


def test_a_daemon_that_leaves_cleanly_hands_its_blocks_over_while_it_drains(daemons, etcd):
    target = f"etcd://{etcd.endpoint}/kvstore/members"
    daemons(2, "--register", target)
    leaving = daemons(1, "--register", target, "--leave-drain-s", "4")[0]
    with KVClient(config(target)) as client:
        until(lambda: len(members(client)) == 3, what="three daemons")
        items = conversation(40, seed=8)
        client.put(items, NS.num_layers)
        blocks = [b for b, _ in items]
        on_leaving = [b for b in blocks if place(b.key, sorted(members(client))) == leaving.address]
        assert on_leaving
        leaving.proc.send_signal(signal.SIGTERM)
        until(lambda: leaving.address not in members(client), what="the leaving daemon leaving")
        assert client.lookup(blocks) == 40  # the blocks it owned, found on it while it drains
        assert [bytes(d.payload) for d in client.get(blocks)] == [p for _, p in items]
        until(lambda: client.stats.handed_off == len(on_leaving), what="its blocks copied to their new owners")
        assert leaving.proc.wait(timeout=20) == 0
        assert client.lookup(blocks) == 40  # on their new owners now


def test_without_a_handoff_the_moved_blocks_miss(daemons, etcd):
    target = f"etcd://{etcd.endpoint}/kvstore/members"
    first = daemons(2, "--register", target)
    with KVClient(config(target, handoff_s=1e-6)) as client:
        until(lambda: len(members(client)) == 2, what="both daemons")
        items = conversation(40, seed=6)
        client.put(items, NS.num_layers)
        joined = daemons(1, "--register", target)[0]
        until(lambda: joined.address in members(client), what="the joining daemon")
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
        until(lambda: members(client) == {daemon.address}, what="the first daemon")
        assert client.put(items, NS.num_layers).stored == 4


def test_etcd_down_keeps_the_daemons_known_and_a_restarted_etcd_is_watched_again(daemons, etcd):
    target = f"etcd://{etcd.endpoint}/kvstore/members"
    cluster = daemons(2, "--register", target, "--register-ttl-s", "3")
    with KVClient(config(target)) as client:
        until(lambda: len(members(client)) == 2, what="both daemons")
        etcd.stop()
        time.sleep(1.0)
        assert len(members(client)) == 2  # no etcd is no news: the daemons stay in use
        items = conversation(6, seed=3)
        assert client.put(items, NS.num_layers).stored == 6
        etcd.start()
        cluster[0].stop()  # its revoke reaches the restarted etcd, and the client's new watch sees it
        until(lambda: members(client) == {cluster[1].address}, what="the leaving daemon, through a new watch")


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
            until(lambda: len(members(client)) == 3, what="the third A record")
            blocks = [b for b, _ in items]
            moved = [b for b in blocks if place(b.key, sorted(members(client))) == f"127.0.0.4:{port}"]
            assert 0 < len(moved) < 20 and client.lookup(blocks) == 20  # moved ones found on their old owners
            dns.set_hosts({"kvstore.test": []})  # no records: no daemons, every block a miss
            until(lambda: members(client) == set(), what="the records going away")
            assert client.lookup(blocks) == 0
    finally:
        for daemon in cluster:
            daemon.stop()


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
        until(lambda: len(members(client)) == 1, what="the SRV record going away")


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


@pytest.mark.parametrize("servers, message", [
    ("dns:///kvstore.test", "ends in :PORT"),
    ("dns:///:50051", "names no DNS name"),
    ("etcd://127.0.0.1:2379", "needs an endpoint and a key prefix"),
    ("etcd://nohost/kvstore", "is not host:port"),
    ("zookeeper://z:2181/kv", "servers is host:port,... or a target"),
])
def test_malformed_targets_are_refused_with_what_to_write(servers, message):
    with pytest.raises(ValueError, match=message):
        ClientConfig(servers)


def test_an_etcd_target_with_several_endpoints_survives_comma_splitting():
    split = tuple("etcd://10.0.0.1:2379,10.0.0.2:2379/kvstore/members".split(","))  # as the CLIs split --servers
    assert ClientConfig(split).servers == ("etcd://10.0.0.1:2379,10.0.0.2:2379/kvstore/members",)


def test_a_registering_daemon_must_name_an_address_clients_can_reach(tmp_path):
    with pytest.raises(ValueError, match="register needs advertise"):
        ServerConfig(data_dir=tmp_path, host="0.0.0.0", register="etcd://127.0.0.1:2379/kv")
    assert ServerConfig(data_dir=tmp_path, host="0.0.0.0", register="etcd://127.0.0.1:2379/kv",
                        advertise="10.0.0.5:50051").advertised == "10.0.0.5:50051"
    with pytest.raises(ValueError, match="register_ttl_s"):
        ServerConfig(data_dir=tmp_path, register="etcd://127.0.0.1:2379/kv", register_ttl_s=0.5)
