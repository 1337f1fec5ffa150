"""Membership told lies: an etcd endpoint that answers garbage, drips, floods or lists daemons that are not
ours, and a client that must neither fail, hang, fill its memory nor send blocks where it is told.

The etcd endpoint is the attacker, so it is a small real HTTP server written here, on loopback; the
daemons are real kvstore-server processes. A well-behaved etcd (Debian's) is in
tests/kvstore/client/test_membership.py (make test-multihost).
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvstore.client import ClientConfig, KVClient
from kvstore.client.membership import Member, MembershipError
from kvstore.etcd import MAX_ANSWER_BYTES, Etcd, EtcdError
from kvstore.server.auth import new_token, token_entry
from tests.pki import make_pki
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

PREFIX = "/kvstore/members/"


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def registry(*addresses: str, revision: object = "7") -> dict:
    """A range answer as etcd gives it: each daemon under PREFIX<address>."""
    return {"header": {"revision": revision}, "kvs": [{"key": b64(PREFIX + a), "value": b64(a)} for a in addresses]}


class HostileEtcd:
    """An etcd endpoint on loopback that answers every request with `respond(handler, path)`; with `tls`,
    over TLS with that context. `stopped` is set when the test ends, which ends answers that never end."""

    def __init__(self, respond: Callable[[BaseHTTPRequestHandler, str], None],
                 tls: ssl.SSLContext | None = None) -> None:
        self.respond = respond
        self.stopped = threading.Event()
        self.requests: list[str] = []
        hostile = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hostile.requests.append(self.path)
                try:
                    hostile.respond(self, self.path)
                except OSError:
                    pass  # the client hung up, as it should on an answer it does not take
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    @property
    def target(self) -> str:
        return f"etcd://{self.endpoint}{PREFIX.rstrip('/')}"

    def stop(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile() -> Iterator[Callable[..., HostileEtcd]]:
    started: list[HostileEtcd] = []

    def start(respond: Callable[[BaseHTTPRequestHandler, str], None], **kwargs: object) -> HostileEtcd:
        started.append(HostileEtcd(respond, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def send(handler: BaseHTTPRequestHandler, body: bytes | dict | list, status: int = 200) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    handler.wfile.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
                        f"\r\n".encode() + raw)


def hold_watch(handler: BaseHTTPRequestHandler, etcd: HostileEtcd) -> None:
    """A watch that starts and then says nothing, as etcd's does while nothing changes."""
    handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    handler.wfile.flush()
    etcd.stopped.wait()


def config(etcd: HostileEtcd, **extra: object) -> ClientConfig:
    return ClientConfig(etcd.target, lookup_timeout_s=0.5, down_backoff_s=0.1, max_down_backoff_s=0.3, **extra)


MALFORMED = {
    "a JSON list": b"[1, 2, 3]",
    "no header": {"kvs": []},
    "a kv without a key": {"header": {"revision": "3"}, "kvs": [{"value": b64("127.0.0.1:1")}]},
    "a value not UTF-8": {"header": {"revision": "3"}, "kvs": [{"key": b64(PREFIX + "x"), "value": b64(b"\xff\xfe")}]},
    "revision abc": registry(revision="abc"),
    "a key not base64": {"header": {"revision": "3"}, "kvs": [{"key": "*not base64*", "value": b64("a:1")}]},
    "kvs not a list": {"header": {"revision": "3"}, "kvs": 12},
    "a header that is a string": {"header": "3", "kvs": []},
    "not JSON": b"<html>etcd is down for maintenance</html>",
}


