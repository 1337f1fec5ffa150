"""Token files: what is accepted, what is refused with a message naming the entry."""

import pytest

from kvstore.block import tenant_of
from kvstore.proto import method
from kvstore.server.auth import AuthConfigError, Authenticator, new_token, token_entry
from kvstore.server.grpc_auth import verb_of

pytestmark = pytest.mark.unit


def write(tmp_path, text):
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    return path


def test_tokens_resolve_to_their_scope_and_verbs(tmp_path):
    reader, admin = new_token(), new_token()
    path = write(tmp_path, token_entry("reader", reader, [tenant_of("a"), tenant_of("b")], ["read"])
                 + token_entry("admin", admin, None, ["read", "write", "delete", "admin"]))
    auth = Authenticator.from_file(path)
    principal = auth.authenticate(reader)
    assert principal.name == "reader" and principal.tenants == {tenant_of("a"), tenant_of("b")}
    assert principal.may("read") and not principal.may("write")
    assert auth.authenticate(admin).tenants is None
    assert auth.authenticate(reader + "x") is None
    assert auth.authenticate("") is None and auth.authenticate(None) is None


def test_the_token_file_holds_digests_not_tokens(tmp_path):
    token = new_token()
    path = write(tmp_path, token_entry("a", token, [tenant_of("a")], ["read"]))
    assert token not in path.read_text()


@pytest.mark.parametrize("text, message", [
    ("", "at least one"),
    ("[[tokens]]\nname = 'a'\nsha256 = 'ab'\ntenants = ['*']\nverbs = ['read']\n", "SHA-256"),
    ("[[tokens]]\nname = 'a'\nsha256 = '" + "ab" * 32 + "'\ntenants = ['*']\nverbs = ['fly']\n", "verbs"),
    ("[[tokens]]\nname = 'a'\nsha256 = '" + "ab" * 32 + "'\ntenants = ['nothex']\nverbs = ['read']\n", "tenant digest"),
    ("[[tokens]]\nname = 'a'\nsha256 = '" + "ab" * 32 + "'\ntenants = ['*', '" + "00" * 16 + "']\nverbs = ['read']\n",
     "stands alone"),
    ("[[tokens]]\nname = 'a'\nsha256 = '" + "ab" * 32 + "'\ntenants = ['*']\nverbs = ['read']\nsecret = 'x'\n",
     "unknown field"),
    (("[[tokens]]\nname = 'a'\nsha256 = '" + "ab" * 32 + "'\ntenants = ['*']\nverbs = ['read']\n") * 2, "used twice"),
    ("not toml [", "TOML"),
])
def test_bad_token_files_are_refused_with_the_entry_named(tmp_path, text, message):
    with pytest.raises(AuthConfigError, match=message):
        Authenticator.from_file(write(tmp_path, text))


def test_a_missing_token_file_is_named(tmp_path):
    with pytest.raises(AuthConfigError, match="does not exist"):
        Authenticator.from_file(tmp_path / "nope.toml")


def test_every_rpc_has_a_verb_and_unknown_methods_need_admin():
    assert verb_of(method("Get")) == "read" and verb_of(method("Put")) == "write"
    assert verb_of(method("Delete")) == "delete" and verb_of(method("Stats")) == "admin"
    assert verb_of(method("Info")) == ""
    assert verb_of(method("SomethingNew")) == "admin"


def test_one_token_one_entry_and_no_zero_tenant(tmp_path):
    token = new_token()
    twice = token_entry("a", token, [tenant_of("a")], ["read"]) + token_entry("b", token, None, ["admin"])
    with pytest.raises(AuthConfigError, match="same token"):
        Authenticator.from_file(write(tmp_path, twice))
    with pytest.raises(AuthConfigError, match="all-zero"):
        Authenticator.from_file(write(tmp_path, token_entry("a", token, [bytes(16)], ["read"])))
