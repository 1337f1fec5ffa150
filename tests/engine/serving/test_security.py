"""A decode instance with the daemon's tokens and TLS: every call needs a known token with the verb it uses,
a salt within the token's tenants, and (with a client CA) a client certificate that CA signed."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.serving.client import InstanceClient, InstanceError, generate_request
from engine.serving.processes import start_instances
from engine.serving.proto import pb
from kvstore.block import tenant_of
from kvstore.client import ClientConfig, KVClient
from kvstore.server.auth import new_token, token_entry
from tests.engine.serving.conftest import BLOCK, tokens
from tests.pki import make_pki

pytestmark = pytest.mark.integration

TOKENS = {name: new_token() for name in ("router", "engine", "tenant-t")}
OPTIONS = dict(kv_pages=32, block_tokens=BLOCK, max_running=4)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("instance-tokens") / "tokens.toml"
    path.write_text(token_entry("router", TOKENS["router"], None, ["read"])
                    + token_entry("engine", TOKENS["engine"], None, ["read", "write"])
                    + token_entry("tenant-t", TOKENS["tenant-t"], [tenant_of("t")], ["read", "write"]))
    return path


def refused(future_or_call) -> grpc.StatusCode:
    with pytest.raises(InstanceError) as caught:
        future_or_call()
    return caught.value.code


def test_what_a_client_sends_names_the_tenant_and_never_carries_the_salt():
    """docs/design.md section 3: the raw salt is never sent. An instance needs only the tenant (its digest), to
    key the prompt's namespace and to check a token's tenants, so that is what goes between processes."""
    salt = "a salt only the API server knows"
    request = generate_request(tokens(10), 4, salt=salt, session_id="s", from_handoff=True)
    assert salt.encode() not in request.SerializeToString()
    assert request.tenant == tenant_of(salt)
    for message in (pb.GenerateRequest, pb.EncodeRequest):  # no field of the protocol carries a salt
        assert not [name for name in message.DESCRIPTOR.fields_by_name if "salt" in name], message.DESCRIPTOR.name


def test_calls_need_mutual_tls_and_a_token_with_their_verb(model_dir, token_file, tmp_path):
    pki = make_pki(tmp_path / "pki")
    tls = dict(tls_ca=str(pki.ca), tls_cert=str(pki.client_cert), tls_key=str(pki.client_key))
    with start_instances(model_dir, 1, auth_tokens=token_file, tls_cert=pki.server_cert, tls_key=pki.server_key,
                         tls_client_ca=pki.ca, client={"token": TOKENS["engine"], **tls}, **OPTIONS) as instances:
        address = f"127.0.0.1:{instances[0].port}"
        reply = instances[0].client.generate(tokens(10), 4).result(30)  # TLS with the test PKI, a writer's token
        assert len(reply.tokens) == 4

        def load(**settings):
            with InstanceClient(address, **settings) as client:
                return client.load(timeout_s=30)

        unavailable, unauthenticated = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED
        assert refused(lambda: load(token=TOKENS["engine"])) == unavailable  # plaintext
        assert refused(lambda: load(token=TOKENS["engine"], tls_ca=str(pki.ca))) == unavailable  # no client cert
        assert refused(lambda: load(token=TOKENS["engine"], tls_ca=str(pki.ca), tls_cert=str(pki.rogue_cert),
                                    tls_key=str(pki.rogue_key))) == unavailable  # another CA's
        assert refused(lambda: load(**tls)) == unauthenticated  # no token
        assert refused(lambda: load(token="kvs_guess", **tls)) == unauthenticated
        with InstanceClient(address, token=TOKENS["router"], **tls) as router:  # read: Load, not Generate
            assert router.load()["kv_capacity"] == 32 * BLOCK
            assert refused(lambda: router.generate(tokens(10), 4).result(30)) == grpc.StatusCode.PERMISSION_DENIED
        credentials = grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.client_key.read_bytes(),
                                                   pki.client_cert.read_bytes())
        with grpc.secure_channel(address, credentials) as channel:  # probes need no token
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert instances.stop() == [0]


def test_a_token_generates_only_in_its_tenants_namespaces_on_a_store_that_checks_tokens(model_dir, token_file,
                                                                                        daemons, tmp_path):
    store_tokens = {name: new_token() for name in ("instance", "ops")}
    daemon_tokens = tmp_path / "daemon-tokens.toml"
    daemon_tokens.write_text(token_entry("instance", store_tokens["instance"], None, ["read", "write"])
                             + token_entry("ops", store_tokens["ops"], None, ["admin"]))
    (daemon,) = daemons(1, "--auth-tokens", str(daemon_tokens))
    with start_instances(model_dir, 1, servers=[daemon.address], auth_tokens=token_file,
                         store_token=store_tokens["instance"], client={"token": TOKENS["tenant-t"]},
                         **OPTIONS) as instances:
        client = instances[0].client
        assert client.generate(tokens(3 * BLOCK), 3, salt="t").result(30).prefill_path == "cold"
        for salt in ("u", None):  # another tenant's, and the one of no salt
            options = {} if salt is None else {"salt": salt}
            with pytest.raises(InstanceError, match="PERMISSION_DENIED: token 'tenant-t' may not reach") as caught:
                client.generate(tokens(10), 3, **options).result(30)
            assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert instances.stop() == [0]  # its saves are flushed as it goes
    with KVClient(ClientConfig((daemon.address,), token=store_tokens["ops"])) as ops:
        stats = ops.server_stats()[daemon.address]
    assert stats.value("kvstore_blocks", traffic_class="chat") >= 3  # the prompt's blocks, stored with its store token