@pytest.mark.parametrize("answer", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_etcd_answer_is_a_membership_error_and_the_client_starts(hostile, answer):
    etcd = hostile(lambda handler, path: send(handler, answer))
    with pytest.raises(MembershipError):
        config(etcd).members().resolve()
    with KVClient(config(etcd)) as client:  # no daemons known yet: every block a miss, no exception
        assert client._async.shards == {}


def test_the_follower_outlives_malformed_answers_and_sees_a_later_valid_change(hostile, daemons):
    daemon, = daemons(1)
    honest = threading.Event()
    bad_ranges = threading.Semaphore(0)

    def respond(handler: BaseHTTPRequestHandler, path: str) -> None:
        if honest.is_set():
            if path == "/v3/watch":
                hold_watch(handler, etcd)
            else:
                send(handler, registry(daemon.address))
        elif path == "/v3/watch":
            send(handler, b'{"result": {"events": [{"kv": {"value": 17}}]}}\n')  # an event without a key
        else:
            send(handler, {"kvs": []})  # no header
            bad_ranges.release()

    etcd = hostile(respond)
    with KVClient(config(etcd)) as client:
        assert bad_ranges.acquire(timeout=30)  # the client's own read at start ...
        assert bad_ranges.acquire(timeout=30)  # ... and the follower's, after its broken watch
        honest.set()
        wait_for(lambda: set(client._async.shards) == {daemon.address}, "the follower seeing the daemon")
        assert client._async.stats.membership_changes == 1


def drip_headers(handler: BaseHTTPRequestHandler, etcd: HostileEtcd) -> None:
    handler.wfile.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
    while not etcd.stopped.wait(0.05):  # one byte of one endless header line at a time, until the test ends
        handler.wfile.write(b"a")
        handler.wfile.flush()


def drip_body(handler: BaseHTTPRequestHandler, etcd: HostileEtcd) -> None:
    handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{")
    while not etcd.stopped.wait(0.05):
        handler.wfile.write(b" ")
        handler.wfile.flush()


@pytest.mark.parametrize("drip", [drip_headers, drip_body])
def test_an_endpoint_that_drips_is_cut_off_by_the_deadline(hostile, drip):
    etcd = hostile(lambda handler, path: drip(handler, etcd))
    with pytest.raises(MembershipError):  # returns at all only because the call's deadline (0.5 s) ends it
        config(etcd).members().resolve()


def test_an_answer_larger_than_the_bound_is_not_read(hostile):
    huge = "h" * (MAX_ANSWER_BYTES * 3 // 4 + 1) + ":1"  # a base64 value longer than MAX_ANSWER_BYTES
    etcd = hostile(lambda handler, path: send(handler, {"header": {"revision": "3"},
                                                        "kvs": [{"key": b64(PREFIX + "h"), "value": b64(huge)}]}))
    with pytest.raises(MembershipError, match="larger than"):
        config(etcd).members().resolve()


def test_a_watch_message_larger_than_the_bound_is_not_read(hostile):
    event = {"result": {"events": [{"type": "PUT", "kv": {"key": b64(PREFIX + "h"),
                                                          "value": b64("h" * MAX_ANSWER_BYTES + ":1")}}]}}

    def respond(handler: BaseHTTPRequestHandler, path: str) -> None:
        line = json.dumps(event).encode() + b"\n"
        handler.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                            + f"{len(line):x}\r\n".encode() + line + b"\r\n")
        handler.wfile.flush()
        etcd.stopped.wait()

    etcd = hostile(respond)
    with pytest.raises(EtcdError, match="larger than"):
        next(Etcd([etcd.endpoint], timeout_s=0.5).watch(PREFIX, 1))


def test_more_members_than_max_members_are_not_used(hostile):
    etcd = hostile(lambda handler, path: send(handler, registry(*(f"127.0.0.1:{1000 + i}" for i in range(9)))))
    with pytest.raises(MembershipError, match="more than max_members"):
        config(etcd, max_members=8).members().resolve()
    flood = hostile(lambda handler, path: send(handler, registry(*(f"10.{i >> 16}.{i >> 8 & 255}.{i & 255}:50051"
                                                                   for i in range(100_000)))))
    with pytest.raises(MembershipError):  # 100,000 daemons: over the answer's bound, and over max_members
        config(flood).members().resolve()


@pytest.mark.parametrize("value, message", [(0, "max_members"), (-3, "max_members"), (2.5, "max_members"),
                                            (True, "max_members")])
def test_max_members_must_be_a_positive_whole_number(value, message):
    with pytest.raises(ValueError, match=message):
        ClientConfig("etcd://127.0.0.1:2379/kvstore/members", max_members=value)


def test_an_address_that_is_not_a_kvstore_daemon_never_joins(hostile):
    addresses = []
    etcd = hostile(lambda handler, path: send(handler, registry(*addresses)))
    addresses += [etcd.endpoint,  # another service on a loopback port: this HTTP server itself
                  "unix:///run/docker.sock:1", "dns:///evil.example:1", "127.0.0.1:0"]
    assert config(etcd).members().resolve() == ()


def test_only_daemons_of_this_cluster_join_and_one_left_out_is_checked_again(hostile, daemons, tmp_path, caplog):
    pki = make_pki(tmp_path / "pki")
    ours, theirs = new_token(), new_token()
    for name, token in (("ours", ours), ("theirs", theirs)):
        (tmp_path / f"{name}.toml").write_text(token_entry(name, token, None, ["read", "write"]))
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    member, = daemons(1, "--auth-tokens", str(tmp_path / "ours.toml"), *tls)
    other, = daemons(1, "--auth-tokens", str(tmp_path / "theirs.toml"), *tls)  # another cluster's daemon
    plain, = daemons(1, "--auth-tokens", str(tmp_path / "ours.toml"))  # speaks no TLS: not who the CA names
    addresses = [member.address, other.address, plain.address]
    etcd = hostile(lambda handler, path: send(handler, registry(*addresses)))
    addresses.append(etcd.endpoint)
    members = config(etcd, token=ours, tls_ca=str(pki.ca)).members()

    with caplog.at_level(logging.WARNING, logger="kvstore.client.membership"):
        assert members.resolve() == (Member(member.address, member.address),)
        assert members.resolve() == (Member(member.address, member.address),)
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvstore.client.membership"]
    assert len(warnings) == 1  # logged once, not at every read
    assert all(address in warnings[0] for address in (other.address, plain.address, etcd.endpoint))
    assert "UNAUTHENTICATED" in warnings[0]

    other.stop()  # the same address, now a daemon of this cluster: it passes when the members are read again
    other.args[other.args.index(str(tmp_path / "theirs.toml"))] = str(tmp_path / "ours.toml")
    other.start()
    assert set(members.resolve()) == {Member(d.address, d.address) for d in (member, other)}


def test_etcd_over_tls_is_used_only_with_a_certificate_of_its_ca(hostile, daemons, tmp_path):
    daemon, = daemons(1)
    pki, impostor = make_pki(tmp_path / "pki"), make_pki(tmp_path / "impostor")

    def server(certs, client_ca=None) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certs.server_cert, certs.server_key)
        if client_ca is not None:
            context.load_verify_locations(client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def respond(handler: BaseHTTPRequestHandler, path: str) -> None:
        send(handler, registry(daemon.address))

    genuine = hostile(respond, tls=server(pki, client_ca=pki.ca))  # requires a client certificate
    client_tls = dict(etcd_tls_ca=str(pki.ca), etcd_tls_cert=str(pki.client_cert), etcd_tls_key=str(pki.client_key))
    assert config(genuine, **client_tls).members().resolve() == (Member(daemon.address, daemon.address),)
    with pytest.raises(MembershipError):  # no client certificate: etcd refuses the handshake
        config(genuine, etcd_tls_ca=str(pki.ca)).members().resolve()
    with pytest.raises(MembershipError):  # plain HTTP to a TLS endpoint
        config(genuine).members().resolve()
    posing = hostile(respond, tls=server(impostor))  # a certificate of another CA: someone posing as etcd
    with pytest.raises(MembershipError):
        config(posing, **client_tls).members().resolve()


@pytest.mark.parametrize("settings, message", [
    (dict(etcd_user="reader"), "etcd_user and etcd_password go together"),
    (dict(etcd_password="pw"), "etcd_user and etcd_password go together"),
    (dict(etcd_tls_cert="x.pem"), "etcd_tls_cert and etcd_tls_key go together"),
    (dict(etcd_tls_ca="/nonexistent/ca.pem"), "etcd_tls_ca: /nonexistent/ca.pem is not a readable file"),
])
def test_bad_etcd_settings_are_refused_with_what_is_wrong(settings, message):
    with pytest.raises(ValueError, match=message):
        ClientConfig("etcd://127.0.0.1:2379/kvstore/members", **settings)


def test_etcd_settings_without_an_etcd_target_are_refused_and_the_password_is_never_shown():
    with pytest.raises(ValueError, match="for an etcd://HOST:PORT/PREFIX servers target only"):
        ClientConfig("127.0.0.1:50051", etcd_user="reader", etcd_password="pw")
    shown = repr(ClientConfig("etcd://127.0.0.1:2379/kvstore/members", etcd_user="reader", etcd_password="s3cret"))
    assert "s3cret" not in shown and "etcd_password=***" in shown
