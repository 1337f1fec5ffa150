"""Who may do what: bearer tokens scoped to tenants and verbs (docs/design.md section 6, invariant 8).

A token file (TOML) lists the tokens a daemon accepts; it holds SHA-256 digests, never tokens:

    [[tokens]]
    name = "engine-a"                      # shown in logs instead of the token
    sha256 = "9f86d081884c7d65..."         # hex SHA-256 of the token (`kvstore token new` prints both)
    tenants = ["3f1c...", "a07e..."]       # tenant digests (`kvstore tenant SALT`), or ["*"] for all
    verbs = ["read", "write"]              # of read, write, delete, admin

A presented token is hashed and its SHA-256 looked up among the listed digests: the lookup's timing can
only tell how much of a digest matched, which says nothing about a token without a preimage of SHA-256,
and it costs the same for ten entries or a hundred thousand.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvstore.block import NO_TENANT

VERBS = ("read", "write", "delete", "admin")
ALL_TENANTS = "*"
_TENANT_HEX = 32  # a tenant digest is 16 bytes


class AuthConfigError(ValueError):
    """The token file is missing or malformed; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: its token's name, the tenants it reaches (None: all) and its verbs."""

    name: str
    tenants: frozenset[bytes] | None
    verbs: frozenset[str]

    def may(self, verb: str) -> bool:
        return verb in self.verbs


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token() -> str:
    return "kvs_" + secrets.token_urlsafe(32)


class Authenticator:
    def __init__(self, entries: list[tuple[bytes, Principal]]) -> None:
        self._by_digest = dict(entries)

    @classmethod
    def from_file(cls, path: Path) -> Authenticator:
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            raise AuthConfigError(f"token file {path} does not exist") from None
        except OSError as exc:
            raise AuthConfigError(f"token file {path} is not readable: {exc.strerror}") from None
        document = _toml(raw, path)
        tokens = document.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise AuthConfigError(f"token file {path} must list at least one [[tokens]] entry")
        entries: dict[bytes, Principal] = {}
        names: set[str] = set()
        for number, item in enumerate(tokens, 1):
            where = f"token file {path}, entry {number}"
            if not isinstance(item, dict):
                raise AuthConfigError(f"{where}: expected a table")
            digest, principal = _entry(item, where)
            if principal.name in names:
                raise AuthConfigError(f"{where}: the name {principal.name!r} is used twice")
            if digest in entries:
                raise AuthConfigError(f"{where} ({principal.name}): the same token as an earlier entry; one "
                                      "token, one entry (a rotation replaces the entry)")
            names.add(principal.name)
            entries[digest] = principal
        return cls(list(entries.items()))

    def authenticate(self, token: str | None) -> Principal | None:
        """The principal of `token`, or None."""
        if not token:
            return None
        return self._by_digest.get(token_digest(token))


def _toml(raw: bytes, path: Path) -> dict:
    """The token file's TOML; a UTF-8 byte-order mark (some editors write one) is no part of it."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise AuthConfigError(f"token file {path} is UTF-16; TOML is UTF-8: save it as UTF-8")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise AuthConfigError(f"token file {path} is not UTF-8 text (byte {exc.start}); TOML is UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AuthConfigError(f"token file {path} is not valid TOML: {exc}") from None


def _entry(item: dict, where: str) -> tuple[bytes, Principal]:
    unknown = set(item) - {"name", "sha256", "tenants", "verbs"}
    if unknown:
        raise AuthConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: name, sha256, tenants, verbs")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise AuthConfigError(f"{where}: needs a non-empty name")
    try:
        digest = bytes.fromhex(str(item.get("sha256", "")))
    except ValueError:
        digest = b""
    if len(digest) != 32:
        raise AuthConfigError(f"{where} ({name}): sha256 must be the 64-hex-digit SHA-256 of the token")
    verbs = item.get("verbs")
    if not isinstance(verbs, list) or not verbs or any(v not in VERBS for v in verbs):
        raise AuthConfigError(f"{where} ({name}): verbs must list some of {', '.join(VERBS)}, got {verbs!r}")
    tenants = item.get("tenants")
    if not isinstance(tenants, list) or not tenants:
        raise AuthConfigError(f"{where} ({name}): tenants must list tenant digests, or ['*'] for all")
    if ALL_TENANTS in tenants:
        if len(tenants) != 1:
            raise AuthConfigError(f"{where} ({name}): '*' stands alone in tenants")
        scope = None
    else:
        scope = frozenset(_tenant(t, where, name) for t in tenants)
    return digest, Principal(name, scope, frozenset(verbs))


def _tenant(text: object, where: str, name: str) -> bytes:
    try:
        tenant = bytes.fromhex(str(text))
    except ValueError:
        tenant = b""
    if len(tenant) * 2 != _TENANT_HEX:
        raise AuthConfigError(f"{where} ({name}): {text!r} is not a tenant digest ({_TENANT_HEX} hex digits; "
                              "`kvstore tenant SALT` prints one)")
    if tenant == NO_TENANT:
        raise AuthConfigError(f"{where} ({name}): the all-zero digest is no tenant (it marks records written "
                              "before records named one); `kvstore tenant SALT` prints a tenant's digest")
    return tenant


def bearer(metadata) -> str | None:
    """The token of an `authorization: Bearer <token>` entry in gRPC metadata, if any."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def token_entry(name: str, token: str, tenants: list[bytes] | None, verbs: list[str]) -> str:
    """The TOML entry of a token file that accepts `token` (`kvstore token new` prints it)."""
    listed = [ALL_TENANTS] if tenants is None else [t.hex() for t in tenants]
    # A TOML array of strings is written like a JSON one.
    return (f"[[tokens]]\nname = {json.dumps(name)}\nsha256 = \"{token_digest(token).hex()}\"\n"
            f"tenants = {json.dumps(listed)}\nverbs = {json.dumps(verbs)}\n")
