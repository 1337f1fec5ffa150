"""Who may do what, on real daemons: tokens scoped to tenants and verbs, TLS and mutual TLS, logs."""

import os
import socket
import ssl
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import wire
from kvstore.block import Block, KVLayout, Namespace, tenant_of
from kvstore.client import ClientConfig, KVClient
from kvstore.client.dataplane import TransportError, read_frame
from kvstore.proto import method, pb
from kvstore.record import build_record
from kvstore.server.auth import new_token, token_entry
from kvstore.stats import Stats
from tests.pki import make_pki

pytestmark = pytest.mark.integration

LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=32, dtype="float16")
ALICE = Namespace("security-test", LAYOUT, block_tokens=16, salt="alice's salt")
BOB = Namespace("security-test", LAYOUT, block_tokens=16, salt="bob's salt")
TOKENS = {name: new_token() for name in ("alice", "bob", "reader", "ops")}


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(
        token_entry("alice", TOKENS["alice"], [ALICE.tenant], ["read", "write", "delete"])
        + token_entry("bob", TOKENS["bob"], [BOB.tenant], ["read", "write", "delete"])
        + token_entry("reader", TOKENS["reader"], [ALICE.tenant], ["read"])
        + token_entry("ops", TOKENS["ops"], None, ["read", "admin"]))
    return path


def items(namespace, n=3, seed=0):
    return [(b, os.urandom(namespace.block_bytes)) for b in namespace.blocks(range(seed, seed + 16 * n))]


def client(daemon, token=None, **tls):
    return KVClient(ClientConfig((daemon.address,), token=token, transport="grpc", lookup_timeout_s=5, **tls))


def call(daemon, name, request, token=None, response=pb.CountResponse):
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(daemon.address) as channel:
        return channel.unary_unary(method(name), None, response.FromString)(
            request.SerializeToString(), metadata=metadata, timeout=5)


def code_of(fn):
    with pytest.raises(grpc.RpcError) as caught:
        fn()
    return caught.value.code()


def test_every_call_needs_a_known_token_and_the_verb_it_uses(daemons, token_file):
    daemon, = daemons(1, "--auth-tokens", str(token_file))
    keys = [b.key for b, _ in items(ALICE)]
    lookup = pb.LookupRequest(keys=keys)
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: call(daemon, "Lookup", lookup, response=pb.LookupResponse)) == unauthenticated
    assert code_of(lambda: call(daemon, "Lookup", lookup, "kvs_guess", pb.LookupResponse)) == unauthenticated
    assert call(daemon, "Lookup", lookup, TOKENS["reader"], pb.LookupResponse).hits == 0
    assert code_of(lambda: call(daemon, "Delete", pb.KeysRequest(keys=keys), TOKENS["reader"])) \
        == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: call(daemon, "Stats", pb.StatsRequest(), TOKENS["alice"], pb.StatsResponse)) \
        == grpc.StatusCode.PERMISSION_DENIED
    assert call(daemon, "Stats", pb.StatsRequest(), TOKENS["ops"], pb.StatsResponse).samples
    with client(daemon, TOKENS["reader"]) as reader:  # a read-only token's puts are refused
        assert reader.put(items(ALICE), LAYOUT.num_layers).stored == 0
    with grpc.insecure_channel(daemon.address) as channel:  # probes need no token; streams that stay open do
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)
        assert code_of(lambda: next(watch)) == grpc.StatusCode.UNAUTHENTICATED


