"""Copies of another tenant's key cannot be turned into a timing signal.

With 65,536 copies of one of tenant B's keys in one Touch, Delete or Advise, tenant A got the same answer
as for a key never stored, but not in the same time (Touch 603 ms against 54, Delete 1,067 against 68,
Advise 654 against 74): the daemon did the present key's work once per copy. Now a key named many times
in one request is acted on once, for every tenant and verb; what remains is one key's work, well inside
the noise of one call.
"""

from __future__ import annotations

import os

import grpc
import pytest

from kvstore.block import KVLayout, Namespace
from kvstore.client import ClientConfig, KVClient
from kvstore.proto import method, pb
from kvstore.server.auth import new_token, token_entry

pytestmark = pytest.mark.crash

LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=32, dtype="float16")
ALICE = Namespace("probes", LAYOUT, block_tokens=16, salt="alice")
BOB = Namespace("probes", LAYOUT, block_tokens=16, salt="bob")
TOKENS = {name: new_token() for name in ("alice", "bob")}
COPIES = 65_536


@pytest.fixture
def daemon(daemons, tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(token_entry("alice", TOKENS["alice"], [ALICE.tenant], ["read", "write", "delete"])
                    + token_entry("bob", TOKENS["bob"], [BOB.tenant], ["read", "write", "delete"]))
    daemon, = daemons(1, "--auth-tokens", str(path))
    return daemon


def call(daemon, name: str, request, token: str) -> int:
    with grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 8 * 2**20)]) as channel:
        return channel.unary_unary(method(name), None, pb.CountResponse.FromString)(
            request.SerializeToString(), metadata=(("authorization", f"Bearer {token}"),), timeout=60).count


def stored(daemon, namespace, token: str, seed: int):
    (block,) = namespace.blocks(range(seed, seed + 16))
    with KVClient(ClientConfig((daemon.address,), token=token, transport="grpc")) as client:
        assert client.put([(block, os.urandom(namespace.block_bytes))], LAYOUT.num_layers).stored == 1
    return block


def requests(key: bytes) -> dict[str, object]:
    keys = [key] * COPIES
    return {"Touch": pb.KeysRequest(keys=keys), "Advise": pb.AdviseRequest(keys=keys, continues=True)}


def test_copies_of_a_key_are_acted_on_once(daemon):
    own = stored(daemon, ALICE, TOKENS["alice"], 0)
    for name, request in requests(own.key).items():
        assert call(daemon, name, request, TOKENS["alice"]) == 1, f"{name}: {COPIES} copies of one key"
    assert call(daemon, "Delete", pb.KeysRequest(keys=[own.key] * COPIES), TOKENS["alice"]) == 1


def test_another_tenants_key_answers_as_an_absent_one_and_is_left_alone(daemon):
    bobs = stored(daemon, BOB, TOKENS["bob"], 100)
    (never,) = BOB.blocks(range(200, 216))
    for key in (bobs.key, never.key):
        for name, request in requests(key).items():
            assert call(daemon, name, request, TOKENS["alice"]) == 0, name
        assert call(daemon, "Delete", pb.KeysRequest(keys=[key] * COPIES), TOKENS["alice"]) == 0
    with KVClient(ClientConfig((daemon.address,), token=TOKENS["alice"], transport="grpc")) as client:
        assert client.present([bobs, never]) == [False, False], "another tenant's block is absent, one by one too"
    with KVClient(ClientConfig((daemon.address,), token=TOKENS["bob"], transport="grpc")) as client:
        assert client.lookup([bobs]) == 1 and client.present([never, bobs]) == [False, True]
