"""Membership targets and registration settings, checked without a peer: what a client or a daemon refuses
before it would ever reach etcd or DNS. (tests/kvstore/client/test_membership.py has the peers, in
`make test-multihost`; these run in `make test`.)"""

import pytest

from kvstore.client import ClientConfig
from kvstore.server.config import ServerConfig

pytestmark = pytest.mark.unit


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
    with pytest.raises(ValueError, match="etcd_tls_cert and etcd_tls_key go together"):
        ServerConfig(data_dir=tmp_path, etcd_tls_cert=tmp_path)
    with pytest.raises(ValueError, match="etcd_user and etcd_password_file go together"):
        ServerConfig(data_dir=tmp_path, etcd_user="daemon")
    (tmp_path / "pw").write_text("s3cret\n")
    access = ServerConfig(data_dir=tmp_path, etcd_user="daemon", etcd_password_file=tmp_path / "pw").etcd_access()
    assert (access.user, access.password, access.ca) == ("daemon", "s3cret", None)