def test_a_tenant_can_neither_reach_nor_learn_of_another_tenants_blocks(daemons, token_file):
    daemon, = daemons(1, "--auth-tokens", str(token_file))
    alices = items(ALICE)
    with client(daemon, TOKENS["alice"]) as alice, client(daemon, TOKENS["bob"]) as bob:
        assert alice.put(alices, LAYOUT.num_layers).stored == 3
        blocks = [b for b, _ in alices]
        # Bob knows Alice's keys, token ids and parents (say, from a leaked log): he still sees nothing.
        assert bob.lookup(blocks) == 0 and bob.get(blocks) == []
        assert bob.delete(blocks) == 0 and bob.touch(blocks) == 0
        # He cannot write as Alice's tenant ...
        forged = [(b, os.urandom(ALICE.block_bytes)) for b in blocks]
        assert bob.put(forged, LAYOUT.num_layers).stored == 0
        # ... nor name his own tenant in a record under her key: the tenant is part of every key.
        as_bob = [(Block(b.namespace, b.key, b.parent, b.tokens, BOB.tenant), os.urandom(ALICE.block_bytes))
                  for b in blocks]
        with pytest.raises(grpc.RpcError) as refused:
            _raw_put(daemon, TOKENS["bob"], as_bob)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "key" in refused.value.details()
        got = alice.get(blocks)
        assert [g.payload for g in got] == [p for _, p in alices]
    # a fresh client: a refused streaming put can end in a race that leaves the first one backing off the
    # daemon for a moment (seen once under load), and a backed-off lookup would be a miss whatever the daemon says
    with client(daemon, TOKENS["alice"]) as alice, client(daemon, TOKENS["bob"]) as bob:
        assert bob.lookup(blocks) == 0
        # Bob's own blocks are his.
        bobs = items(BOB, seed=1000)
        assert bob.put(bobs, LAYOUT.num_layers).stored == 3
        assert bob.lookup([b for b, _ in bobs]) == 3 and alice.lookup([b for b, _ in bobs]) == 0
    with client(daemon, TOKENS["ops"]) as ops:  # a token for every tenant sees both
        assert ops.lookup(blocks) == 3 and ops.lookup([b for b, _ in bobs]) == 3


def _raw_put(daemon, token, records):
    messages = []
    for block, payload in records:
        header, body = build_record(block, payload, LAYOUT.num_layers, "chat")
        messages += [pb.PutHead(record_bytes=len(header) + len(body)).SerializeToString(), header, body]
    with grpc.insecure_channel(daemon.address) as channel:
        put = channel.stream_unary(method("Put"), None, pb.PutResponse.FromString)
        return list(put(iter(messages), metadata=(("authorization", f"Bearer {token}"),), timeout=5).results)


def test_tls_and_mutual_tls_on_grpc(daemons, tmp_path, token_file):
    pki = make_pki(tmp_path / "pki")
    daemon, = daemons(1, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                      "--tls-client-ca", str(pki.ca), "--auth-tokens", str(token_file))
    blocks = items(ALICE)
    good = dict(tls_ca=str(pki.ca), tls_cert=str(pki.client_cert), tls_key=str(pki.client_key))
    with client(daemon, TOKENS["alice"], **good) as alice:
        assert alice.put(blocks, LAYOUT.num_layers).stored == 3
        assert [g.payload for g in alice.get([b for b, _ in blocks])] == [p for _, p in blocks]
    refused = [
        {},  # plaintext to a TLS port
        dict(tls_ca=str(pki.ca)),  # TLS without a client certificate
        dict(tls_ca=str(pki.ca), tls_cert=str(pki.rogue_cert), tls_key=str(pki.rogue_key)),  # another CA's
    ]
    for tls in refused:
        with client(daemon, TOKENS["alice"], **tls) as other:
            assert other.lookup([b for b, _ in blocks]) == 0
            assert other.last_errors(), f"{tls} should have been refused"


