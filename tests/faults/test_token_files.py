"""Token files a careless or huge deployment writes: 20,000 entries took 17 s to
load (a quadratic duplicate check) and a linear scan on every call; a file starting with a byte-order
mark was refused as "Invalid statement"."""

from __future__ import annotations

import pytest

from kvstore.server import auth as auth_module
from kvstore.server.auth import AuthConfigError, Authenticator, token_entry

pytestmark = pytest.mark.unit

TENANT = bytes(range(1, 17))
ENTRIES = 50_000


class _CountedDigest(bytes):
    """A listed digest that counts the comparisons made with it. Linear work compares a digest with at most one
    other per entry (a hash lookup compares only on equal hashes); past that the check is quadratic, and it
    stops there instead of running on for minutes."""

    compared = [0]

    def __eq__(self, other: object) -> bool:
        _CountedDigest.compared[0] += 1
        assert _CountedDigest.compared[0] <= ENTRIES, "digests compared with every earlier or listed one: quadratic"
        return bytes.__eq__(self, other)

    __hash__ = bytes.__hash__


def test_fifty_thousand_entries_load_and_each_token_finds_its_own_in_linear_work(tmp_path, monkeypatch):
    path = tmp_path / "tokens.toml"
    path.write_text("".join(token_entry(f"engine-{i}", f"token-{i}", [TENANT], ["read"]) for i in range(ENTRIES)))
    entry = auth_module._entry

    def counted_entry(item: dict, where: str):
        digest, principal = entry(item, where)
        return _CountedDigest(digest), principal

    monkeypatch.setattr(auth_module, "_entry", counted_entry)
    monkeypatch.setattr(_CountedDigest, "compared", [0])
    auth = Authenticator.from_file(path)
    for i in (0, 27_777, 49_999):
        assert auth.authenticate(f"token-{i}").name == f"engine-{i}"
    assert auth.authenticate("token-50000") is None and auth.authenticate("") is None
    assert _CountedDigest.compared[0] <= ENTRIES


def test_a_duplicate_among_many_is_still_named(tmp_path):
    path = tmp_path / "tokens.toml"
    entries = [token_entry(f"engine-{i}", f"token-{i}", [TENANT], ["read"]) for i in range(5_000)]
    entries.append(token_entry("again", "token-4321", [TENANT], ["read"]))
    path.write_text("".join(entries))
    with pytest.raises(AuthConfigError, match="entry 5001 \\(again\\): the same token as an earlier entry"):
        Authenticator.from_file(path)


def test_a_byte_order_mark_is_no_part_of_the_toml(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_bytes(b"\xef\xbb\xbf" + token_entry("engine", "secret", [TENANT], ["read"]).encode())
    assert Authenticator.from_file(path).authenticate("secret").name == "engine"


@pytest.mark.parametrize("raw, message", [
    (token_entry("engine", "secret", [TENANT], ["read"]).encode("utf-16"), "is UTF-16; TOML is UTF-8"),
    (b"[[tokens]]\nname = \"\xff\xfe\"\n", "is not UTF-8 text"),
    (b"[[tokens\n", "is not valid TOML"),
])
def test_a_file_in_the_wrong_encoding_says_so(tmp_path, raw, message):
    path = tmp_path / "tokens.toml"
    path.write_bytes(raw)
    with pytest.raises(AuthConfigError, match=message):
        Authenticator.from_file(path)