def test_tls_without_client_certificates(daemons, tmp_path):
    pki = make_pki(tmp_path / "pki")
    daemon, = daemons(1, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    blocks = items(ALICE)
    with client(daemon, tls_ca=str(pki.ca)) as tls:
        assert tls.put(blocks, LAYOUT.num_layers).stored == 3
        assert tls.lookup([b for b, _ in blocks]) == 3


def test_a_daemon_beyond_loopback_without_tokens_warns_loudly(daemons):
    daemon, = daemons(1, "--host", "0.0.0.0")
    assert "WITHOUT AUTHENTICATION" in daemon.log()


def test_bad_security_settings_stop_the_daemon_with_a_message(daemons, tmp_path):
    bad = tmp_path / "tokens.toml"
    bad.write_text("[[tokens]]\nname = 'x'\n")
    with pytest.raises(RuntimeError, match="sha256") as caught:
        daemons(1, "--auth-tokens", str(bad))
    assert "Traceback" not in str(caught.value)
    with pytest.raises(RuntimeError, match="tls_cert and tls_key go together"):
        daemons(1, "--tls-cert", str(bad))


def test_logs_carry_no_key_a_reader_could_use(daemons, tmp_path):
    log_path = tmp_path / "access.log"
    daemon, = daemons(1, "--access-log", str(log_path))
    blocks = items(ALICE)
    with client(daemon) as anyone:
        anyone.put(blocks, LAYOUT.num_layers)
        anyone.get([b for b, _ in blocks])
    daemon.stop()
    written = log_path.read_text() + daemon.log()
    assert len(written.splitlines()) >= 6
    for block, _ in blocks:
        assert block.key.hex() not in written and block.parent.hex() not in written
    assert "alice's salt" not in written and tenant_of("alice's salt").hex() not in written


# -- the data channel ---------------------------------------------------------------------------------

def data_calls(daemon, token) -> float:
    """How many Gets the daemon served on its data channel (TCP or Unix socket)."""
    stats = Stats.from_pb(call(daemon, "Stats", pb.StatsRequest(), token, pb.StatsResponse))
    return stats.value("kvstore_rpc_seconds_count", method="data.Get")


# the frame that ends the daemon's answer to the last frame sent, when it answers in full
LAST_ANSWER = {wire.AUTH: wire.AUTHED, wire.GET: wire.DONE}


def data_frames(daemon, frames, tls_context=None):
    """Send raw frames on the TCP data channel; the kinds of what comes back until the daemon closes the
    connection, sends an error, or has answered the last frame in full (no clock decides that nothing more
    comes: the deadline only ends a hang)."""
    sock = socket.create_connection(("127.0.0.1", daemon.data_port), timeout=60)
    if tls_context is not None:
        sock = tls_context.wrap_socket(sock, server_hostname="127.0.0.1")
    answers = []
    with sock:
        try:
            for kind, head in frames:
                sock.sendall(wire.frame(kind, head))
        except OSError:
            return answers
        deadline = time.monotonic() + 60
        while not answers or answers[-1] != LAST_ANSWER.get(frames[-1][0]):
            try:
                answers.append(read_frame(sock, deadline)[0])
            except OSError:  # reset, or a TLS alert: the daemon would not talk
                return answers
            except TransportError as exc:
                assert exc.code != "DEADLINE_EXCEEDED", f"a hang: the daemon neither answered nor closed ({answers})"
                return answers if exc.code == "UNAVAILABLE" else [*answers, exc.code]  # closed, or an error
        return answers


@pytest.mark.parametrize("shared_memory", ["off", "auto"])  # TCP, and the Unix socket with lent memory
def test_the_data_channel_checks_tokens_and_tenants_too(daemons, token_file, shared_memory):
    daemon, = daemons(1, "--auth-tokens", str(token_file))
    alices = items(ALICE)
    blocks = [b for b, _ in alices]
    config = dict(lookup_timeout_s=5, shared_memory=shared_memory)
    with KVClient(ClientConfig((daemon.address,), token=TOKENS["alice"], **config)) as alice, \
            KVClient(ClientConfig((daemon.address,), token=TOKENS["bob"], **config)) as bob:
        assert alice.put(alices, LAYOUT.num_layers).stored == 3
        before = data_calls(daemon, TOKENS["ops"])
        assert [g.payload for g in alice.get(blocks)] == [p for _, p in alices]
        assert bob.get(blocks) == []
        assert data_calls(daemon, TOKENS["ops"]) >= before + 2, "the Gets went over the data channel"
        assert not alice.stats.data_fallbacks and not bob.stats.data_fallbacks


def test_the_data_channel_refuses_frames_before_a_good_token(daemons, token_file):
    daemon, = daemons(1, "--auth-tokens", str(token_file))
    get = pb.GetRequest(keys=[b.key for b, _ in items(ALICE)]).SerializeToString()
    assert data_frames(daemon, [(wire.GET, get)]) == ["UNAUTHENTICATED"]
    assert data_frames(daemon, [(wire.AUTH, pb.DataAuth(token="kvs_guess").SerializeToString()),
                                (wire.GET, get)]) == ["UNAUTHENTICATED"]
    reader = pb.DataAuth(token=TOKENS["reader"]).SerializeToString()
    assert data_frames(daemon, [(wire.AUTH, reader), (wire.PUT, pb.PutHead(record_bytes=100).SerializeToString())]) \
        == [wire.AUTHED, "PERMISSION_DENIED"]
    answered = data_frames(daemon, [(wire.AUTH, reader), (wire.GET, get)])
    assert answered[0] == wire.AUTHED and answered[-1] == wire.DONE  # three MISSING parts, then DONE


def test_tls_and_mutual_tls_on_the_data_channel(daemons, tmp_path, token_file):
    pki = make_pki(tmp_path / "pki")
    daemon, = daemons(1, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                      "--tls-client-ca", str(pki.ca), "--auth-tokens", str(token_file))
    blocks = items(ALICE)
    config = ClientConfig((daemon.address,), token=TOKENS["alice"], tls_ca=str(pki.ca), tls_cert=str(pki.client_cert),
                          tls_key=str(pki.client_key), shared_memory="off", lookup_timeout_s=5)
    with KVClient(config) as alice:
        assert alice.put(blocks, LAYOUT.num_layers).stored == 3
        assert [g.payload for g in alice.get([b for b, _ in blocks])] == [p for _, p in blocks]
        assert not alice.stats.data_fallbacks
    auth = pb.DataAuth(token=TOKENS["alice"]).SerializeToString()
    assert data_frames(daemon, [(wire.AUTH, auth)]) == [], "plaintext frames on a TLS port get nothing back"
    no_certificate = ssl.create_default_context(cafile=str(pki.ca))
    assert data_frames(daemon, [(wire.AUTH, auth)], no_certificate) == [], "a client without a certificate gets nothing"
    good = ssl.create_default_context(cafile=str(pki.ca))
    good.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    assert data_frames(daemon, [(wire.AUTH, auth)], good) == [wire.AUTHED]


def test_before_its_token_a_client_can_make_the_daemon_hold_almost_nothing(daemons, token_file):
    """Regression: a first frame declaring an 8 MiB head was read (and held) before the token was checked."""
    daemon, = daemons(1, "--auth-tokens", str(token_file))
    for kind in (wire.AUTH, wire.GET):
        with socket.create_connection(("127.0.0.1", daemon.data_port), timeout=5) as sock:
            sock.sendall(wire.PREFIX.pack(wire.MAGIC, kind, 8 * 2**20))  # the head never follows
            with pytest.raises(TransportError) as refused:
                read_frame(sock, time.monotonic() + 60)  # a hang guard
            assert refused.value.code == "UNAUTHENTICATED"


def test_what_a_daemon_writes_is_its_users_alone(daemons, tmp_path):
    log_path = tmp_path / "logs" / "access.log"
    daemon, = daemons(1, "--access-log", str(log_path))
    with client(daemon) as anyone:
        anyone.put(items(ALICE), LAYOUT.num_layers)
    daemon.stop()
    written = [daemon.data_dir, log_path, *daemon.data_dir.rglob("*")]
    assert len(written) >= 8
    for path in written:
        mode = path.stat().st_mode
        if path.is_socket():
            continue
        assert mode & 0o077 == 0, f"{path} is open to others ({oct(mode & 0o777)})"
